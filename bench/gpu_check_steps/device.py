"""`env` and `bandwidth`: what the machine is, and how fast its host-device link copies (large
pinned copies timed with CUDA events on the GPU, the wall clock on the CPU)."""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from specstream.attention import triton_wave as tw
from specstream.attention.waves import resolve_backend
from specstream.backends import make_backend

MiB = 1 << 20


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_env(args: argparse.Namespace) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "triton": getattr(tw.triton, "__version__", None), "device": args.device,
        "attention_backend_auto": resolve_backend("auto", args.device),
    }  # fmt: skip
    if args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count)
    return info


def _seconds(fn: Callable[[], object], device: str) -> float:
    """How long ``fn``'s device work takes: between two CUDA events on the current stream
    (launch overhead and the host's view of completion not counted), wall clock on the CPU."""
    if not device.startswith("cuda"):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _timed_copies(dst: torch.Tensor, src: torch.Tensor, reps: int, device: str) -> list[float]:
    """GB/s of `reps` whole-tensor copies, each timed alone."""
    nbytes = src.numel() * src.element_size()
    rates = []
    for _ in range(reps + 1):  # the first is a warm-up
        sync(device)
        rates.append(nbytes / _seconds(lambda: dst.copy_(src, non_blocking=True), device) / 1e9)
    return rates[1:]


def _back_to_back(dst: torch.Tensor, src: torch.Tensor, reps: int, device: str) -> float:
    """GB/s of `reps` copies queued back to back (the link's sustained rate)."""
    def copies() -> None:
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)

    sync(device)
    return reps * src.numel() * src.element_size() / _seconds(copies, device) / 1e9


def step_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    nbytes = (16 if args.tiny else 256) * MiB
    backend = make_backend(args.device)
    host = backend.alloc_host((nbytes,), torch.uint8)  # pinned on CUDA
    host.random_(0, 255)
    dev = backend.alloc_device((nbytes,), torch.uint8)
    cuda = args.device.startswith("cuda")
    res: dict[str, Any] = {"copy_mib": nbytes // MiB, "pinned": cuda,
                           "timer": "cuda events" if cuda else "wall clock"}
    h2d = _timed_copies(dev, host, args.reps, args.device)
    d2h = _timed_copies(host, dev, args.reps, args.device)
    res["h2d_gbps"] = {"median": statistics.median(h2d), "max": max(h2d), "all": h2d}
    res["d2h_gbps"] = {"median": statistics.median(d2h), "max": max(d2h)}
    res["h2d_gbps_back_to_back"] = _back_to_back(dev, host, args.reps, args.device)
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

