"""Micro-benchmark: host attention kernel, old per-request matmul path vs ``host_partial``.

One layer's partial attention of W requests over their host KV blocks (block 128, fp32), the
work ``HostAttention`` does per layer. Rate = bytes of KV attended per second,
``2 * num_blocks * block_size * kv * D * element_size`` per request (what the scheduler's
``host_attention="auto"`` split measures). The host tier is sized far past the CPU caches and
every call reads a different layer, so KV comes from memory as it does in serving. The two
methods alternate call by call; the median of the rounds is shown, for one thread and for
torch's default thread count, side by side. Both results are checked against each other.
A second table compares the choices inside ``host_partial`` with their alternatives.

Layouts of each request's block ids: ``contig`` one run of consecutive ids, ``runs4`` runs of
4 consecutive ids at scattered places, ``scatter`` no two ids consecutive.

    python bench/host_kernel.py [--rounds 9] [--quick]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor

from specstream.attention import host_kernel
from specstream.attention.host_kernel import host_partial

BLOCK = 128
HOST_BYTES = 640 << 20  # host tier size: far past the L3
Kernel = Callable[[Tensor, int, Tensor, list[tuple[int, ...]], int, float], tuple[Tensor, Tensor]]


def old_run(host: Tensor, layer: int, q: Tensor, blocks: list[tuple[int, ...]],
            block_size: int, scale: float) -> tuple[Tensor, Tensor]:
    """``HostAttention._run`` before ``host_partial`` (its math, without the bookkeeping)."""
    kv, d = host.shape[4], host.shape[5]
    w, p, h, _ = q.shape
    g = h // kv
    outs, lses = [], []
    for r in range(w):
        idx = torch.tensor(blocks[r], dtype=torch.long)
        k = host[layer, 0].index_select(0, idx).reshape(-1, kv, d).float()  # [N, kv, D]
        v = host[layer, 1].index_select(0, idx).reshape(-1, kv, d).float()
        qr = q[r].view(p, kv, g, d).permute(1, 2, 0, 3).reshape(kv, g * p, d)
        s = torch.matmul(qr, k.permute(1, 2, 0)).mul_(scale)  # [kv, g * P, N]
        lse = torch.logsumexp(s, dim=-1)  # [kv, g * P]
        out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.permute(1, 0, 2))
        outs.append(out.view(kv, g, p, d).permute(2, 0, 1, 3).reshape(p, h, d))
        lses.append(lse.view(kv, g, p).permute(2, 0, 1).reshape(p, h))
    return torch.stack(outs), torch.stack(lses)


def layout(kind: str, num_req: int, num_blocks: int, total: int,
           rng: random.Random) -> list[tuple[int, ...]]:
    """Block ids of ``num_req`` requests, disjoint, within ``total`` host blocks."""
    if kind == "contig":
        return [tuple(range(r * num_blocks, (r + 1) * num_blocks)) for r in range(num_req)]
    step = 1 if kind == "scatter" else 4
    # candidate run starts spaced step + 1 apart, so no two runs touch
    starts = list(range(0, total - step, step + 1))
    rng.shuffle(starts)
    out = []
    for _ in range(num_req):
        ids: list[int] = []
        while len(ids) < num_blocks:
            s = starts.pop()
            ids += list(range(s, s + step))[: num_blocks - len(ids)]
        out.append(tuple(ids))
    return out


def bind(fn: Kernel, host: Tensor, q: Tensor, blocks: list[tuple[int, ...]],
         scale: float) -> Callable[[int], object]:
    """``fn`` on everything but the layer."""
    return lambda layer: fn(host, layer, q, blocks, BLOCK, scale)


def measure(fns: list[Callable[[int], object]], rounds: int, num_layers: int) -> list[float]:
    """Median seconds per call of each fn, interleaved, every call on a fresh layer."""
    times: list[list[float]] = [[] for _ in fns]
    layer = 0
    for i in range(rounds + 1):
        for j, fn in enumerate(fns):
            layer = (layer + 1) % num_layers
            t0 = time.perf_counter()
            fn(layer)
            if i:  # the first round warms up
                times[j].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="a few rows only")
    args = ap.parse_args()
    default_threads = torch.get_num_threads()
    thread_counts = sorted({1, default_threads})
    # (kv, D, group, decode Ps, prefill Ps, cases (requests, blocks, layout))
    shapes = [
        (2, 64, 3, [1, 2, 3, 4, 5, 9, 17], [256, 1024],
         [(1, 8, "contig"), (2, 20, "runs4"), (4, 40, "contig"), (4, 40, "runs4"),
          (4, 40, "scatter")]),
        (8, 128, 4, [1, 5, 17], [256],
         [(1, 8, "contig"), (2, 20, "runs4"), (4, 40, "contig"), (4, 40, "scatter")]),
    ]
    if args.quick:
        shapes = [(kv, d, g, dec[:1], pre[:1], cases[:2]) for kv, d, g, dec, pre, cases in shapes]
    print(f"host attention kernel, one layer, block {BLOCK}, fp32 KV, host tier "
          f"{HOST_BYTES >> 20} MB (a fresh layer per call), torch {torch.__version__}, "
          f"median of {args.rounds} interleaved rounds; rate = GB/s of KV attended")
    speedups: dict[tuple[str, int], list[float]] = {}
    for kv, d, g, decode_ps, prefill_ps, cases in shapes:
        block_bytes = BLOCK * kv * d * 4
        num_blocks = 2 * 4 * 40 + 16  # room for 4 x 40 scattered blocks
        num_layers = max(2, HOST_BYTES // (2 * num_blocks * block_bytes))
        host = torch.randn(num_layers, 2, num_blocks, BLOCK, kv, d)
        print(f"\nkv {kv}, head_dim {d}, {kv * g} query heads (group {g}), "
              f"{num_layers} layers x {num_blocks} blocks")
        head = "     P  case             " + "".join(
            f"| {t}t old GB/s  new GB/s  speedup " for t in thread_counts)
        print(head)
        rng = random.Random(0)
        for p in decode_ps + prefill_ps:
            for num_req, nb, kind in cases:
                if p >= 256 and num_req * nb > 40:  # prefill: keep the run short
                    continue
                blocks = layout(kind, num_req, nb, num_blocks, rng)
                q = torch.randn(num_req, p, kv * g, d)
                scale = d**-0.5
                a = old_run(host, 0, q, blocks, BLOCK, scale)
                b = host_partial(host, 0, q, blocks, BLOCK, scale)
                torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
                nbytes = 2 * num_req * nb * block_bytes
                cells = []
                for t in thread_counts:
                    torch.set_num_threads(t)
                    old_s, new_s = measure(
                        [bind(old_run, host, q, blocks, scale),
                         bind(host_partial, host, q, blocks, scale)],
                        args.rounds if p < 256 else max(3, args.rounds // 3), num_layers)
                    speedups.setdefault(("decode" if p < 256 else "prefill", t), []).append(
                        old_s / new_s)
                    cells.append(f"| {nbytes / old_s / 1e9:11.2f} {nbytes / new_s / 1e9:9.2f}"
                                 f" {old_s / new_s:7.2f}x ")
                torch.set_num_threads(default_threads)
                case = f"{num_req}x{nb} {kind}"
                print(f"{p:6d}  {case:15s}  " + "".join(cells), flush=True)
        del host
    print("\ngeometric mean speedup (new over old):")
    for (kind, t), xs in sorted(speedups.items()):
        gm = math.exp(sum(math.log(x) for x in xs) / len(xs))
        print(f"  {kind:8s} {t} thread(s): {gm:.2f}x over {len(xs)} rows "
              f"(min {min(xs):.2f}x, max {max(xs):.2f}x)")
    variants(args.rounds, args.quick)


def fresh_scratch(host: Tensor, layer: int, q: Tensor, blocks: list[tuple[int, ...]],
                  block_size: int, scale: float) -> tuple[Tensor, Tensor]:
    """``host_partial`` allocating its gather buffer anew on every call."""
    host_kernel._scratch = threading.local()
    return host_partial(host, layer, q, blocks, block_size, scale)


def with_gather_max(max_bytes: int) -> Kernel:
    """``host_partial`` with another limit on the requests it gathers whole."""
    def kernel(host: Tensor, layer: int, q: Tensor, blocks: list[tuple[int, ...]],
               block_size: int, scale: float) -> tuple[Tensor, Tensor]:
        kept = host_kernel.GATHER_MAX_BYTES
        host_kernel.GATHER_MAX_BYTES = max_bytes
        try:
            return host_partial(host, layer, q, blocks, block_size, scale)
        finally:
            host_kernel.GATHER_MAX_BYTES = kept
    return kernel


def variants(rounds: int, quick: bool) -> None:
    """The choices inside ``host_partial`` against their alternatives, one thread."""
    torch.set_num_threads(1)
    names = ["chosen", "fresh-scratch", "all-views", "all-gather"]
    kernels = [host_partial, fresh_scratch, with_gather_max(0), with_gather_max(1 << 62)]
    print("\nvariants of host_partial, 1 thread, GB/s of KV attended: fresh-scratch = a new "
          "gather buffer per call,\nall-views = every run attended in place and merged, "
          "all-gather = every request copied to the scratch first")
    print("shape         P  case            " + "".join(f"{n:>14s}" for n in names))
    for kv, d, g in [(2, 64, 3), (8, 128, 4)]:
        block_bytes = BLOCK * kv * d * 4
        num_blocks = 2 * 4 * 40 + 16
        num_layers = max(2, HOST_BYTES // (2 * num_blocks * block_bytes))
        host = torch.randn(num_layers, 2, num_blocks, BLOCK, kv, d)
        rng = random.Random(1)
        for p in [1] if quick else [1, 5, 17]:
            for num_req, nb, kind in [(1, 8, "contig"), (4, 40, "contig"), (4, 40, "runs4"),
                                      (4, 40, "scatter")]:
                blocks = layout(kind, num_req, nb, num_blocks, rng)
                q = torch.randn(num_req, p, kv * g, d)
                times = measure([bind(k, host, q, blocks, d**-0.5) for k in kernels], rounds,
                                num_layers)
                nbytes = 2 * num_req * nb * block_bytes
                case = f"{num_req}x{nb} {kind}"
                print(f"kv {kv} D {d:3d} {p:3d}  {case:15s} "
                      + "".join(f"{nbytes / t / 1e9:14.2f}" for t in times), flush=True)
        del host


if __name__ == "__main__":
    main()
