"""The chunk-wave Triton kernel equals its torch reference, and waves merge to full attention.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, numpy on the CPU) at
small sizes; without Triton the kernel tests skip and only the torch reference is tested.
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
    causal_mask,
    full_attention,
    merge_partials,
    partial_attention,
)
from specstream.attention import triton_wave as tw  # noqa: E402
from specstream.attention.triton_partial import offset_causal_mask  # noqa: E402

NO_TRITON = "triton cannot be imported, so the kernel cannot run"
needs_triton = pytest.mark.skipif(not tw.triton_available(), reason=NO_TRITON)


def rel_err(a: Tensor, b: Tensor) -> float:
    """max|a - b| / max|b| over finite entries, in fp32."""
    a, b = a.float(), b.float()
    ok = torch.isfinite(b)
    return ((a[ok] - b[ok]).abs().max() / b[ok].abs().max()).item()


def assert_matches(
    got: tuple[Tensor, Tensor], ref: tuple[Tensor, Tensor], tol: float = 1e-5
) -> None:
    """Same shapes, fp32, no NaN, -inf lse in the same places, values within `tol`."""
    (out, lse), (ref_out, ref_lse) = got, ref
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)  # -inf only equals -inf


def wave(
    num_w: int, num_q: int, heads: int, kv: int, dim: int, num_k: int,
    dtype: torch.dtype = torch.float32, device: str = "cpu",
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    gen = torch.Generator().manual_seed(num_w * 10_000 + num_q * 1000 + num_k)
    q = torch.randn(num_w, num_q, heads, dim, generator=gen)  # [W, P, H, D]
    k = torch.randn(num_w, num_k, kv, dim, generator=gen)  # [W, N, KV, D]
    v = torch.randn(num_w, num_k, kv, dim, generator=gen)  # [W, N, KV, D]
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


@pytest.fixture
def kernel_device() -> str:
    """The device the kernel runs on: "cuda" with a GPU, else "cpu" in Triton's interpreter."""
    if not tw.triton_available():
        pytest.skip(NO_TRITON)
    if not _INTERPRETABLE:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set")
    return "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("causal", [False, True])
def test_torch_reference_is_per_request_partial_attention(causal: bool) -> None:
    q, k, v = wave(3, 5, 4, 2, 16, 12)
    key_len = torch.tensor([12, 0, 7])
    offset = torch.tensor([7, 3, -2]) if causal else None
    out, lse = tw.wave_attention_torch(q, k, v, 0.25, key_len, offset)
    for w in range(3):
        n = int(key_len[w])
        mask = offset_causal_mask(5, n, int(offset[w])) if offset is not None else None
        assert_matches((out[w], lse[w]), partial_attention(q[w], k[w, :n], v[w, :n], 0.25, mask))


@needs_triton
@pytest.mark.parametrize(
    "num_w,num_q,heads,kv,dim,num_k,key_len,offset",
    [
        (3, 1, 4, 2, 16, 20, [20, 0, 7], None),  # P = 1, GQA 2, an empty request
        (3, 1, 4, 1, 16, 20, [5, 20, 0], [4, 19, 0]),  # P = 1, one kv head, causal
        (3, 5, 4, 2, 32, 70, [70, 33, 0], None),  # P = 5, keys across two tiles
        (4, 5, 4, 1, 16, 70, [70, 75, 0, 33], [65, 72, 3, -2]),  # causal, len > N, masked rows
        (2, 5, 2, 2, 16, 9, [9, 4], [-3, 0]),  # MHA, causal offsets that hide whole rows
    ],
)
def test_kernel_matches_torch_reference(
    kernel_device: str, num_w: int, num_q: int, heads: int, kv: int, dim: int, num_k: int,
    key_len: list[int], offset: list[int] | None,
) -> None:  # fmt: skip
    q, k, v = wave(num_w, num_q, heads, kv, dim, num_k, device=kernel_device)
    lens = torch.tensor(key_len, device=kernel_device)
    offs = None if offset is None else torch.tensor(offset, device=kernel_device)
    ref = tw.wave_attention_torch(q, k, v, dim**-0.5, lens, offs)
    got = tw.wave_attention_triton(q, k, v, dim**-0.5, lens.int(), offs)  # int32 lengths too
    assert_matches(got, ref)


@needs_triton
def test_rows_that_see_no_key(kernel_device: str) -> None:
    q, k, v = wave(3, 4, 4, 2, 16, 10, device=kernel_device)
    lens = torch.tensor([0, 10, 10], device=kernel_device)
    offs = torch.tensor([5, -2, -10], device=kernel_device)  # request 1: rows 0, 1 see nothing
    for impl in (tw.wave_attention_torch, tw.wave_attention_triton):
        out, lse = impl(q, k, v, 0.25, lens, offs)
        assert torch.isneginf(lse[0]).all() and (out[0] == 0).all()  # no keys at all
        assert torch.isneginf(lse[1, :2]).all() and (out[1, :2] == 0).all()
        assert torch.isfinite(lse[1, 2:]).all()
        assert torch.isneginf(lse[2]).all() and (out[2] == 0).all()  # fully masked
        assert not out.isnan().any()


