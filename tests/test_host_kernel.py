"""host_partial against plain full attention over each request's blocks, concatenated."""

from __future__ import annotations

import pytest
import torch

from specstream.attention.host_kernel import host_partial
from specstream.attention.reference import full_attention

BLOCK = 8
NUM_BLOCKS = 64


def make_host(kv: int, d: int, dtype: torch.dtype, layers: int = 2) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(layers, 2, NUM_BLOCKS, BLOCK, kv, d).to(dtype)


def reference(host: torch.Tensor, layer: int, q: torch.Tensor, blocks: list[tuple[int, ...]],
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Full softmax attention and the log-sum-exp, one request at a time, in fp32."""
    kv, d = host.shape[4], host.shape[5]
    g = q.shape[2] // kv
    outs, lses = [], []
    for r, ids in enumerate(blocks):
        idx = torch.tensor(ids, dtype=torch.long)
        k = host[layer, 0, idx].reshape(-1, kv, d).float()  # [N, kv, D]
        v = host[layer, 1, idx].reshape(-1, kv, d).float()
        outs.append(full_attention(q[r], k, v, scale))
        kh = k.repeat_interleave(g, dim=1)  # [N, H, D]
        lses.append(torch.logsumexp(torch.einsum("phd,nhd->phn", q[r], kh) * scale, dim=-1))
    return torch.stack(outs), torch.stack(lses)


LAYOUTS = {
    "contiguous": [tuple(range(5, 13))],
    "scattered": [(40, 3, 17, 9, 62)],
    "mixed": [(10, 11, 12, 30, 31, 2, 50, 51, 52, 53)],
    "requests": [tuple(range(20, 26)), (1, 7, 3), (33, 34, 35, 36, 60), (44,)],
    # a shared prefix (20..23) attended once for three requests, one of them no further
    "shared": [(20, 21, 22, 23, 5), (20, 21, 22, 23), (9,), (20, 21, 22, 23, 40, 41), (20, 6)],
    "shared-run": [(20, 21, 22, 23, 5), (20, 21, 22, 23), (9,), (20, 21, 22, 23, 40, 41)],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("num_q", [1, 5])
@pytest.mark.parametrize(("kv", "group"), [(2, 3), (1, 1)])
def test_matches_reference_fp32(layout: str, num_q: int, kv: int, group: int) -> None:
    d = 16
    host = make_host(kv, d, torch.float32)
    blocks = LAYOUTS[layout]
    q = torch.randn(len(blocks), num_q, kv * group, d)
    out, lse = host_partial(host, 1, q, blocks, BLOCK, d**-0.5)
    ref_out, ref_lse = reference(host, 1, q, blocks, d**-0.5)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_a_shared_prefix_is_read_once_for_all_its_requests() -> None:
    from specstream.attention.host_kernel import blocks_read, shared_prefixes

    blocks = LAYOUTS["shared"]
    assert shared_prefixes(blocks) == [([0, 1, 3, 4], (20,))]  # request 4 shares block 20 only
    assert shared_prefixes(blocks[:4]) == [([0, 1, 3], (20, 21, 22, 23))]
    assert blocks_read(blocks[:4]) == 4 + 1 + 1 + 2


def test_runs_in_place_are_merged_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests past GATHER_MAX_BYTES: each run attended in place, the partials merged."""
    import specstream.attention.host_kernel as hk

    monkeypatch.setattr(hk, "GATHER_MAX_BYTES", 0)
    d, kv = 16, 2
    host = make_host(kv, d, torch.float32)
    blocks = LAYOUTS["mixed"] + LAYOUTS["scattered"] + LAYOUTS["contiguous"]
    q = torch.randn(3, 3, kv * 3, d)
    out, lse = host_partial(host, 0, q, blocks, BLOCK, 0.3)
    ref_out, ref_lse = reference(host, 0, q, blocks, 0.3)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "requests"])
def test_low_precision_storage(dtype: torch.dtype, layout: str) -> None:
    d, kv = 16, 2
    host = make_host(kv, d, dtype)
    blocks = LAYOUTS[layout]
    q = torch.randn(len(blocks), 2, kv * 3, d)
    out, lse = host_partial(host, 1, q, blocks, BLOCK, d**-0.5)
    # the reference reads the same stored values, so only fp32 rounding differs
    ref_out, ref_lse = reference(host, 1, q, blocks, d**-0.5)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_request_without_blocks_weighs_nothing() -> None:
    d, kv = 16, 2
    host = make_host(kv, d, torch.float32)
    q = torch.randn(2, 1, kv * 3, d)
    out, lse = host_partial(host, 0, q, [(), (4, 5)], BLOCK, 0.25)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isneginf(lse[0]).all()
    ref_out, ref_lse = reference(host, 0, q[1:], [(4, 5)], 0.25)
    torch.testing.assert_close(out[1:], ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[1:], ref_lse, atol=1e-5, rtol=1e-5)


def test_scratch_reuse_across_calls() -> None:
    """A bigger gather after a smaller one (and the reverse) gives the same as fresh calls."""
    d, kv = 16, 2
    host = make_host(kv, d, torch.float32)
    q = torch.randn(1, 4, kv * 3, d)
    small, big = [(9, 1, 30)], [(3, 50, 7, 20, 21, 22, 60, 0)]
    for blocks in (small, big, small):
        out, lse = host_partial(host, 1, q, blocks, BLOCK, 0.2)
        ref_out, ref_lse = reference(host, 1, q, blocks, 0.2)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
