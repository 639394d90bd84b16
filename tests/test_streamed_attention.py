"""Streamed (chunked, online-softmax) attention equals full attention: partial results over key
pieces merged by ``AttentionAccumulator`` and ``merge_partials`` (the engine's waves merge the
same way; ``test_chunk_waves.py`` checks them)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from specstream.attention import (
    AttentionAccumulator,
    causal_mask,
    full_attention,
    merge_partials,
    partial_attention,
)

HEAD_DIM = 32


def streamed_attention(q: Tensor, chunks: list[tuple[Tensor, Tensor, Tensor | None]],
                       scale: float, out_dtype: torch.dtype | None = None) -> Tensor:
    """Attention over key pieces ``(k, v, mask)``, each a partial merged as it comes."""
    acc = AttentionAccumulator()
    for k, v, mask in chunks:
        acc.add(*partial_attention(q, k, v, scale, mask))
    if not acc.num_chunks:
        return torch.zeros_like(q, dtype=out_dtype or q.dtype)
    return acc.result(out_dtype or q.dtype)


def rel_err(a: Tensor, b: Tensor) -> float:
    """max|a - b| / max|b|, in fp32."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max()).item()


def make_request(
    num_q: int, num_kv_heads: int, group: int, num_hist: int, dtype: torch.dtype, seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    """q [num_q, H, D]; k, v [num_hist + num_q, kv, D]; the last num_q keys are the queries'."""
    gen = torch.Generator().manual_seed(seed)
    num_k = num_hist + num_q
    q = torch.randn(num_q, num_kv_heads * group, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(num_k, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(num_k, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    return q, k, v


def pieces(
    k: Tensor, v: Tensor, mask: Tensor, chunk: int, num_tail: int = 0
) -> list[tuple[Tensor, Tensor, Tensor | None]]:
    """Cold history in `chunk`-token pieces (no mask), then tail + new tokens with the mask."""
    num_q, num_k = mask.shape
    cold_end = num_k - num_q - num_tail
    out: list[tuple[Tensor, Tensor, Tensor | None]] = [
        (k[s : min(s + chunk, cold_end)], v[s : min(s + chunk, cold_end)], None)
        for s in range(0, cold_end, chunk)
    ]
    out.append((k[cold_end:], v[cold_end:], mask[:, cold_end:]))
    return out


def test_causal_mask_layout() -> None:
    m = causal_mask(3, 5)
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, expected)


@pytest.mark.parametrize("group", [1, 4])
def test_reference_matches_sdpa(group: int) -> None:
    q, k, v = make_request(4, 2, group, 50, torch.float32, seed=1)
    mask = causal_mask(4, k.shape[0])
    ref = full_attention(q, k, v, 0.3, mask)
    kr, vr = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1), kr, vr, attn_mask=mask, scale=0.3)
    assert rel_err(ref, sdpa.transpose(0, 1)) <= 1e-5


@pytest.mark.parametrize("chunk", [1, 7, 64, 150, 1000])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_chunk_sizes_fp32(chunk: int, group: int) -> None:
    q, k, v = make_request(5, 2, group, 150, torch.float32, seed=chunk + group)
    mask = causal_mask(5, k.shape[0])
    ref = full_attention(q, k, v, HEAD_DIM**-0.5, mask)
    out = streamed_attention(q, pieces(k, v, mask, chunk), HEAD_DIM**-0.5)
    assert out.dtype == torch.float32
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("group", range(1, 9))
@pytest.mark.parametrize("num_q", range(1, 10))
def test_gqa_ratios_and_query_counts(group: int, num_q: int) -> None:
    q, k, v = make_request(num_q, 2, group, 97, torch.float32, seed=10 * group + num_q)
    mask = causal_mask(num_q, k.shape[0])
    ref = full_attention(q, k, v, 0.2, mask)
    out = streamed_attention(q, pieces(k, v, mask, 32, num_tail=5), 0.2)
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("chunk", [1, 33, 512])
def test_bf16_inputs(chunk: int) -> None:
    q, k, v = make_request(5, 2, 4, 300, torch.bfloat16, seed=chunk)
    mask = causal_mask(5, k.shape[0])
    ref = full_attention(q, k, v, HEAD_DIM**-0.5, mask)
    out = streamed_attention(q, pieces(k, v, mask, chunk), HEAD_DIM**-0.5)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) <= 1e-2
    # Against an fp32 computation from the same bf16 values too: the fp32 path is exact.
    ref32 = full_attention(q.float(), k.float(), v.float(), HEAD_DIM**-0.5, mask)
    out32 = streamed_attention(q, pieces(k, v, mask, chunk), HEAD_DIM**-0.5, torch.float32)
    assert rel_err(out32, ref32) <= 1e-5


def test_tail_plus_new_tokens_piece() -> None:
    """Last piece = resident tail + new tokens, causal among the new ones."""
    num_q, num_tail = 4, 16
    q, k, v = make_request(num_q, 2, 2, 200, torch.float32, seed=3)
    mask = causal_mask(num_q, k.shape[0])
    parts = pieces(k, v, mask, 64, num_tail=num_tail)
    last_k, _, last_mask = parts[-1]
    assert last_k.shape[0] == num_tail + num_q and last_mask is not None
    assert torch.equal(last_mask, causal_mask(num_q, num_tail + num_q))
    out = streamed_attention(q, parts, 0.25)
    assert rel_err(out, full_attention(q, k, v, 0.25, mask)) <= 1e-5


