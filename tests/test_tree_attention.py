"""A wave with an explicit (token-tree) mask equals plain masked softmax attention, on every
attention backend, and merges exactly with the other waves of a round."""

from __future__ import annotations

import pytest
import torch

from specstream.attention.triton_wave import triton_available
from specstream.attention.waves import ATTENTION, WaveShape
from specstream.spec.tree import DraftTree, tree_mask


def _reference(q, ks, vs, masks, scale):
    """Full softmax over the concatenated keys of every wave, masked: out [W, P, H, D]."""
    w, p, h, d = q.shape
    k, v, m = torch.cat(ks, 1), torch.cat(vs, 1), torch.cat(masks, 2)  # [W, N, kv, D], [W,P,N]
    g = h // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("wphd,wnhd->whpn", q, k) * scale
    s = s.masked_fill(~m[:, None], float("-inf"))
    return torch.einsum("whpn,wnhd->wphd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tree_wave_merged_with_history_equals_masked_attention(backend):
    if backend == "triton" and not triton_available():
        pytest.skip("triton not installed")
    torch.manual_seed(0)
    trees = [DraftTree((5, 6, 7, 8, 9), (-1, -1, 0, 0, 2)), DraftTree.chain([3, 4])]
    masks = [tree_mask(t) for t in trees]  # [N + 1, N + 1]: the root and the nodes
    p = max(m.shape[0] for m in masks)
    w, h, kv, d, hist = len(trees), 4, 2, 8, 11
    q = torch.randn(w, p, h, d)
    # wave 1: history every query sees (request 1 has 7 of the 11 keys)
    k1, v1 = torch.randn(w, hist, kv, d), torch.randn(w, hist, kv, d)
    lens = [hist, 7]
    # wave 2: the round's new tokens under each request's tree mask (padded to p)
    k2, v2 = torch.randn(w, p, kv, d), torch.randn(w, p, kv, d)
    tree = torch.zeros(w, p, p, dtype=torch.bool)
    for i, m in enumerate(masks):
        n = m.shape[0]
        tree[i, :n, :n] = m
        tree[i, n:, :n] = True  # padded queries: see something, their output is discarded
    att = ATTENTION.get(backend)(q, kv, d**-0.5)
    att.add(k1, v1, WaveShape.build(None, lens, hist, None, q.device))
    att.add(k2, v2, WaveShape.build(None, [m.shape[0] for m in masks], p, None, q.device,
                                    tree=tree))
    out = att.result()
    vis1 = torch.arange(hist)[None, None, :] < torch.tensor(lens)[:, None, None]
    vis1 = vis1.expand(w, p, hist)
    vis2 = tree & (torch.arange(p)[None, None, :]
                   < torch.tensor([m.shape[0] for m in masks])[:, None, None])
    ref = _reference(q, [k1, k2], [v1, v2], [vis1, vis2], d**-0.5)
    for i, m in enumerate(masks):
        n = m.shape[0]
        torch.testing.assert_close(out[i, :n], ref[i, :n], atol=1e-5, rtol=1e-5)
    # a node does not see its sibling: changing node 1's key leaves node 0's output alone
    k2b = k2.clone()
    k2b[0, 2] += 1.0  # node 1 of request 0 (query position 2)
    att2 = ATTENTION.get(backend)(q, kv, d**-0.5)
    att2.add(k1, v1, WaveShape.build(None, lens, hist, None, q.device))
    att2.add(k2b, v2, WaveShape.build(None, [m.shape[0] for m in masks], p, None, q.device,
                                      tree=tree))
    out2 = att2.result()
    torch.testing.assert_close(out2[0, 1], out[0, 1])  # node 0 (position 1)
    assert not torch.allclose(out2[0, 2], out[0, 2])  # node 1 itself


def test_tree_mask_shape_is_checked():
    with pytest.raises(ValueError, match="tree mask"):
        WaveShape.build(None, [3], 3, None, torch.device("cpu"),
                        tree=torch.ones(2, 3, 3, dtype=torch.bool))


def test_a_request_that_sees_no_key_in_a_wave_weighs_nothing_in_the_merge():
    """A wave row with no visible key (key_len 0) contributes lse -inf and out 0 on every
    path, so the merge equals attention over the other waves alone."""
    torch.manual_seed(1)
    w, p, h, kv, d, n = 2, 3, 4, 2, 8, 5
    q = torch.randn(w, p, h, d)
    k1, v1 = torch.randn(w, n, kv, d), torch.randn(w, n, kv, d)
    k2, v2 = torch.randn(w, n, kv, d), torch.randn(w, n, kv, d)
    att = ATTENTION.get("torch")(q, kv, d**-0.5)
    att.add(k1, v1, WaveShape.build(None, [n, n], n, None, q.device))
    att.add(k2, v2, WaveShape.build(None, [n, 0], n, None, q.device))  # request 1 sees none
    out = att.result()
    alone = ATTENTION.get("torch")(q, kv, d**-0.5)
    alone.add(k1, v1, WaveShape.build(None, [n, n], n, None, q.device))
    torch.testing.assert_close(out[1], alone.result()[1], atol=1e-6, rtol=1e-6)
