"""Partial attention over host-tier KV blocks, on the CPU (the kernel behind ``HostAttention``).

``host_partial`` computes, for each of W requests, the attention of its P query positions over
all keys of its host blocks (no mask: the blocks are history strictly before the queries) and
returns it as a partial, normalised within those keys: out ``[W, P, H, D]`` and the log-sum-exp
of the scaled scores ``[W, P, H]``, both fp32, ready for the exact online-softmax merge with the
device's partials (``WaveAttention.add_partial``).

How, each choice measured on the 2-core dev VM (AMD EPYC, torch 2.13 CPU) with
``bench/host_kernel.py`` (results and its variants table in ``bench/results/host-kernel.txt``;
fp32, block 128, a host tier far past the caches, one thread):

- One fused call per piece of keys: torch's CPU flash kernel, which returns the log-sum-exp with
  the output, with the GQA group folded into query rows (``[1, kv, g * P, D]``) so K and V are
  read once per kv head. With the choices below, against the old per-request matmul +
  logsumexp + exp + matmul path: geometric mean 1.85x at P = 1..17 (1.06x for one request of
  8 blocks at P = 1, up to 3.7x for 4 requests of 40 blocks) and 2.7x at P = 256..1024.
- A request with at most ``GATHER_MAX_BYTES`` of K is gathered whole (K and V copied into a
  scratch buffer, one kernel call); a bigger one is attended in place, one call per run of
  consecutive ids on strided views of the host tensor, merged by log-sum-exp. For kv 2, D 64
  (up to 40 blocks = 2.5 MiB of K) the copy into cache wins even for one contiguous run:
  P = 1, 4 x 40 blocks: 11.6 vs 7.2 GB/s contiguous, 9.6 vs 4.0 GB/s scattered (which also pays
  one call per block). For kv 8, D 128 (512 KiB of K a block) the copy no longer stays in cache
  and views win: 11.3 vs 7.9 GB/s for one run of 8 blocks, 9.7 vs 6.5 for 4 x 40 contiguous,
  and still 7.7 vs 6.9 for 4 x 40 scattered. Identical paths differ by up to ~1.4x between
  rows of one run on the shared VM, so only gaps past that are read as real.
- Each thread keeps its scratch buffer between calls: a fresh multi-MB tensor can cost page
  faults on every call. How much depends on the allocator's state: within noise in the final
  run, 3.7x (2.8 vs 10.4 GB/s, kv 2, 4 x 40 scattered, P = 1) in an earlier one.
- Batching requests with equal block counts into one call (a gather into ``[W, kv, N, D]``) did
  not pay in a one-off check (hot cache, kv 2, D 64, P = 1): 183 vs 188 us for 4 x 5 blocks,
  353 vs 321 us for 4 x 10; not kept, not in the bench.
- bf16 / fp16 storage is always gathered, converted into the fp32 scratch on the way (one copy
  per run, needed anyway).
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from specstream.attention.streamed import CPU_FLASH, merge_all

# A request with at most this many bytes of K is gathered whole (K and V into the scratch, one
# kernel call); a bigger one is attended in place, one call per run of consecutive ids, merged.
# Measured either side: 2.5 MiB (kv 2, D 64, 40 blocks) was faster gathered, 4 MiB (kv 8,
# D 128, 8 blocks) faster in place, and so was every bigger request of kv 8, even scattered.
GATHER_MAX_BYTES = 3 << 20

# Per-thread scratch for gathered K and V ([2, num_blocks, block_size, kv, D] fp32, grown on
# demand): ``HostAttention`` calls this from its worker threads, one request at a time each.
_scratch = threading.local()


def host_partial(
    host: Tensor,  # [num_layers, 2, num_host_blocks, block_size, kv, D]; 0 = K, 1 = V
    layer: int,
    q: Tensor,  # [W, P, H, D], H = g * kv
    blocks: list[tuple[int, ...]],  # request w's host block ids, any order
    block_size: int,
    scale: float,
) -> tuple[Tensor, Tensor]:  # out [W, P, H, D] fp32, lse [W, P, H] fp32
    """Attention of each request's queries over all keys of its host ``blocks`` of ``layer``,
    as a partial: output normalised within those keys and the log-sum-exp of the scaled scores.
    A request with no blocks gets output 0 and lse -inf (it weighs nothing in a merge).

    Requests whose blocks start with the same run (a shared prefix, ``shared_prefixes``) attend
    it in one call, their query rows stacked: its K and V are read once for all of them; the
    rest of each request's blocks is its own call, merged exactly."""
    w, p, h, d = q.shape
    kv = host.shape[4]
    assert host.shape[3] == block_size and host.shape[5] == d and h % kv == 0
    g = h // kv
    # Fold the GQA group into query rows: [W, kv, g * P, D], rows ordered (g, p).
    qf = q.float().view(w, p, kv, g, d).permute(0, 2, 3, 1, 4).reshape(w, kv, g * p, d)
    shared: dict[int, tuple[Tensor, Tensor, int]] = {}  # row -> its prefix's partial, length
    for rows, prefix in shared_prefixes(blocks):
        stacked = qf[rows].permute(1, 0, 2, 3).reshape(1, kv, len(rows) * g * p, d)
        out, lse = _request(host[layer], stacked, prefix, scale)
        out = out.view(kv, len(rows), g * p, d).transpose(0, 1)
        lse = lse.view(kv, len(rows), g * p).transpose(0, 1)
        for i, r in enumerate(rows):
            shared[r] = (out[i : i + 1], lse[i : i + 1], len(prefix))
    outs, lses = [], []
    for r in range(w):
        head = shared.get(r)
        rest = blocks[r][head[2] :] if head is not None else blocks[r]
        if head is not None and not rest:
            out, lse = head[0], head[1]
        else:
            out, lse = _request(host[layer], qf[r : r + 1], rest, scale)
            if head is not None:
                out, lse = merge_all([head[0], out], [head[1], lse])
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs).view(w, kv, g, p, d).permute(0, 3, 1, 2, 4).reshape(w, p, h, d)
    lse = torch.cat(lses).view(w, kv, g, p).permute(0, 3, 1, 2).reshape(w, p, h)
    return out, lse


