"""Fused partial attention (Triton): output and log-sum-exp of many queries over one KV chunk.

Same contract as `streamed.partial_attention` (see its docstring): `out` is normalised within the
chunk and `lse = log sum_j exp(scale * q.k_j)` over the visible keys, both fp32, so the results
merge exactly through `AttentionAccumulator`. One program handles one kv head and a block of
`BLOCK_M` folded query rows (GQA: the `group` query heads of a kv head times `num_q` positions,
as in the torch path), and loops over the chunk's keys in `BLOCK_N` tiles with online softmax
(running max `m`, running normaliser `l`, fp32 accumulator), so K/V are read once per row block.

Masks: none, or the causal pattern of the resident tail, `causal_offset = c`: query `i` sees keys
`0 .. c + i` (with `c = num_k - num_q` the last `num_q` keys are the queries themselves, as
`reference.causal_mask`). Any other mask goes through the torch path.

Precision: fp32 inputs use IEEE fp32 dots (no TF32), so the kernel matches the torch path to
~1e-6; 16-bit inputs take q.k on tensor cores with fp32 accumulation and cast the probabilities
to the input dtype for p.v, as FlashAttention does (error well inside the 1e-2 bf16 budget).
Under Triton's interpreter 16-bit inputs also take fp32 dots (its 16-bit `tl.dot` is broken).

Triton is optional: this module imports without it, `triton_available()` says whether the kernel
can run, and `partial_attention_auto` uses it only for CUDA tensors, else the torch path. On a
machine without a GPU the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, small sizes).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import Tensor

from specstream.attention.reference import gqa_group
from specstream.attention.streamed import partial_attention

try:
    import triton
    import triton.language as tl
except ImportError:  # the project never requires Triton
    triton = None
    tl = None

NEG_INF = float("-inf")


def triton_available() -> bool:
    """True when Triton is importable (the kernel still needs CUDA or TRITON_INTERPRET=1)."""
    return triton is not None


def _partial_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
    num_q, num_k, group, causal_offset, scale,
    sq_m, sq_h, sq_d, sk_n, sk_h, sk_d, sv_n, sv_h, sv_d, so_m, so_h, so_d, sl_m, sl_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    kv = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # folded rows (g, i)
    row_ok = rows < group * num_q
    qi = rows % num_q  # query position
    head = kv * group + rows // num_q  # query head
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_ptrs = q_ptr + qi[:, None] * sq_m + head[:, None] * sq_h + d[None, :] * sq_d
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scaled scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running sum of exp(s - m_i) v
    for start in range(0, num_k, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < num_k
        kt_ptrs = k_ptr + cols[None, :] * sk_n + kv * sk_h + d[:, None] * sk_d
        kt = tl.load(kt_ptrs, mask=d_ok[:, None] & col_ok[None, :], other=0.0)  # [D, BLOCK_N]
        if FP32_DOT:
            s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        visible = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= causal_offset + qi[:, None])
        s = tl.where(visible, s * scale, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked so far: exp(-inf) = 0
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_ptr + cols[:, None] * sv_n + kv * sv_h + d[None, :] * sv_d
        v = tl.load(v_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D]
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]  # rows that saw no key keep acc = 0
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    o_ptrs = out_ptr + qi[:, None] * so_m + head[:, None] * so_h + d[None, :] * so_d
    tl.store(o_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + qi * sl_m + head * sl_h, lse, mask=row_ok)


@functools.cache
def _jitted(interpret: bool) -> Any:
    """The jitted kernel, built on first use (Triton reads TRITON_INTERPRET when jitting)."""
    assert triton is not None
    return triton.jit(_partial_attention_kernel)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def partial_attention_triton(
    q: Tensor,  # [num_q, num_heads, head_dim]
    k: Tensor,  # [num_k, num_kv_heads, head_dim]
    v: Tensor,  # [num_k, num_kv_heads, head_dim]
    scale: float,
    causal_offset: int | None = None,  # query i sees keys 0 .. causal_offset + i
) -> tuple[Tensor, Tensor]:  # out [num_q, num_heads, head_dim] fp32, lse [num_q, num_heads] fp32
    """`partial_attention` as one fused Triton kernel; needs CUDA tensors or TRITON_INTERPRET=1."""
    if triton is None:
        raise RuntimeError("partial_attention_triton needs Triton (pip install triton)")
    num_q, num_heads, head_dim = q.shape
    num_k, num_kv_heads = k.shape[0], k.shape[1]
    group = gqa_group(num_heads, num_kv_heads)
    if k.shape != v.shape or k.shape[2] != head_dim or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
            f"v {tuple(v.shape)} {v.dtype} do not fit together"
        )
    out = torch.zeros(num_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((num_q, num_heads), NEG_INF, dtype=torch.float32, device=q.device)
    if num_k == 0 or num_q == 0:
        return out, lse
    rows = group * num_q
    block_m = _pow2(rows, 16, 64)
    block_d = _pow2(head_dim, 16, 256)
    block_n = 64 if block_d <= 128 else 32
    grid = (num_kv_heads, triton.cdiv(rows, block_m))
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    # Triton's interpreter multiplies 16-bit dots as raw bits, so it gets the fp32 dots
    fp32_dot = q.dtype == torch.float32 or interpret
    _jitted(interpret)[grid](
        q, k, v, out, lse,
        num_q, num_k, group, 0 if causal_offset is None else causal_offset, scale,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal_offset is not None, FP32_DOT=fp32_dot,
    )  # fmt: skip
    return out, lse


def offset_causal_mask(num_q: int, num_k: int, causal_offset: int, device: Any = None) -> Tensor:
    """Bool `[num_q, num_k]`: query `i` sees keys `0 .. causal_offset + i` (the kernel's mask)."""
    q_pos = torch.arange(num_q, device=device).unsqueeze(1) + causal_offset  # [num_q, 1]
    return torch.arange(num_k, device=device).unsqueeze(0) <= q_pos


def partial_attention_auto(
    q: Tensor,  # [num_q, num_heads, head_dim]
    k: Tensor,  # [num_k, num_kv_heads, head_dim]
    v: Tensor,  # [num_k, num_kv_heads, head_dim]
    scale: float,
    mask: Tensor | None = None,  # [num_q, num_k] bool, True = may attend
    causal_offset: int | None = None,
) -> tuple[Tensor, Tensor]:  # out [num_q, num_heads, head_dim] fp32, lse [num_q, num_heads] fp32
    """The Triton kernel for CUDA tensors when Triton is importable, else the torch path.

    An explicit `mask` always takes the torch path; `causal_offset` is the fused causal mask.
    """
    if mask is not None and causal_offset is not None:
        raise ValueError("give either mask or causal_offset, not both")
    if mask is None and q.is_cuda and triton is not None:
        return partial_attention_triton(q, k, v, scale, causal_offset)
    if causal_offset is not None:
        mask = offset_causal_mask(q.shape[0], k.shape[0], causal_offset, q.device)
    return partial_attention(q, k, v, scale, mask)