@needs_triton
def test_strided_views(kernel_device: str) -> None:
    """k, v slices of a [2, W, N_max, kv, D] staging buffer; q, key_len and head dim strided."""
    num_w, num_q, n_max, n = 3, 3, 40, 24
    q, k, v = wave(num_w, num_q, 4, 2, 16, n_max, device=kernel_device)
    buf = torch.stack([k, v])  # [2, W, N_max, KV, D]
    kw, vw = buf[0, :, :n], buf[1, :, :n]  # N-stride of the full buffer
    assert not kw.is_contiguous()
    wide_q = torch.cat([q, q], dim=2)[:, :, ::2]  # [W, P, H, D], strided heads
    lens = torch.tensor([24, 0, 7, 0, 11, 0], device=kernel_device)[::2]
    offs = torch.tensor([21, 4, 9], device=kernel_device)
    for o in (None, offs):
        ref = tw.wave_attention_torch(wide_q, kw.contiguous(), vw.contiguous(), 0.25, lens, o)
        assert_matches(tw.wave_attention_triton(wide_q, kw, vw, 0.25, lens, o), ref)
    # a head dim with stride 2
    k2 = torch.stack([k, k], dim=-1).flatten(-2)[..., ::2]  # [W, N_max, KV, D], stride D = 2
    assert k2.stride(-1) == 2
    ref = tw.wave_attention_torch(q, k, v, 0.25, lens)
    assert_matches(tw.wave_attention_triton(q, k2, v, 0.25, lens), ref)


@needs_triton
def test_two_waves_merge_to_full_attention(kernel_device: str) -> None:
    """A history wave and a causal tail wave, merged by lse, equal softmax over all keys."""
    num_w, num_p, heads, kv, dim = 3, 5, 4, 2, 16
    hist_len, tail_len, num_q = [40, 0, 17], [8, 3, 5], [3, 1, 5]  # real queries per request
    q, hk, hv = wave(num_w, num_p, heads, kv, dim, max(hist_len), device=kernel_device)
    _, tk, tv = wave(num_w, 1, heads, kv, dim, max(tail_len), device=kernel_device)
    scale = dim**-0.5
    dev = kernel_device
    hist = tw.wave_attention_triton(q, hk, hv, scale, torch.tensor(hist_len, device=dev))
    offs = torch.tensor([t - n for t, n in zip(tail_len, num_q)], device=dev)
    tail = tw.wave_attention_triton(q, tk, tv, scale, torch.tensor(tail_len, device=dev), offs)
    out, lse = merge_partials(*hist, *tail)  # [W, P, H, D], [W, P, H]
    assert not out.isnan().any() and not lse.isnan().any()  # padding rows included
    for w in range(num_w):
        nq, nh, nt = num_q[w], hist_len[w], tail_len[w]
        keys = torch.cat([hk[w, :nh], tk[w, :nt]])  # [nh + nt, KV, D]
        vals = torch.cat([hv[w, :nh], tv[w, :nt]])
        ref = full_attention(q[w, :nq], keys, vals, scale, causal_mask(nq, nh + nt, dev))
        torch.testing.assert_close(out[w, :nq], ref, atol=1e-5, rtol=1e-5)


@needs_triton
def test_empty_waves_and_bad_arguments(kernel_device: str) -> None:
    q, k, v = wave(2, 3, 4, 2, 16, 0, device=kernel_device)
    lens = torch.zeros(2, dtype=torch.long, device=kernel_device)
    out, lse = tw.wave_attention_triton(q, k, v, 0.25, lens)  # N = 0: no launch
    assert out.shape == (2, 3, 4, 16) and (out == 0).all() and torch.isneginf(lse).all()
    q, k, v = wave(2, 3, 4, 2, 16, 5, device=kernel_device)
    with pytest.raises(ValueError, match="key_len"):
        tw.wave_attention_triton(q, k, v, 0.25, lens[:1])
    with pytest.raises(ValueError, match="causal_offset"):
        tw.wave_attention_triton(q, k, v, 0.25, lens, lens.float())
    with pytest.raises(ValueError, match="multiple"):
        tw.wave_attention_triton(q[:, :, :3], k, v, 0.25, lens)


@pytest.mark.skipif(tw.triton_available(), reason="triton is installed")
def test_kernel_without_triton_raises() -> None:
    q, k, v = wave(1, 1, 2, 1, 16, 4)
    with pytest.raises(RuntimeError, match="needs Triton"):
        tw.wave_attention_triton(q, k, v, 0.25, torch.tensor([4]))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_kernel_on_cuda_at_model_shapes(dtype: torch.dtype, tol: float) -> None:
    """Qwen3-8B attention: 32 heads over 8 kv heads, head_dim 128, ragged 2048-token chunks."""
    q, k, v = wave(4, 5, 32, 8, 128, 2048, dtype, "cuda")
    lens = torch.tensor([2048, 1500, 0, 700], device="cuda")
    offs = lens - 5
    for o in (None, offs):
        torch.cuda.set_sync_debug_mode("error")  # reading key_len on the host would raise
        try:
            out, lse = tw.wave_attention_triton(q, k, v, 128**-0.5, lens, o)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref_out, ref_lse = tw.wave_attention_torch(q, k, v, 128**-0.5, lens, o)
        assert not out.isnan().any() and not lse.isnan().any()
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        assert rel_err(out, ref_out) <= tol and rel_err(lse, ref_lse) <= tol
