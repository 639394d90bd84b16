"""The fused Triton partial-attention kernel equals the torch path (and so full attention).

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, numpy on the CPU) at
small sizes; without Triton those tests skip.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import Tensor

CUDA = torch.cuda.is_available()
# Triton reads TRITON_INTERPRET when it is imported, so switch it on before the first import.
_INTERPRETABLE = CUDA or "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specstream.attention import (  # noqa: E402
    AttentionAccumulator,
    causal_mask,
    full_attention,
    partial_attention,
)
from specstream.attention import triton_partial as tp  # noqa: E402

needs_triton = pytest.mark.skipif(not tp.triton_available(), reason="triton is not installed")


def rel_err(a: Tensor, b: Tensor) -> float:
    """max|a - b| / max|b|, in fp32."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max()).item()


def qkv(
    num_q: int, heads: int, kv: int, dim: int, num_k: int, dtype: torch.dtype, device: str = "cpu"
) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(num_q * 1000 + num_k)
    q = torch.randn(num_q, heads, dim, generator=gen)  # [num_q, H, D]
    k = torch.randn(num_k, kv, dim, generator=gen)  # [num_k, KV, D]
    v = torch.randn(num_k, kv, dim, generator=gen)  # [num_k, KV, D]
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


@pytest.fixture
def kernel_device() -> str:
    """"cuda" where a GPU is present, else "cpu" through Triton's interpreter."""
    if not tp.triton_available():
        pytest.skip("triton is not installed")
    if not _INTERPRETABLE:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set")
    return "cuda" if CUDA else "cpu"


def test_offset_causal_mask_matches_reference() -> None:
    assert torch.equal(tp.offset_causal_mask(4, 9, 5), causal_mask(4, 9))
    assert not tp.offset_causal_mask(2, 5, -2)[0].any()  # first row sees nothing


@pytest.mark.skipif(tp.triton_available(), reason="triton is installed")
def test_kernel_without_triton_raises() -> None:
    q, k, v = qkv(1, 2, 1, 16, 4, torch.float32)
    with pytest.raises(RuntimeError, match="needs Triton"):
        tp.partial_attention_triton(q, k, v, 0.25)


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(
    "num_q,heads,kv,dim,num_k,causal",
    [
        (1, 4, 4, 16, 5, False),  # MHA, one query, fewer keys than a tile
        (3, 4, 2, 32, 70, False),  # GQA 2, keys across two tiles
        (5, 8, 2, 64, 37, True),  # GQA 4, causal tail: last 5 keys are the queries
        (17, 2, 1, 32, 130, True),  # rows past one BLOCK_M, three key tiles
    ],
)
def test_kernel_matches_torch_path(
    kernel_device: str, dtype: torch.dtype, tol: float,
    num_q: int, heads: int, kv: int, dim: int, num_k: int, causal: bool,
) -> None:  # fmt: skip
    q, k, v = qkv(num_q, heads, kv, dim, num_k, dtype, kernel_device)
    scale = dim**-0.5
    offset = num_k - num_q if causal else None
    out, lse = tp.partial_attention_triton(q, k, v, scale, offset)
    mask = causal_mask(num_q, num_k, q.device) if causal else None
    ref_out, ref_lse = partial_attention(q, k, v, scale, mask)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == (num_q, heads, dim) and lse.shape == (num_q, heads)
    assert rel_err(out, ref_out) <= tol
    assert rel_err(lse, ref_lse) <= tol


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_streamed_chunks_merge_to_full_attention(
    kernel_device: str, dtype: torch.dtype, tol: float
) -> None:
    num_q, num_k, chunk = 4, 150, 48
    q, k, v = qkv(num_q, 4, 2, 32, num_k, dtype, kernel_device)
    cold = num_k - 20  # history in chunks, then tail + new tokens with the causal mask
    acc = AttentionAccumulator()
    for s in range(0, cold, chunk):
        e = min(s + chunk, cold)
        acc.add(*tp.partial_attention_triton(q, k[s:e], v[s:e], 32**-0.5))
    acc.add(*tp.partial_attention_triton(q, k[cold:], v[cold:], 32**-0.5, 20 - num_q))
    ref = full_attention(q, k, v, 32**-0.5, causal_mask(num_q, num_k, q.device))
    assert rel_err(acc.result(dtype), ref) <= tol


@needs_triton
def test_fully_masked_rows_and_strided_inputs(kernel_device: str) -> None:
    q, k, v = qkv(3, 4, 2, 16, 6, torch.float32, kernel_device)
    out, lse = tp.partial_attention_triton(q, k, v, 0.25, causal_offset=-2)
    assert torch.isneginf(lse[:2]).all() and (out[:2] == 0).all()  # rows 0, 1 see no key
    assert torch.isfinite(lse[2]).all() and torch.isfinite(out).all()
    # k, v as views into a [2, n, kv, D] staging buffer; q with a non-unit head stride
    buf = torch.stack([k, v]).contiguous()
    wide = torch.cat([q, q], dim=1)[:, ::2]  # [3, 4, 16], strided heads
    out, lse = tp.partial_attention_triton(wide, buf[0], buf[1], 0.25)
    ref_out, ref_lse = partial_attention(wide, k, v, 0.25)
    assert rel_err(out, ref_out) <= 1e-5 and rel_err(lse, ref_lse) <= 1e-5
    empty_out, empty_lse = tp.partial_attention_triton(q, k[:0], v[:0], 0.25)
    assert (empty_out == 0).all() and torch.isneginf(empty_lse).all()


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_kernel_on_cuda_at_model_shapes(dtype: torch.dtype, tol: float) -> None:
    """Qwen3-8B attention shapes: 32 heads over 8 kv heads, head_dim 128, a 2048-token chunk."""
    q, k, v = qkv(5, 32, 8, 128, 2048, dtype, "cuda")
    for offset in (None, 2048 - 5):
        out, lse = tp.partial_attention_triton(q, k, v, 128**-0.5, causal_offset=offset)
        mask = None if offset is None else causal_mask(5, 2048, "cuda")
        ref_out, ref_lse = partial_attention(q, k, v, 128**-0.5, mask)
        assert rel_err(out, ref_out) <= tol and rel_err(lse, ref_lse) <= tol
