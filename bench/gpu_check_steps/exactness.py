"""`exactness`: streamed attention (torch path and Triton kernel) vs full attention."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from specstream.attention import (
    AttentionAccumulator,
    causal_mask,
    full_attention,
    partial_attention,
)
from specstream.attention import triton_partial as tp

from .device import sync

TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def _attention_case(
    num_q: int, heads: int, kv: int, dim: int, hist: int, chunk: int, tail: int,
    dtype: torch.dtype, device: str,
) -> dict[str, float]:  # fmt: skip
    """Relative errors of the streamed torch path and the Triton kernel vs full attention."""
    gen = torch.Generator().manual_seed(hist + num_q)
    num_k = hist + tail + num_q
    q = torch.randn(num_q, heads, dim, generator=gen).to(device, dtype)  # [num_q, H, D]
    k = torch.randn(num_k, kv, dim, generator=gen).to(device, dtype)  # [num_k, KV, D]
    v = torch.randn(num_k, kv, dim, generator=gen).to(device, dtype)
    scale = dim**-0.5
    ref = full_attention(q, k, v, scale, causal_mask(num_q, num_k, device)).float()
    errs: dict[str, float] = {}
    fns = {"torch": partial_attention}
    if tp.triton_available() and (device.startswith("cuda") or _interpreting()):
        fns["triton"] = tp.partial_attention_triton
    for name, fn in fns.items():
        acc = AttentionAccumulator()
        for s in range(0, hist, chunk):
            e = min(s + chunk, hist)
            acc.add(*fn(q, k[s:e], v[s:e], scale))
        kt, vt = k[hist:], v[hist:]
        if name == "torch":
            acc.add(*fn(q, kt, vt, scale, causal_mask(num_q, tail + num_q, device)))
        else:
            acc.add(*fn(q, kt, vt, scale, tail))
        out = acc.result(dtype).float()
        errs[name] = ((out - ref).abs().max() / ref.abs().max()).item()
    return errs


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def step_exactness(args: argparse.Namespace) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False  # exactness is judged in true fp32
    torch.backends.cudnn.allow_tf32 = False
    if args.tiny:  # (num_q, heads, kv, dim, hist, chunk, tail)
        cases = [(5, 4, 2, 16, 100, 32, 20), (3, 2, 2, 32, 64, 64, 0)]
    else:
        cases = [(5, 32, 8, 128, 16384, 2048, 512), (9, 32, 8, 128, 8192, 2048, 0),
                 (256, 16, 8, 128, 4096, 2048, 300), (1, 28, 4, 128, 6000, 2048, 100)]
    res: dict[str, Any] = {"cases": [], "passed": True}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for case in cases:
            errs = _attention_case(*case, dtype=dtype, device=args.device)
            ok = all(e <= TOL[name] for e in errs.values())
            res["passed"] &= ok
            res["cases"].append({"dtype": name, "shape": case, "rel_err": errs, "ok": ok})
    res["triton_checked"] = any("triton" in c["rel_err"] for c in res["cases"])
    if res["triton_checked"] and args.device.startswith("cuda"):
        res["kernel_us"] = _time_kernels(args.device)
    return res


def _time_kernels(device: str) -> dict[str, float]:
    """Microseconds per call over one 2048-token chunk at decode shape (q+1 = 5, Qwen3-8B)."""
    q = torch.randn(5, 32, 128, device=device, dtype=torch.bfloat16)
    k = torch.randn(2048, 8, 128, device=device, dtype=torch.bfloat16)
    out = {}
    for name, fn in (("torch", partial_attention), ("triton", tp.partial_attention_triton)):
        for _ in range(3):
            fn(q, k, k, 0.088)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(50):
            fn(q, k, k, 0.088)
        sync(device)
        out[name] = (time.perf_counter() - t0) / 50 * 1e6
    return out

