"""Token-tree drafting (``spec/draft_tree.py``): topk 1 is the chain of ``DraftJob``; a tree's
shape respects depth and node budget; every node's children are the draft's top-k after the
node's path, computed from scratch with plain causal attention (which checks the tree mask and
the positions), for batches of requests of different lengths under both cache policies; after a
tree round and the rollback to its root the cache holds no tree node."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specstream.attention import causal_mask, full_attention
from specstream.attention.waves import TorchWaves, WaveShape
from specstream.models.decoder import CausalLM
from specstream.models.loader import load_model
from specstream.sampling_params import SamplingParams
from specstream.spec.draft import DraftJob, DraftModelProposer
from specstream.spec.draft_tree import DraftTreeJob, TreeBuilder
from specstream.spec.proposer import Proposal, ProposeRequest
from specstream.spec.tree import DraftTree

SINKS, WINDOW_TOKENS = 4, 40
WINDOW = dict(cache="window", window_tokens=WINDOW_TOKENS, sink_tokens=SINKS,
              max_draft_tokens=8, max_draft_topk=3)
POLICIES = {"window": WINDOW, "full": dict(cache="full")}
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
SAMPLED = [SamplingParams(temperature=0.9, seed=s, max_tokens=64) for s in range(4)]
# 150 and 60 exceed sinks + window: a fresh request's catch-up is its sinks and last window
LENGTHS = [3, 150, 1, 37, 60]


@pytest.fixture(scope="module")
def draft_model(tiny_draft):
    return load_model(tiny_draft, torch.float32, "cpu")


def _contexts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(n)] for n in LENGTHS]


# ---- the plain reference ----------------------------------------------------------------
class _Causal:
    """Attention over the tokens fed, from scratch: plain causal softmax."""

    def __init__(self, model: CausalLM) -> None:
        self.scale = model.config.head_dim**-0.5

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        return full_attention(q, k, v, self.scale, causal_mask(q.shape[0], k.shape[0]))


@torch.no_grad()
def _plain_logp(model: CausalLM, tokens: list[int], positions: list[int]) -> torch.Tensor:
    """The draft's log-probabilities ``[V]`` after ``tokens`` (at ``positions``)."""
    hidden = model(torch.tensor(tokens), torch.tensor(positions), _Causal(model))
    return torch.log_softmax(model.compute_logits(hidden[-1:])[0], dim=-1)


def _view(ctx: list[int], policy: str) -> tuple[list[int], list[int]]:
    """What a fresh request's draft cache holds: all of it, or its sinks and last window."""
    pos = list(range(len(ctx)))
    if policy == "window" and len(ctx) > SINKS + WINDOW_TOKENS:
        pos = pos[:SINKS] + pos[-WINDOW_TOKENS:]
    return [ctx[p] for p in pos], pos


