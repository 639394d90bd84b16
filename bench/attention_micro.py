"""Micro-benchmark: restore-then-attend vs streamed chunked attention over an emulated link.

One attention layer (8 query heads, 2 kv heads, head_dim 64, q+1 = 5 query positions, fp32) over
histories of 2K..32K tokens held in host tensors, on the CPU transfer backend with an emulated
link (`--link-gbps`):

(a) restore: copy the whole history with one h2d, wait, then attend over it (+ the new tokens);
(b) streamed: a ring of `--staging-buffers` buffers of `--chunk-tokens` tokens; the first copies
    are issued up front, a buffer is refilled as soon as the attention reading it has finished,
    every chunk is attended as it lands and merged with online softmax.

Both paths use the same `partial_attention` kernel, so the gap measures the schedule only; both
are checked against `full_attention` (untimed). Floor = max(link alone, compute alone).

    python bench/attention_micro.py [--link-gbps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from specstream.attention import (
    AttentionAccumulator,
    causal_mask,
    full_attention,
    partial_attention,
)
from specstream.backends import TransferBackend, TransferHandle, limit_compute_threads, make_backend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_Q = 8, 2, 64, 5
SCALE = HEAD_DIM**-0.5


@dataclass(frozen=True)
class Row:
    history: int  # tokens of cold history
    restore_s: float  # (a) restore everything, then attend
    streamed_s: float  # (b) streamed chunks through the staging ring
    link_s: float  # copies alone (through the ring, no compute)
    compute_s: float  # chunked attention alone (history already on the device)
    restore_over_floor: float  # (a) / max(link, compute)
    streamed_over_floor: float  # (b) / max(link, compute)
    staging_bytes: int  # peak device staging bytes of (b)
    restore_bytes: int  # device bytes (a) needs for the restored history


def attend_new(q: Tensor, new_kv: Tensor, acc: AttentionAccumulator) -> None:
    """The resident piece: the new tokens, causal among themselves."""
    # q: [num_q, heads, D]; new_kv: [num_q, 2, kv_heads, D]
    acc.add(*partial_attention(q, new_kv[:, 0], new_kv[:, 1], SCALE, causal_mask(NUM_Q, NUM_Q)))


def run_restore(
    backend: TransferBackend, q: Tensor, hist: Tensor, dev: Tensor, new_kv: Tensor
) -> Tensor:
    """(a): one copy of the whole history, wait, then attend."""
    backend.h2d(dev, hist, tag="restore").wait()
    acc = AttentionAccumulator()
    acc.add(*partial_attention(q, dev[:, 0], dev[:, 1], SCALE))
    attend_new(q, new_kv, acc)
    return acc.result(q.dtype)


def run_streamed(
    backend: TransferBackend,
    q: Tensor,  # [num_q, heads, D]
    hist: Tensor,  # [T, 2, kv_heads, D] host
    ring: list[Tensor],  # staging buffers, each [chunk, 2, kv_heads, D]
    new_kv: Tensor | None,  # [num_q, 2, kv_heads, D]; None = copies only (link alone)
) -> Tensor | None:
    """(b): chunks through the ring; attend each as it lands. Without new_kv: the link alone."""
    chunk, total = ring[0].shape[0], hist.shape[0]
    starts = list(range(0, total, chunk))
    inflight: dict[int, tuple[TransferHandle, Tensor]] = {}

    def issue(i: int) -> None:
        n = min(chunk, total - starts[i])
        buf = ring[i % len(ring)][:n]
        inflight[i] = (backend.h2d(buf, hist[starts[i] : starts[i] + n], tag=i), buf)

    for i in range(min(len(ring), len(starts))):
        issue(i)
    acc = AttentionAccumulator()
    if new_kv is not None:
        attend_new(q, new_kv, acc)  # resident work first, while chunk 0 is in flight
    for i in range(len(starts)):
        handle, buf = inflight.pop(i)
        handle.wait()
        if new_kv is not None:
            acc.add(*partial_attention(q, buf[:, 0], buf[:, 1], SCALE))
        if i + len(ring) < len(starts):
            issue(i + len(ring))  # the buffer's reader has finished
    return acc.result(q.dtype) if new_kv is not None else None


def run_compute(q: Tensor, dev: Tensor, new_kv: Tensor, chunk: int) -> Tensor:
    """Chunked attention alone, the history already in device memory."""
    acc = AttentionAccumulator()
    attend_new(q, new_kv, acc)
    for s in range(0, dev.shape[0], chunk):
        acc.add(*partial_attention(q, dev[s : s + chunk, 0], dev[s : s + chunk, 1], SCALE))
    return acc.result(q.dtype)


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Best of `repeats` runs after a warm-up: the CI machine is shared, and the minimum is the
    figure least disturbed by other processes' time slices."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_history(args: argparse.Namespace, backend: TransferBackend, total: int) -> Row:
    gen = torch.Generator().manual_seed(total)
    q = torch.randn(NUM_Q, NUM_HEADS, HEAD_DIM, generator=gen)
    new_kv = torch.randn(NUM_Q, 2, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    hist = backend.alloc_host((total, 2, NUM_KV_HEADS, HEAD_DIM), torch.float32)
    hist.copy_(torch.randn(hist.shape, generator=gen))
    dev = backend.alloc_device(tuple(hist.shape), torch.float32).zero_()  # (a)'s full buffer
    ring = [
        backend.alloc_device((args.chunk_tokens, 2, NUM_KV_HEADS, HEAD_DIM), torch.float32).zero_()
        for _ in range(args.staging_buffers)
    ]

    out_a = run_restore(backend, q, hist, dev, new_kv)
    out_b = run_streamed(backend, q, hist, ring, new_kv)
    keys = torch.cat([hist, new_kv])  # [T + num_q, 2, kv_heads, D]
    ref = full_attention(q, keys[:, 0], keys[:, 1], SCALE, causal_mask(NUM_Q, total + NUM_Q))
    for name, out in (("restore", out_a), ("streamed", out_b)):
        assert out is not None
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-5, f"{name} differs from full attention at {total} tokens: {err:.2e}"

    restore_s = best_time(lambda: run_restore(backend, q, hist, dev, new_kv), args.repeats)
    streamed_s = best_time(lambda: run_streamed(backend, q, hist, ring, new_kv), args.repeats)
    link_s = best_time(lambda: run_streamed(backend, q, hist, ring, None), args.repeats)
    compute_s = best_time(lambda: run_compute(q, dev, new_kv, args.chunk_tokens), args.repeats)
    floor = max(link_s, compute_s)
    return Row(
        history=total,
        restore_s=restore_s,
        streamed_s=streamed_s,
        link_s=link_s,
        compute_s=compute_s,
        restore_over_floor=restore_s / floor,
        streamed_over_floor=streamed_s / floor,
        staging_bytes=sum(b.numel() * b.element_size() for b in ring),
        restore_bytes=dev.numel() * dev.element_size(),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--histories", default="2048,4096,8192,16384,32768")
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    parser.add_argument("--staging-buffers", type=int, default=2)
    parser.add_argument("--link-gbps", type=float, default=3.0, help="emulated link, GB/s")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)

    previous_threads = limit_compute_threads()
    backend = make_backend("cpu", link_gbps=args.link_gbps)
    try:
        rows = [bench_history(args, backend, int(h)) for h in args.histories.split(",")]
    finally:
        backend.close()
        torch.set_num_threads(previous_threads)

    kv_bytes = 2 * NUM_KV_HEADS * HEAD_DIM * 4
    print(
        f"one layer: {NUM_HEADS} q heads, {NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
        f"{NUM_Q} query positions, fp32 ({kv_bytes} B/token); cpu backend, emulated link "
        f"{args.link_gbps} GB/s; chunk {args.chunk_tokens} tokens x {args.staging_buffers} "
        f"staging buffers; compute on 1 thread; best of {args.repeats}"
    )
    header = (
        "history  (a) ms  (b) ms  link ms  compute ms  (a)/floor  (b)/floor  staging MB  (a) MB"
    )
    print(header)
    for r in rows:
        print(
            f"{r.history:7d} {r.restore_s * 1e3:7.2f} {r.streamed_s * 1e3:7.2f} "
            f"{r.link_s * 1e3:8.2f} {r.compute_s * 1e3:11.2f} {r.restore_over_floor:10.2f} "
            f"{r.streamed_over_floor:10.2f} {r.staging_bytes / 2**20:11.1f} "
            f"{r.restore_bytes / 2**20:7.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": [asdict(r) for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
