"""Chunk-wave attention (Triton): every query position of many requests over each one's own keys.

A wave is one step of streaming cold history: each of `W` requests contributes its query positions
(padded to `P`) and one chunk of its own keys (padded to `N`, the first `key_len[w]` are real). One
call returns, per request, the same `(out, lse)` pair as `streamed.partial_attention`: `out`
normalised within the wave and `lse = log sum_j exp(scale * q.k_j)` over the visible keys, both
fp32, so waves merge exactly (`merge_partials`, `AttentionAccumulator`). Rows that see no key
(`key_len` 0, or masked out) get `out = 0` and `lse = -inf`, never NaN.

Masks: keys `j < key_len[w]`, and optionally the causal pattern of the resident tail,
`causal_offset[w] = c`: query `i` of request `w` sees keys `j <= c + i`.

One program per (request, kv head) and block of `BLOCK_M` folded rows (GQA: query head
`h = kv * group + g`, rows `(g, i)`), looping over that request's keys in `BLOCK_N` tiles with
online softmax (running max, running normaliser, fp32 accumulator), so K/V are read once per row
block. `key_len` and `causal_offset` are read by the kernel from device tensors, so launching
never syncs with the host; the loop stops at the request's last visible key, so short requests
cost only their own tiles. `triton_partial.partial_attention_triton` is this kernel with one
request.

Precision: fp32 inputs use IEEE fp32 dots (no TF32), so the kernel matches the torch path to
~1e-6; 16-bit inputs take q.k on tensor cores with fp32 accumulation and cast the probabilities
to the input dtype for p.v, as FlashAttention does. Under Triton's interpreter 16-bit inputs
also take fp32 dots (its 16-bit `tl.dot` is broken).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import Tensor

from specstream.attention.reference import gqa_group
from specstream.attention.streamed import finite_or_zero

try:
    import triton
    import triton.language as tl
except ImportError:  # the project never requires Triton
    triton = None
    tl = None


def triton_available() -> bool:
    """True when Triton is importable (the kernels still need CUDA or TRITON_INTERPRET=1)."""
    return triton is not None

NEG_INF = float("-inf")

__all__ = ["triton_available", "wave_attention_torch", "wave_attention_triton"]


def _check_wave(
    q: Tensor, k: Tensor, v: Tensor, key_len: Tensor, causal_offset: Tensor | None
) -> int:
    """Validate shapes, dtypes and devices; return the GQA group."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need 4-d")
    num_w, _, num_heads, head_dim = q.shape
    if k.shape[0] != num_w or k.shape[3] != head_dim or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
            f"v {tuple(v.shape)} {v.dtype} do not fit together"
        )
    for name, t in (("key_len", key_len), ("causal_offset", causal_offset)):
        if t is None:
            continue
        if t.shape != (num_w,) or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an int tensor of shape ({num_w},), got {t.shape}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    return gqa_group(num_heads, k.shape[2])


def visible_keys(
    num_q: int,
    num_k: int,
    key_len: Tensor,  # [W]
    causal_offset: Tensor | None,  # [W]
) -> Tensor:  # [W, num_q, num_k] bool
    """Which keys each query position of each request may attend."""
    cols = torch.arange(num_k, device=key_len.device)
    vis = (cols[None, :] < key_len[:, None]).unsqueeze(1)  # [W, 1, N]
    if causal_offset is not None:
        rows = torch.arange(num_q, device=key_len.device)
        last = causal_offset[:, None] + rows[None, :]  # [W, P] last key each query sees
        vis = vis & (cols[None, None, :] <= last[:, :, None])
    return vis.expand(key_len.shape[0], num_q, num_k)


