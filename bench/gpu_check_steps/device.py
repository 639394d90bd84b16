"""`env` and `bandwidth`: what the machine is, and how fast its host-device link copies."""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import torch

from specstream.attention import triton_partial as tp
from specstream.backends import make_backend

MiB = 1 << 20


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_env(args: argparse.Namespace) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "triton": getattr(tp.triton, "__version__", None), "device": args.device,
    }  # fmt: skip
    if args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count)
    return info


def _timed_copies(dst: torch.Tensor, src: torch.Tensor, reps: int, device: str) -> list[float]:
    """GB/s of `reps` whole-tensor copies, each timed alone."""
    rates = []
    for _ in range(reps + 1):  # the first is a warm-up
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        rates.append(src.numel() * src.element_size() / (time.perf_counter() - t0) / 1e9)
    return rates[1:]


def step_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    nbytes = (16 if args.tiny else 256) * MiB
    backend = make_backend(args.device)
    host = backend.alloc_host((nbytes,), torch.uint8)  # pinned on CUDA
    host.random_(0, 255)
    dev = backend.alloc_device((nbytes,), torch.uint8)
    res: dict[str, Any] = {"copy_mib": nbytes // MiB, "pinned": args.device.startswith("cuda")}
    h2d = _timed_copies(dev, host, args.reps, args.device)
    d2h = _timed_copies(host, dev, args.reps, args.device)
    res["h2d_gbps"] = {"median": statistics.median(h2d), "max": max(h2d), "all": h2d}
    res["d2h_gbps"] = {"median": statistics.median(d2h), "max": max(d2h)}
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    res["h2d_pageable_gbps"] = statistics.median(_timed_copies(dev, pageable, 2, args.device))
    sweep = {}  # the engine's pattern: one h2d_many per staging chunk of K/V block copies
    chunk = min(nbytes, 16 * MiB)
    for size_kib in (64, 256, 1024, 4096):
        n, per_chunk = nbytes // (size_kib * 1024), chunk // (size_kib * 1024)
        src, dst = host.view(n, -1), dev.view(n, -1)
        backend.reset_stats()
        sync(args.device)
        t0 = time.perf_counter()
        handles = [backend.h2d_many([(dst[i], src[i]) for i in range(c, c + per_chunk)], c)
                   for c in range(0, n, per_chunk)]
        t_issue = time.perf_counter() - t0
        for h in handles:
            h.wait()
        sync(args.device)
        wall = time.perf_counter() - t0
        stats = backend.stats()
        sweep[f"{size_kib}KiB"] = {
            "copies": n, "wall_gbps": nbytes / wall / 1e9, "issue_us_per_copy": t_issue / n * 1e6,
            "busy_gbps": stats["bytes_h2d"] / stats["busy_s"] / 1e9 if stats["busy_s"] else None,
        }  # fmt: skip
    res["backend_h2d_sweep"] = sweep
    backend.close()
    return res

