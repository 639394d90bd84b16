"""Exact attention over KV chunks that arrive one at a time (online softmax).

For one query row with scaled scores `s_j` over keys split into chunks `C_1 .. C_n`, each chunk
yields a partial result normalised within the chunk plus its log-sum-exp:

    lse_c = log sum_{j in c} exp(s_j)        out_c = sum_{j in c} exp(s_j - lse_c) v_j

Full attention is the lse-weighted average of the partials: with `lse = log sum_c exp(lse_c)`,
`out = sum_c exp(lse_c - lse) out_c`. Subtracting the running maximum before exponentiating
keeps every step in range, so chunks can be merged in any order as they land and the result
equals softmax over all keys up to rounding (online softmax, Milakov & Gimelshein 2018; the same
rescaling FlashAttention, Dao et al. 2022, applies per tile). Everything is computed in fp32.

Fully masked rows (or empty chunks) have `lse = -inf` and `out = 0`; they carry zero weight in
every merge and never produce NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specstream.attention.reference import gqa_group

NEG_INF = float("-inf")
# torch >= 2.3 on CPU: flash attention that also returns the log-sum-exp (one op per wave or
# host job); the overload itself, not the packet, so a call skips the overload resolution
CPU_FLASH = getattr(getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu",
                            None), "default", None)


def finite_or_zero(m: Tensor) -> Tensor:
    """Replace -inf maxima by 0 so that `exp(x - m)` gives 0, not NaN, for all -inf rows."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def partial_attention(
    q: Tensor,  # [num_q, num_heads, head_dim]
    k: Tensor,  # [num_k, num_kv_heads, head_dim]
    v: Tensor,  # [num_k, num_kv_heads, head_dim]
    scale: float,
    mask: Tensor | None = None,  # [num_q, num_k] bool, True = may attend
) -> tuple[Tensor, Tensor]:  # out [num_q, num_heads, head_dim] fp32, lse [num_q, num_heads] fp32
    """Attention of all queries over one chunk of keys, normalised within the chunk.

    Returns `(out, lse)`: `out` in fp32 and `lse = log sum_j exp(scale * q.k_j)` over the
    unmasked keys of the chunk. GQA is done by folding the query heads of a group into the
    row dimension (`[num_kv_heads, group * num_q, head_dim]`), so K/V are never repeated.
    """
    num_q, num_heads, head_dim = q.shape
    num_k, num_kv_heads = k.shape[0], k.shape[1]
    group = gqa_group(num_heads, num_kv_heads)
    if num_k == 0:
        out = torch.zeros(num_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
        return out, torch.full((num_q, num_heads), NEG_INF, device=q.device)

    # Query head h = kv * group + g  ->  rows (g, i) of kv head `kv`.
    qf = q.float().view(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qf = qf.reshape(num_kv_heads, group * num_q, head_dim)  # [kv, group*num_q, D]
    kt = k.float().permute(1, 2, 0)  # [kv, D, num_k]
    vf = v.float().permute(1, 0, 2)  # [kv, num_k, D]

    scores = torch.matmul(qf, kt).mul_(scale)  # [kv, group*num_q, num_k]
    if mask is not None:
        scores4 = scores.view(num_kv_heads, group, num_q, num_k)
        scores4.masked_fill_(~mask.to(device=scores.device, dtype=torch.bool), NEG_INF)

    m = finite_or_zero(scores.amax(dim=-1, keepdim=True))  # [kv, group*num_q, 1]
    p = torch.exp(scores.sub_(m))  # masked keys: exp(-inf) = 0
    denom = p.sum(dim=-1, keepdim=True)  # [kv, group*num_q, 1]
    out = torch.matmul(p, vf)  # [kv, group*num_q, D]
    out = torch.where(denom > 0, out / denom.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    lse = m + torch.log(denom)  # log(0) = -inf for fully masked rows

    out = out.view(num_kv_heads, group, num_q, head_dim).permute(2, 0, 1, 3)
    lse = lse.view(num_kv_heads, group, num_q).permute(2, 0, 1)
    return out.reshape(num_q, num_heads, head_dim), lse.reshape(num_q, num_heads)


def merge_partials(
    out_a: Tensor,  # [num_q, num_heads, head_dim]
    lse_a: Tensor,  # [num_q, num_heads]
    out_b: Tensor,  # [num_q, num_heads, head_dim]
    lse_b: Tensor,  # [num_q, num_heads]
) -> tuple[Tensor, Tensor]:  # out [num_q, num_heads, head_dim] fp32, lse [num_q, num_heads] fp32
    """Exact merge of two partial results over disjoint key sets (either side may be -inf)."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    m = finite_or_zero(torch.maximum(lse_a, lse_b))
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)  # in [0, 1]; one of them is 1 if any
    total = w_a + w_b
    safe = total.clamp_min(torch.finfo(torch.float32).tiny)
    out = out_a.float() * (w_a / safe).unsqueeze(-1) + out_b.float() * (w_b / safe).unsqueeze(-1)
    return out, m + torch.log(total)


def merge_all(outs: list[Tensor], lses: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Exact merge of any number of partial results over disjoint keys, all fp32 and the same
    shape (``outs`` ``[..., D]``, ``lses`` ``[...]``): the merged output and its log-sum-exp.
    Rows no partial saw come out 0 with lse -inf."""
    if len(outs) == 1:
        return outs[0], lses[0]
    lse = torch.stack(lses)  # [C, ...]
    m = finite_or_zero(lse.amax(dim=0))
    w = torch.exp(lse - m)  # [C, ...]; 0 for partials that saw no key
    total = w.sum(dim=0)
    out = (torch.stack(outs) * w.unsqueeze(-1)).sum(dim=0)
    out = out / total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return out, m + torch.log(total)  # log 0 = -inf: saw no key


class AttentionAccumulator:
    """Running merge of any number of partial results, in any order.

    Keeps the running max `m`, the running normaliser `l = sum_c exp(lse_c - m)` and the
    unnormalised sum `acc = sum_c exp(lse_c - m) out_c`; a new maximum rescales both. Dividing
    happens once, in `result`.
    """

    def __init__(self) -> None:
        self._m: Tensor | None = None  # [num_q, num_heads]
        self._l: Tensor | None = None  # [num_q, num_heads]
        self._acc: Tensor | None = None  # [num_q, num_heads, head_dim]
        self.num_chunks = 0

    def add(
        self,
        out: Tensor,  # [num_q, num_heads, head_dim]
        lse: Tensor,  # [num_q, num_heads]
    ) -> None:
        """Fold in one partial result from `partial_attention`."""
        out, lse = out.float(), lse.float()
        self.num_chunks += 1
        if self._m is None or self._l is None or self._acc is None:
            self._m = lse  # the true running max: may stay -inf until a row sees a key
            w = torch.exp(lse - finite_or_zero(lse))  # 1, or 0 where lse = -inf
            self._l, self._acc = w, out * w.unsqueeze(-1)
            return
        new_m = torch.maximum(self._m, lse)
        m_safe = finite_or_zero(new_m)
        old_w, w = torch.exp(self._m - m_safe), torch.exp(lse - m_safe)
        self._l = self._l * old_w + w
        self._acc = self._acc * old_w.unsqueeze(-1) + out * w.unsqueeze(-1)
        self._m = new_m

    def lse(self) -> Tensor:  # [num_q, num_heads] fp32
        """Log-sum-exp over every key merged so far (-inf where nothing was attended)."""
        if self._m is None or self._l is None:
            raise RuntimeError("AttentionAccumulator.lse() before any add()")
        return self._m + torch.log(self._l)

    def result(self, dtype: torch.dtype = torch.float32) -> Tensor:  # [num_q, num_heads, head_dim]
        """The merged attention output, cast to `dtype`; rows that attended nothing are 0."""
        if self._l is None or self._acc is None:
            raise RuntimeError("AttentionAccumulator.result() before any add()")
        safe = self._l.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
        return (self._acc / safe).to(dtype)
