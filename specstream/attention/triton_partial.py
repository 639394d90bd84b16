"""Fused partial attention (Triton): output and log-sum-exp of many queries over one KV chunk.

Same contract as `streamed.partial_attention` (see its docstring): `out` is normalised within the
chunk and `lse = log sum_j exp(scale * q.k_j)` over the visible keys, both fp32, so the results
merge exactly through `AttentionAccumulator`. It is the chunk-wave kernel (`triton_wave.py`) with
one request: GQA folded into rows, keys in tiles with online softmax, K/V read once per row
block, the same precision policy.

Masks: none, or the causal pattern of the resident tail, `causal_offset = c`: query `i` sees keys
`0 .. c + i` (with `c = num_k - num_q` the last `num_q` keys are the queries themselves, as
`reference.causal_mask`). Any other mask goes through the torch path.

The engine attends chunk waves (`waves.TritonWaves`); this one-request form is what the GPU
check (`bench/gpu_check_steps/exactness.py`) and the tests compare against the torch path.
Triton is optional: this module imports without it, `triton_available()` says whether the kernel
can run. On a machine without a GPU the kernel runs in Triton's interpreter
(`TRITON_INTERPRET=1`, small sizes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from specstream.attention.triton_wave import triton_available, wave_attention_triton
from specstream.backends.base import upload


def partial_attention_triton(
    q: Tensor,  # [num_q, num_heads, head_dim]
    k: Tensor,  # [num_k, num_kv_heads, head_dim]
    v: Tensor,  # [num_k, num_kv_heads, head_dim]
    scale: float,
    causal_offset: int | None = None,  # query i sees keys 0 .. causal_offset + i
) -> tuple[Tensor, Tensor]:  # out [num_q, num_heads, head_dim] fp32, lse [num_q, num_heads] fp32
    """`partial_attention` as one fused Triton kernel (the wave kernel with one request); needs
    CUDA tensors or TRITON_INTERPRET=1."""
    if not triton_available():
        raise RuntimeError("partial_attention_triton needs Triton (pip install triton)")
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}: need 3-d")
    key_len, offset = upload(
        [[k.shape[0]], None if causal_offset is None else [causal_offset]], torch.int64, q.device)
    assert key_len is not None
    out, lse = wave_attention_triton(q[None], k[None], v[None], scale, key_len, offset)
    return out[0], lse[0]


def offset_causal_mask(num_q: int, num_k: int, causal_offset: int, device: Any = None) -> Tensor:
    """Bool `[num_q, num_k]`: query `i` sees keys `0 .. causal_offset + i` (the kernel's mask)."""
    q_pos = torch.arange(num_q, device=device).unsqueeze(1) + causal_offset  # [num_q, 1]
    return torch.arange(num_k, device=device).unsqueeze(0) <= q_pos