def test_batch_of_unequal_lengths() -> None:
    lengths, num_q = [1, 40, 513, 2049], 3
    for i, num_hist in enumerate(lengths):
        q, k, v = make_request(num_q, 2, 4, num_hist, torch.float32, seed=100 + i)
        mask = causal_mask(num_q, k.shape[0])
        out = streamed_attention(q, pieces(k, v, mask, 256, num_tail=min(num_hist, 8)), 0.1)
        assert rel_err(out, full_attention(q, k, v, 0.1, mask)) <= 1e-5, num_hist


def test_fully_masked_chunk_contributes_nothing() -> None:
    q, k, v = make_request(3, 2, 2, 60, torch.float32, seed=4)
    mask = causal_mask(3, k.shape[0])
    blocked = torch.zeros(3, 30, dtype=torch.bool)
    out_b, lse_b = partial_attention(q, k[:30] * 50.0, v[:30] * 50.0, 0.3, blocked)
    assert torch.isneginf(lse_b).all() and torch.equal(out_b, torch.zeros_like(out_b))
    parts = pieces(k, v, mask, 25) + [(k[:30] * 50.0, v[:30] * 50.0, blocked)]
    out = streamed_attention(q, parts, 0.3)
    assert rel_err(out, full_attention(q, k, v, 0.3, mask)) <= 1e-5


def test_fully_masked_rows_give_zeros_not_nan() -> None:
    q, k, v = make_request(3, 1, 2, 10, torch.float32, seed=5)
    mask = causal_mask(3, k.shape[0])
    mask[1] = False
    parts = [(k[s : s + 4], v[s : s + 4], mask[:, s : s + 4]) for s in range(0, k.shape[0], 4)]
    out = streamed_attention(q, parts, 0.3)
    ref = full_attention(q, k, v, 0.3, mask)
    assert not out.isnan().any()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_err(out, ref) <= 1e-5


def test_merge_of_two_empty_sides_is_safe() -> None:
    zeros, ninf = torch.zeros(2, 4, 8), torch.full((2, 4), float("-inf"))
    out, lse = merge_partials(zeros, ninf, zeros, ninf)
    assert torch.equal(out, zeros) and torch.isneginf(lse).all()
    acc = AttentionAccumulator()
    acc.add(zeros, ninf)
    acc.add(zeros, ninf)
    assert torch.equal(acc.result(), zeros) and torch.isneginf(acc.lse()).all()


def test_very_negative_lse_after_empty_chunk() -> None:
    """A -inf partial first must not pin the running max at 0 (exp(-200) underflows)."""
    out = torch.randn(2, 4, 8)
    ninf, low = torch.full((2, 4), float("-inf")), torch.full((2, 4), -200.0)
    acc = AttentionAccumulator()
    acc.add(torch.zeros_like(out), ninf)
    acc.add(out, low)
    acc.add(torch.zeros_like(out), ninf)
    assert torch.allclose(acc.result(), out) and torch.equal(acc.lse(), low)
    merged, lse = merge_partials(torch.zeros_like(out), ninf, out, low)
    assert torch.allclose(merged, out) and torch.equal(lse, low)


@pytest.mark.parametrize("seed", range(4))
def test_arrival_order_does_not_matter(seed: int) -> None:
    q, k, v = make_request(5, 2, 4, 500, torch.float32, seed=20 + seed)
    mask = causal_mask(5, k.shape[0])
    parts = pieces(k, v, mask, 48, num_tail=7)
    random.Random(seed).shuffle(parts)
    ref = full_attention(q, k, v, 0.2, mask)
    assert rel_err(streamed_attention(q, parts, 0.2), ref) <= 1e-5
    # Pairwise tree of merge_partials agrees with the running accumulator and its lse.
    partials = [partial_attention(q, kk, vv, 0.2, mm) for kk, vv, mm in parts]
    while len(partials) > 1:
        partials = [
            merge_partials(*partials[i], *partials[i + 1]) if i + 1 < len(partials) else partials[i]
            for i in range(0, len(partials), 2)
        ]
    out, lse = partials[0]
    assert rel_err(out, ref) <= 1e-5
    _, lse_full = partial_attention(q, k, v, 0.2, mask)
    assert torch.allclose(lse, lse_full, rtol=1e-5, atol=1e-5)


def test_large_scores_do_not_overflow() -> None:
    q, k, v = make_request(2, 2, 2, 100, torch.float32, seed=6)
    mask = causal_mask(2, k.shape[0])
    q = q * 40.0  # scores in the thousands: exp() would overflow without the running max
    out = streamed_attention(q, pieces(k, v, mask, 16), 1.0)
    assert torch.isfinite(out).all()
    assert rel_err(out, full_attention(q, k, v, 1.0, mask)) <= 1e-5