def shared_prefixes(blocks: list[tuple[int, ...]]) -> list[tuple[list[int], tuple[int, ...]]]:
    """(rows, run): requests (two or more) whose blocks start with the same run of blocks, the
    longest they all start with."""
    by_first: dict[int, list[int]] = {}
    for r, ids in enumerate(blocks):
        if ids:
            by_first.setdefault(ids[0], []).append(r)
    out = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        n = min(len(blocks[r]) for r in rows)
        first = blocks[rows[0]]
        common = 1
        while common < n and all(blocks[r][common] == first[common] for r in rows):
            common += 1
        out.append((rows, first[:common]))
    return out


def blocks_read(blocks: list[tuple[int, ...]]) -> int:
    """Host blocks ``host_partial`` reads for ``blocks`` (a shared prefix once)."""
    saved = sum((len(rows) - 1) * len(run) for rows, run in shared_prefixes(blocks))
    return sum(map(len, blocks)) - saved


def _request(kv_layer: Tensor, q: Tensor, ids: tuple[int, ...],
             scale: float) -> tuple[Tensor, Tensor]:
    """One request: ``kv_layer`` ``[2, num_host_blocks, block_size, kv, D]``, ``q``
    ``[1, kv, rows, D]`` fp32; returns out ``[1, kv, rows, D]`` and lse ``[1, kv, rows]``."""
    if not ids:
        return torch.zeros_like(q), q.new_full(q.shape[:-1], float("-inf"))
    runs = _runs(ids)
    block_bytes = kv_layer[0, 0].numel() * kv_layer.element_size()
    if kv_layer.dtype == torch.float32 and len(ids) * block_bytes > GATHER_MAX_BYTES:
        # too big to gather into cache: every run in place, merged
        outs, lses = [], []
        for b0, n in runs:
            out, lse = _attend(q, kv_layer[0, b0:b0 + n], kv_layer[1, b0:b0 + n], scale)
            outs.append(out)
            lses.append(lse)
        return merge_all(outs, lses)
    k, v = _gather(kv_layer, runs)
    return _attend(q, k, v, scale)


def _runs(ids: tuple[int, ...]) -> list[tuple[int, int]]:
    """``ids`` as (first id, length) runs of consecutive ids, in order."""
    runs = []
    start = prev = ids[0]
    for b in ids[1:]:
        if b != prev + 1:
            runs.append((start, prev + 1 - start))
            start = b
        prev = b
    runs.append((start, prev + 1 - start))
    return runs


def _gather(kv_layer: Tensor, runs: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    """The blocks of ``runs``, in order, copied to this thread's fp32 scratch:
    K, V ``[n, block_size, kv, D]``."""
    n = sum(length for _, length in runs)
    shape = (2, n, *kv_layer.shape[2:])
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.shape[2:] != shape[2:] or buf.shape[1] < n:
        buf = _scratch.buf = kv_layer.new_empty(shape, dtype=torch.float32)
    k, v = buf[0, :n], buf[1, :n]
    if kv_layer.dtype == torch.float32:
        idx = torch.tensor([b for b0, length in runs for b in range(b0, b0 + length)])
        torch.index_select(kv_layer[0], 0, idx, out=k)
        torch.index_select(kv_layer[1], 0, idx, out=v)
    else:  # convert on the way, one copy per run
        at = 0
        for b0, length in runs:
            k[at:at + length].copy_(kv_layer[0, b0:b0 + length])
            v[at:at + length].copy_(kv_layer[1, b0:b0 + length])
            at += length
    return k, v


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``q`` ``[1, kv, rows, D]`` over all of ``k``, ``v`` ``[n, block_size, kv, D]`` fp32 (any
    strides with D contiguous): out ``[1, kv, rows, D]``, lse ``[1, kv, rows]``."""
    kv, d = q.shape[1], q.shape[3]
    kt = k.reshape(-1, kv, d).permute(1, 0, 2).unsqueeze(0)  # [1, kv, N, D], a view
    vt = v.reshape(-1, kv, d).permute(1, 0, 2).unsqueeze(0)
    if CPU_FLASH is not None:
        out, lse = CPU_FLASH(q, kt, vt, 0.0, False, scale=scale)
        return out, lse
    s = torch.matmul(q, kt.transpose(-1, -2)).mul_(scale)  # [1, kv, rows, N]
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(s.sub_(lse.unsqueeze(-1)).exp_(), vt), lse