def wave_attention_torch(
    q: Tensor,  # [W, P, num_heads, head_dim] query positions of W requests, padded to P
    k: Tensor,  # [W, N, num_kv_heads, head_dim] each request's keys, padded to N
    v: Tensor,  # [W, N, num_kv_heads, head_dim]
    scale: float,
    key_len: Tensor,  # [W] int: request w's valid keys are 0 .. key_len[w]-1
    causal_offset: Tensor | None = None,  # [W] int: query i sees keys j <= causal_offset[w] + i
) -> tuple[Tensor, Tensor]:  # out [W, P, num_heads, head_dim] fp32, lse [W, P, num_heads] fp32
    """The plain reference: scores, masks and softmax in fp32, K/V repeated per query head."""
    group = _check_wave(q, k, v, key_len, causal_offset)
    num_k = k.shape[1]
    kf = k.float().repeat_interleave(group, dim=2)  # [W, N, num_heads, D]
    vf = v.float().repeat_interleave(group, dim=2)  # [W, N, num_heads, D]
    scores = torch.einsum("wphd,wnhd->whpn", q.float(), kf) * scale  # [W, H, P, N]
    vis = visible_keys(q.shape[1], num_k, key_len, causal_offset)  # [W, P, N]
    scores = scores.masked_fill(~vis.unsqueeze(1), NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [W, H, P]; -inf where no key is visible
    finite = finite_or_zero(lse)
    probs = torch.exp(scores - finite.unsqueeze(-1))  # masked keys and empty rows: 0
    out = torch.einsum("whpn,wnhd->wphd", probs, vf)  # [W, P, H, D]
    return out, lse.permute(0, 2, 1).contiguous()


def _wave_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, key_len_ptr, offset_ptr,
    num_q, num_k, num_kv_heads, group, scale,
    sq_w, sq_m, sq_h, sq_d, sk_w, sk_n, sk_h, sk_d, sv_w, sv_n, sv_h, sv_d,
    so_w, so_m, so_h, so_d, sl_w, sl_m, sl_h, s_len, s_off,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    w = (pid // num_kv_heads).to(tl.int64)  # request; int64 so w * stride cannot overflow
    kv = pid % num_kv_heads
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # folded rows (g, i)
    row_ok = rows < group * num_q
    qi = rows % num_q  # query position
    head = kv * group + rows // num_q  # query head
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_ptrs = q_ptr + w * sq_w + qi[:, None] * sq_m + head[:, None] * sq_h + d[None, :] * sq_d
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    k_base = k_ptr + w * sk_w + kv * sk_h
    v_base = v_ptr + w * sv_w + kv * sv_h

    n_valid = tl.minimum(tl.load(key_len_ptr + w * s_len).to(tl.int32), num_k)
    hi = n_valid  # keys past hi are invisible to every row of this program
    offset = 0
    if CAUSAL:
        offset = tl.load(offset_ptr + w * s_off).to(tl.int32)
        hi = tl.minimum(hi, tl.maximum(offset + num_q, 0))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scaled scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running sum of exp(s - m_i) v
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < n_valid
        kt_ptrs = k_base + cols[None, :] * sk_n + d[:, None] * sk_d
        kt = tl.load(kt_ptrs, mask=d_ok[:, None] & col_ok[None, :], other=0.0)  # [D, BLOCK_N]
        if FP32_DOT:
            s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        visible = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offset + qi[:, None])
        s = tl.where(visible, s * scale, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked so far: exp(-inf) = 0
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_base + cols[:, None] * sv_n + d[None, :] * sv_d
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
    o_ptrs = out_ptr + w * so_w + qi[:, None] * so_m + head[:, None] * so_h + d[None, :] * so_d
    tl.store(o_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + w * sl_w + qi * sl_m + head * sl_h, lse, mask=row_ok)


@functools.cache
def _jitted(interpret: bool) -> Any:
    """The jitted kernel, built on first use (Triton reads TRITON_INTERPRET when jitting)."""
    assert triton is not None
    return triton.jit(_wave_attention_kernel)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def wave_attention_triton(
    q: Tensor,  # [W, P, num_heads, head_dim] query positions of W requests, padded to P
    k: Tensor,  # [W, N, num_kv_heads, head_dim] each request's keys, padded to N
    v: Tensor,  # [W, N, num_kv_heads, head_dim]
    scale: float,
    key_len: Tensor,  # [W] int: request w's valid keys are 0 .. key_len[w]-1
    causal_offset: Tensor | None = None,  # [W] int: query i sees keys j <= causal_offset[w] + i
) -> tuple[Tensor, Tensor]:  # out [W, P, num_heads, head_dim] fp32, lse [W, P, num_heads] fp32
    """`wave_attention_torch` as one Triton launch; needs CUDA tensors or TRITON_INTERPRET=1.

    `key_len` and `causal_offset` stay on the device (no host sync); key lengths past `N` count
    as `N`. Inputs may be strided views: every stride, the head dim's included, is passed.
    """
    if triton is None:
        raise RuntimeError("wave_attention_triton needs Triton (pip install triton)")
    group = _check_wave(q, k, v, key_len, causal_offset)
    num_w, num_q, num_heads, head_dim = q.shape
    num_k, num_kv_heads = k.shape[1], k.shape[2]
    out = torch.zeros(num_w, num_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((num_w, num_q, num_heads), NEG_INF, dtype=torch.float32, device=q.device)
    if num_w == 0 or num_q == 0 or num_k == 0:
        return out, lse
    rows = group * num_q
    block_m = _pow2(rows, 16, 64)
    block_d = _pow2(head_dim, 16, 256)
    block_n = 64 if block_d <= 128 else 32
    grid = (num_w * num_kv_heads, triton.cdiv(rows, block_m))
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    # Triton's interpreter multiplies 16-bit dots as raw bits, so it gets the fp32 dots
    fp32_dot = q.dtype == torch.float32 or interpret
    offsets = key_len if causal_offset is None else causal_offset  # unread when not CAUSAL
    _jitted(interpret)[grid](
        q, k, v, out, lse, key_len, offsets,
        num_q, num_k, num_kv_heads, group, scale,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        key_len.stride(0), offsets.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal_offset is not None, FP32_DOT=fp32_dot,
    )  # fmt: skip
    return out, lse
