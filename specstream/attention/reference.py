"""Plain full attention: the reference every streamed or fused path is tested against.

Layout is token-major without a batch dimension (one request at a time), as in the KV cache:
q `[num_q, num_heads, head_dim]`, k/v `[num_k, num_kv_heads, head_dim]`. Grouped-query attention
(GQA): `num_heads = group * num_kv_heads` and query head `h` reads kv head `h // group`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(num_q: int, num_k: int, device: torch.device | str | None = None) -> Tensor:
    """Boolean mask `[num_q, num_k]`, True where a query may attend.

    The last `num_q` keys are the queries themselves, so query `i` sees keys
    `0 .. num_k - num_q + i` (the whole history plus the new tokens up to and including itself).
    """
    if num_k < num_q:
        raise ValueError(f"num_k ({num_k}) must be >= num_q ({num_q})")
    q_pos = torch.arange(num_q, device=device).unsqueeze(1) + (num_k - num_q)  # [num_q, 1]
    k_pos = torch.arange(num_k, device=device).unsqueeze(0)  # [1, num_k]
    return k_pos <= q_pos


def gqa_group(num_heads: int, num_kv_heads: int) -> int:
    """Number of query heads that share one kv head; raises if they do not divide."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) not a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads


def full_attention(
    q: Tensor,  # [num_q, num_heads, head_dim]
    k: Tensor,  # [num_k, num_kv_heads, head_dim]
    v: Tensor,  # [num_k, num_kv_heads, head_dim]
    scale: float,
    mask: Tensor | None = None,  # [num_q, num_k] bool, True = may attend
) -> Tensor:  # [num_q, num_heads, head_dim], dtype of q
    """softmax(scale * q k^T) v over all keys at once, softmax in fp32.

    K/V are repeated per query head the straightforward way; this is the readable reference,
    not the fast path. Rows with every key masked out return zeros.
    """
    num_q, num_heads, head_dim = q.shape
    group = gqa_group(num_heads, k.shape[1])
    kf = k.float().repeat_interleave(group, dim=1)  # [num_k, num_heads, head_dim]
    vf = v.float().repeat_interleave(group, dim=1)  # [num_k, num_heads, head_dim]
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale  # [num_heads, num_q, num_k]
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows: NaN -> 0
    out = torch.einsum("hqk,khd->qhd", probs, vf)  # [num_q, num_heads, head_dim]
    return out.to(q.dtype)