def _children(parents: list[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {-1: []}
    for i, a in enumerate(parents):
        kids.setdefault(a, []).append(i)
    return kids


def _check_against_plain(model: CausalLM, ctx: list[int], policy: str, prop: Proposal,
                         topk: int) -> dict[int, float]:
    """Every node's children are the plain draft's top-k after the node's path (a prefix of
    it, most probable first; ties within 1e-4 either way). Returns each node's plain
    cumulative log-probability."""
    tokens, parents = prop.token_ids, prop.parents
    assert parents is not None
    view, pos = _view(ctx, policy)
    root = len(ctx) - 1
    cum: dict[int, float] = {-1: 0.0}
    for node, kids in sorted(_children(parents).items()):
        path: list[int] = []
        a = node
        while a >= 0:
            path.insert(0, a)
            a = parents[a]
        logp = _plain_logp(model, view + [tokens[a] for a in path],
                           pos + [root + d for d in range(1, len(path) + 1)])
        got = [tokens[c] for c in kids]
        if not kids:
            continue
        assert len(got) <= topk and len(set(got)) == len(got)
        top = logp.topk(topk).values[: len(got)]
        assert torch.allclose(logp[got], top, atol=1e-4), (node, got, logp.topk(topk))
        for c in kids:
            cum[c] = cum[node] + float(logp[tokens[c]])
    return cum


# ---- the tree builder alone -----------------------------------------------------------------
def test_builder_keeps_the_spine_and_the_most_probable_other_paths() -> None:
    lp = math.log
    b = TreeBuilder(topk=2, depth=3, budget=6)  # the spine's 3 nodes and 3 others
    b.grow([[(10, lp(0.6)), (11, lp(0.3))]])  # the root's children
    assert b.spine == [0] and b.frontier == [0, 1]
    assert b.feed() == [[0], [1]]  # each sees itself
    b.grow([[(20, lp(0.5)), (21, lp(0.4))], [(22, lp(0.9)), (23, lp(0.1))]])
    # off the spine: 11 .3, 22 .27, 21 .24, 23 .03: the cut is .24; the spine grows with 20
    assert b.spine == [0, 2] and b.frontier == [2, 4]
    assert b.feed() == [[0, 2], [1, 3]]  # entries: 10, 11, 20, 22
    b.grow([[(30, lp(0.9)), (31, lp(0.05))], [(32, lp(0.99)), (33, lp(0.5))]])
    assert b.frontier == []  # depth 3 reached
    # the spine 10 20 30, then 11 (.3), 22 (.27), 32 (.2673); 21 (.24) just misses
    assert b.result() == ([10, 11, 20, 22, 30, 32], [-1, -1, 0, 1, 2, 3])
    assert DraftTree((10, 11, 20, 22, 30, 32), (-1, -1, 0, 1, 2, 3)).depth == 3


def test_builder_keeps_the_greedy_chain_however_improbable() -> None:
    lp = math.log
    b = TreeBuilder(topk=3, depth=3, budget=4)  # room for one node off the spine
    b.grow([[(1, lp(0.5)), (2, lp(0.45)), (3, lp(0.05))]])
    assert b.frontier == [0]  # 2 (.45) is the one other node: its children cannot get in
    b.feed()
    b.grow([[(4, lp(0.1)), (5, lp(0.05)), (6, lp(0.01))]])
    assert b.frontier == [3]
    b.feed()
    b.grow([[(7, lp(0.2)), (8, lp(0.1)), (9, lp(0.1))]])
    assert b.result() == ([1, 2, 4, 7], [-1, -1, 0, 2])  # the chain 1 4 7 (.01) and 2 (.45)
    b = TreeBuilder(topk=3, depth=3, budget=3)  # budget = depth: the chain alone
    b.grow([[(1, lp(0.5)), (2, lp(0.45)), (3, lp(0.05))]])
    assert b.frontier == [0]
    b.feed()
    b.grow([[(4, lp(0.1)), (5, lp(0.05)), (6, lp(0.01))]])
    b.feed()
    b.grow([[(7, lp(0.2)), (8, lp(0.1)), (9, lp(0.1))]])
    assert b.result() == ([1, 4, 7], [-1, 0, 1])


# ---- topk 1: the chain ----------------------------------------------------------------------
def test_topk_one_is_the_chain_job(draft_model) -> None:
    """A batch of topk 1 requests takes DraftJob itself and drafts the plain greedy chain."""
    proposer = DraftModelProposer(draft_model, **WINDOW)
    ctx = _contexts(0)
    reqs = [ProposeRequest(f"r{i}", t, 4, GREEDY, topk=1) for i, t in enumerate(ctx)]
    job = proposer.start(reqs)
    assert type(job) is DraftJob
    for t, p in zip(ctx, job.result()):
        assert p.probs is None and p.parents is None
        view, pos = _view(t, "window")
        for j, tok in enumerate(p.token_ids):  # each the argmax after the ones before
            logp = _plain_logp(draft_model, view + p.token_ids[:j],
                               pos + list(range(len(t), len(t) + j)))
            assert float(logp[tok]) >= float(logp.max()) - 1e-4


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_chain_requests_next_to_trees_draft_what_a_chain_batch_drafts(draft_model,
                                                                     policy) -> None:
    """Chain requests (greedy and seeded sampled, tokens and probabilities) in a batch with
    tree requests draft what they draft without them, round after round."""
    kw = POLICIES[policy]
    mixed, chains = DraftModelProposer(draft_model, **kw), DraftModelProposer(draft_model, **kw)
    ctx = _contexts(1)
    params = [GREEDY, SAMPLED[0], GREEDY, SAMPLED[1], SAMPLED[2]]
    topk = [1, 1, 3, 2, 1]  # requests 2 and 3 draft trees
    rng = random.Random(1)
    for _ in range(6):
        num = [rng.choice([1, 3, 4]) for _ in ctx]
        reqs = [ProposeRequest(f"r{i}", list(t), num[i], params[i], topk=topk[i], max_nodes=8)
                for i, t in enumerate(ctx)]
        job = mixed.start(reqs)
        assert isinstance(job, DraftTreeJob)
        got = job.result()
        want = dict(zip([r.request_id for r in reqs if r.topk == 1],
                        chains.propose([r for r in reqs if r.topk == 1])))
        for i, (r, p) in enumerate(zip(reqs, got)):
            if r.topk > 1:
                assert p.probs is None and p.parents is not None
                path = _random_path(rng, p)
                mixed.rollback(r.request_id, len(ctx[i]))  # the root's position + 1
                ctx[i] += path + [rng.randrange(128)]
                continue
            w = want[r.request_id]
            assert p.token_ids == w.token_ids and p.parents is None
            assert (p.probs is None) == (w.probs is None) == r.params.greedy
            if p.probs is not None and w.probs is not None:
                assert torch.allclose(p.probs, w.probs, atol=1e-6)
            ctx[i] += p.token_ids[: rng.randrange(len(p.token_ids) + 1)] + [rng.randrange(128)]
            mixed.rollback(r.request_id, len(ctx[i]) - 1)
            chains.rollback(r.request_id, len(ctx[i]) - 1)


def _random_path(rng: random.Random, p: Proposal) -> list[int]:
    """The tokens of a random accepted path of the proposal's tree (possibly empty)."""
    parents = p.parents
    assert parents is not None
    node, path = rng.randrange(-1, len(p.token_ids)), []
    while node >= 0:
        path.insert(0, p.token_ids[node])
        node = parents[node]
    return path


# ---- trees --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("budget", [5, 12])
def test_tree_shape_and_children_match_the_plain_draft(draft_model, policy, budget) -> None:
    """Requests of different lengths in one batch (some windowed), different topk and depths:
    parents come before children, depth <= num_tokens, nodes <= max_nodes, BFS order; every
    node's children (the root's included) are the plain draft's top-k after its path; first
    children from the root spell the chain a topk 1 round drafts."""
    proposer = DraftModelProposer(draft_model, **POLICIES[policy])
    ctx = _contexts(2)
    topk, depth = [2, 3, 3, 2, 3], [4, 3, 4, 1, 5]
    params = [GREEDY, SAMPLED[0], GREEDY, SAMPLED[1], GREEDY]
    reqs = [ProposeRequest(f"r{i}", t, depth[i], params[i], topk=topk[i], max_nodes=budget)
            for i, t in enumerate(ctx)]
    props = proposer.propose(reqs)
    chains = {r.request_id: p.token_ids for r, p in zip(reqs, DraftModelProposer(
        draft_model, **POLICIES[policy]).propose(
            [ProposeRequest(r.request_id, r.token_ids, min(r.num_tokens, budget), GREEDY)
             for r in reqs]))}
    for r, p in zip(reqs, props):
        parents = p.parents
        assert parents is not None and p.probs is None
        tree = DraftTree(tuple(p.token_ids), tuple(parents))  # validates the parents
        assert 0 < len(tree) <= budget and tree.depth <= r.num_tokens
        assert list(tree.depths) == sorted(tree.depths)  # BFS by depth
        _check_against_plain(draft_model, list(r.token_ids), policy, p, r.topk)
        c = proposer.caches[r.request_id]
        assert c.tree_entries == 0 and c.num_tokens == len(r.token_ids)  # tree dropped
        spine, node = [], -1  # first children: the greedy path
        while tree.children(node):
            node = tree.children(node)[0]
            spine.append(p.token_ids[node])
        assert spine == chains[r.request_id]  # the chain of the same depth
    # sampled requests rank by the raw draft too: the same trees as greedy ones
    again = DraftModelProposer(draft_model, **POLICIES[policy]).propose(
        [ProposeRequest(r.request_id, r.token_ids, r.num_tokens, GREEDY, topk=r.topk,
                        max_nodes=budget) for r in reqs])
    assert [(p.token_ids, p.parents) for p in props] == [
        (p.token_ids, p.parents) for p in again]


def test_a_generous_budget_expands_the_topk_most_probable_of_each_depth(draft_model) -> None:
    """With room for every node produced, each level feeds the spine's node and the topk - 1
    most probable other nodes of the newest depth (by the plain cumulative log-probability)
    and keeps all their children: one forward per level, one attention call per layer (all
    tree queries in one bucket)."""
    _Counting.calls = []
    proposer = DraftModelProposer(draft_model, **WINDOW, attention=_Counting)
    ctx, k, depth = _contexts(3), 3, 4
    reqs = [ProposeRequest(f"r{i}", t, depth, GREEDY, topk=k, max_nodes=200)
            for i, t in enumerate(ctx)]
    job = proposer.start(reqs)
    steps = 0
    while job.step():
        steps += 1
    assert steps == job.num_steps == depth  # the catch-up, then one forward per level
    layers = len(draft_model.layers)
    catch_up = len(_Counting.calls) - (depth - 1) * layers
    assert _Counting.calls[catch_up:] == [len(ctx)] * (depth - 1) * layers
    for r, p in zip(reqs, job.result()):
        cum = _check_against_plain(draft_model, list(r.token_ids), "window", p, k)
        tree = DraftTree(tuple(p.token_ids), tuple(p.parents or ()))
        assert len(tree) == k + (depth - 1) * k * k
        spine = [tree.children(-1)[0]]
        for d in range(1, depth):
            level = [i for i in range(len(tree)) if tree.depths[i] == d]
            fed = [i for i in level if tree.children(i)]
            assert all(len(tree.children(i)) == k for i in fed)
            assert spine[-1] in fed  # the greedy path, then the most probable others
            best = sorted((cum[i] for i in level if i != spine[-1]), reverse=True)[: k - 1]
            assert sorted((cum[i] for i in fed if i != spine[-1]), reverse=True) == (
                pytest.approx(best, abs=1e-4))
            spine.append(tree.children(spine[-1])[0])


class _Counting(TorchWaves):
    calls: list[int] = []  # W of each attention call

    def add(self, k: torch.Tensor, v: torch.Tensor, shape: WaveShape) -> None:
        type(self).calls.append(k.shape[0])
        super().add(k, v, shape)


# ---- rollback -------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_after_rollback_to_the_root_drafts_equal_a_fresh_proposer(draft_model, policy) -> None:
    """Tree and chain rounds in turn, each tree rolled back to its root (the engine keeps
    the committed tokens only) and a random path of it accepted: every round drafts what a
    fresh proposer drafts for the same tokens, and what the plain draft says; no tree node is
    left in the cache (the window holds the whole context here: no eviction)."""
    kw = dict(WINDOW, window_tokens=512) if policy == "window" else POLICIES[policy]
    drafting = DraftModelProposer(draft_model, **kw)
    rng = random.Random(4)
    tokens = [rng.randrange(128) for _ in range(30)]
    for r in range(10):
        topk = [3, 1, 2][r % 3]
        req = ProposeRequest("a", list(tokens), 4, GREEDY, topk=topk, max_nodes=9)
        got = drafting.propose([req])[0]
        fresh = DraftModelProposer(draft_model, **kw).propose([req])[0]
        assert (got.token_ids, got.parents) == (fresh.token_ids, fresh.parents)
        c = drafting.caches["a"]
        if topk > 1:
            _check_against_plain(draft_model, tokens, "full", got, topk)
            assert (c.length, c.num_tokens, c.tree_entries) == (len(tokens),) * 2 + (0,)
            drafting.rollback("a", len(tokens))  # the root's position + 1: nothing to drop
            tokens += _random_path(rng, got) + [rng.randrange(128)]
        else:
            assert c.length == len(tokens) + 3  # the chain: context plus its first 3 drafts
            tokens += got.token_ids[: rng.randrange(5)] + [rng.randrange(128)]
            drafting.rollback("a", len(tokens) - 1)


def test_an_unfinished_tree_round_is_dropped_by_rollback_and_catch_up(draft_model) -> None:
    """A tree job left after two levels (its nodes still cached): rollback, or the next
    round's catch-up, drops them; the next drafts equal a fresh proposer's."""
    rng = random.Random(5)
    tokens = [rng.randrange(128) for _ in range(20)]
    for rollback in (True, False):
        drafting = DraftModelProposer(draft_model, cache="full")
        job = drafting.start([ProposeRequest("a", list(tokens), 4, GREEDY, topk=3, max_nodes=30)])
        job.step()  # the catch-up
        job.step()  # takes in the root's children, feeds them: 3 nodes cached
        c = drafting.caches["a"]
        assert c.tree_entries == 3 and c.length == len(tokens) + 3
        if rollback:
            drafting.rollback("a", len(tokens))
            assert (c.length, c.tree_entries) == (len(tokens), 0)
        more = tokens + [rng.randrange(128)]
        for topk in (1, 3):
            req = ProposeRequest("a", list(more), 3, GREEDY, topk=topk, max_nodes=8)
            got = drafting.propose([req])[0]
            want = DraftModelProposer(draft_model, cache="full").propose([req])[0]
            assert (got.token_ids, got.parents) == (want.token_ids, want.parents)
            drafting.rollback("a", len(more))


def test_window_tree_rounds_keep_the_cache_of_catch_ups_only(draft_model) -> None:
    """Many tree rounds through window evictions: after each the cache (lengths and K/V) is
    what drafting one token per round (the catch-up alone) leaves, the root's best child is
    that token, and the pool never grows (capacity sized for the trees)."""
    trees = DraftModelProposer(draft_model, **WINDOW)
    chain = DraftModelProposer(draft_model, **WINDOW)
    trees.slack = chain.slack = 8  # evict often
    capacity = trees.pool.capacity
    rng = random.Random(6)
    ctx = _contexts(6)
    evictions, lengths = 0, [0] * len(ctx)
    for _ in range(25):
        reqs = [ProposeRequest(f"r{i}", list(t), 4, GREEDY, topk=3, max_nodes=12)
                for i, t in enumerate(ctx)]
        props = trees.propose(reqs)
        ones = chain.propose([ProposeRequest(r.request_id, r.token_ids, 1, GREEDY) for r in reqs])
        for i, (r, p, one) in enumerate(zip(reqs, props, ones)):
            a, b = trees.caches[r.request_id], chain.caches[r.request_id]
            assert (a.length, a.num_tokens, a.tree_entries) == (b.length, b.num_tokens, 0)
            assert torch.allclose(a.k[:, : a.length], b.k[:, : b.length], atol=1e-6)
            assert torch.allclose(a.v[:, : a.length], b.v[:, : b.length], atol=1e-6)
            assert p.token_ids[0] == one.token_ids[0]
            evictions += a.length < lengths[i]
            lengths[i] = a.length
            trees.rollback(r.request_id, len(ctx[i]))
            ctx[i] += _random_path(rng, p) + [rng.randrange(128)]
            chain.rollback(r.request_id, len(ctx[i]) - 1)
    assert evictions >= 5 and trees.pool.capacity == capacity
