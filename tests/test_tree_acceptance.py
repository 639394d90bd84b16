"""Tree acceptance: tree shape, greedy paths against brute force, chains against
``accept_drafts``, and chi-square tests that tree sampling is lossless.

The statistical tests run the whole speculative loop (draft a tree, verify it, continue from the
last output token) on the first-order Markov "language model" of ``test_acceptance``, for many
independent rows at once, and compare the empirical joint of the first three generated tokens
with the target's exact joint p(a) p(b | a) p(c | b): the first token follows the target after
the prompt, and each next one the target given the one before, whichever tree node produced it.
They pass for ``accept_tree`` and fail for deliberately wrong samplers: the real module with a
broken step monkeypatched in, and a plain reference sampler with a tree-specific bug switched on.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch
from test_acceptance import C0, V, chi_square, critical_value, exact_joint, markov_tables
from torch import Tensor

from specstream.sampling import logits_to_probs, make_generator, sample
from specstream.sampling_params import SamplingParams
from specstream.spec import tree as tree_mod
from specstream.spec.acceptance import accept_drafts
from specstream.spec.tree import (
    DraftTree,
    accept_tree,
    accept_tree_on_device,
    positions,
    tree_mask,
)

N_OUT = 3  # tokens compared with the exact joint: V**3 = 125 cells
N_ROWS = 20_000

DEFAULT = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
GREEDY = SamplingParams(temperature=0.0)


# ---------------------------------------------------------------------------------------------
# Tree shape

#   root
#   |- 0 (5)
#   |  |- 2 (7)
#   |  '- 3 (8)
#   |     '- 5 (9)
#   '- 1 (6)
#      '- 4 (1)
HAND = DraftTree(tokens=(5, 6, 7, 8, 1, 9), parents=(-1, -1, 0, 0, 1, 3))


def test_tree_structure() -> None:
    assert len(HAND) == 6
    assert HAND.depths == (1, 1, 2, 2, 2, 3)
    assert HAND.depth == 3
    assert [HAND.children(i) for i in range(-1, 6)] == [(0, 1), (2, 3), (4,), (), (5,), (), ()]
    assert HAND.path(-1) == ()
    assert HAND.path(5) == (0, 3, 5)
    assert HAND.path(4) == (1, 4)
    with pytest.raises(IndexError):
        HAND.path(6)
    with pytest.raises(IndexError):
        HAND.children(-2)
    chain = DraftTree.chain([4, 4, 2])
    assert chain == DraftTree((4, 4, 2), (-1, 0, 1))
    assert chain.depths == (1, 2, 3) and chain.path(2) == (0, 1, 2)
    empty = DraftTree.chain([])
    assert len(empty) == 0 and empty.depth == 0 and empty.children(-1) == ()


def test_tree_validation() -> None:
    with pytest.raises(ValueError, match="must come before"):
        DraftTree((1, 2, 3), (-1, 2, 0))  # node 1's parent is node 2
    with pytest.raises(ValueError, match="must come before"):
        DraftTree((1, 2), (-1, 1))  # its own parent
    with pytest.raises(ValueError, match="out of range"):
        DraftTree((1, 2), (-1, 5))
    with pytest.raises(ValueError, match="out of range"):
        DraftTree((1, 2), (-2, 0))
    with pytest.raises(ValueError, match="2 tokens but 1 parents"):
        DraftTree((1, 2), (-1,))
    with pytest.raises(ValueError, match="token"):
        DraftTree((1, -3), (-1, 0))
    with pytest.raises(TypeError, match="tuples"):
        DraftTree([1, 2], [-1, 0])  # type: ignore[arg-type]


def test_tree_mask_and_positions() -> None:
    # rows: query positions [root, 0, 1, 2, 3, 4, 5]; row a sees column b iff b is an ancestor
    # of a or a itself
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0, 0],  # 0
        [1, 0, 1, 0, 0, 0, 0],  # 1
        [1, 1, 0, 1, 0, 0, 0],  # 2 <- 0
        [1, 1, 0, 0, 1, 0, 0],  # 3 <- 0
        [1, 0, 1, 0, 0, 1, 0],  # 4 <- 1
        [1, 1, 0, 0, 1, 0, 1],  # 5 <- 3 <- 0
    ], dtype=torch.bool)
    assert torch.equal(tree_mask(HAND), expected)
    assert torch.equal(positions(HAND, 100), torch.tensor([100, 101, 101, 102, 102, 102, 103]))
    chain = DraftTree.chain([3, 1, 4])
    assert torch.equal(tree_mask(chain), torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(positions(chain, 7), torch.tensor([7, 8, 9, 10]))
    assert torch.equal(tree_mask(DraftTree.chain([])), torch.ones(1, 1, dtype=torch.bool))


def test_rejects_bad_inputs() -> None:
    tree = DraftTree.chain([1, 2])
    logits = torch.randn(3, 4)
    with pytest.raises(ValueError, match="want"):
        accept_tree(torch.randn(4, 4), [tree], None, [DEFAULT])
    with pytest.raises(ValueError, match="want"):
        accept_tree([torch.randn(2, 4)], [tree], None, [DEFAULT])
    with pytest.raises(ValueError, match="vocabulary"):
        accept_tree(logits, [DraftTree.chain([1, 7])], None, [DEFAULT])
    with pytest.raises(ValueError, match="draft_probs"):
        accept_tree(logits, [tree], [torch.rand(2, 4)], [DEFAULT])
    with pytest.raises(ValueError, match="params"):
        accept_tree(logits, [tree], None, [DEFAULT, DEFAULT])
    last, extra = accept_tree_on_device([], [], None, [])
    assert last.shape == extra.shape == (0,)


# ---------------------------------------------------------------------------------------------
# Greedy


def random_tree(rng: random.Random, vocab: int, top: list[int], max_nodes: int = 12) -> DraftTree:
    """A random tree whose tokens often equal the argmax (``top``, by query position) of their
    parent, so that long matching paths and duplicate siblings both occur."""
    tokens: list[int] = []
    parents: list[int] = []
    for i in range(rng.randint(0, max_nodes)):
        par = rng.randint(-1, i - 1) if rng.random() < 0.5 else min(i - 1, rng.randint(-1, 1))
        tok = top[par + 1] if rng.random() < 0.6 else rng.randrange(vocab)
        tokens.append(tok)
        parents.append(par)
    return DraftTree(tuple(tokens), tuple(parents))


def brute_force_greedy(tree: DraftTree, top: list[int]) -> tuple[tuple[int, ...], int]:
    """The longest path whose every token is the argmax at its parent (the lowest node index
    among the longest), and the argmax at its end."""
    best: tuple[int, ...] = ()
    for i in range(len(tree)):
        path = tree.path(i)
        if all(tree.tokens[j] == top[tree.parents[j] + 1] for j in path) and len(path) > len(best):
            best = path
    return best, top[best[-1] + 1 if best else 0]


def test_greedy_is_longest_matching_path() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    vocab = 4
    logits, trees, expected = [], [], []
    walk_checked = 0
    for _ in range(400):
        rows = torch.randn(13, vocab)
        top = rows.argmax(-1).tolist()
        tree = random_tree(rng, vocab, top)
        logits.append(rows[: len(tree) + 1])
        trees.append(tree)
        expected.append(brute_force_greedy(tree, top))
        siblings = [tree.children(i) for i in range(-1, len(tree))]
        if all(len({tree.tokens[c] for c in k}) == len(k) for k in siblings):
            # distinct siblings: the longest path is the walk that follows the argmax child
            node = -1
            while (nxt := [c for c in tree.children(node) if tree.tokens[c] == top[node + 1]]):
                node = nxt[0]
            assert tree.path(node) == expected[-1][0]
            walk_checked += 1
    assert walk_checked > 100
    assert sum(len(path) >= 3 for path, _ in expected) > 40  # the test sees long paths
    params = [GREEDY if b % 2 else SamplingParams(temperature=0.7, top_k=1, seed=b)
              for b in range(len(trees))]
    probs = [torch.softmax(torch.randn(len(t) + 1, vocab), -1) for t in trees]  # ignored
    for dp in (None, probs):
        got = accept_tree(logits, trees, dp, params)
        for tree, v, (path, extra) in zip(trees, got, expected, strict=True):
            assert v.path == path
            assert v.tokens == tuple(tree.tokens[i] for i in path) + (extra,)
            assert v.num_accepted == len(path)


def test_greedy_draws_nothing() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 5)
    state, global_state = gen.get_state(), torch.get_rng_state()
    accept_tree(logits, [DraftTree((1,) * 6, HAND.parents)], None, [GREEDY], [gen])
    assert torch.equal(gen.get_state(), state)
    assert torch.equal(torch.get_rng_state(), global_state)


def random_chains(
    seed: int, bsz: int, q: int, vocab: int, params: Sequence[SamplingParams]
) -> tuple[Tensor, Tensor, list[int], Tensor]:
    """Chain inputs for ``accept_drafts``: logits [B, Q+1, V], drafts [B, Q] matching the argmax
    often, counts, draft probs [B, Q, V]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bsz, q + 1, vocab, generator=g) * 2
    top = logits.argmax(-1)[:, :q]
    noise = torch.randint(0, vocab, (bsz, q), generator=g)
    drafts = torch.where(torch.rand(bsz, q, generator=g) < 0.7, top, noise)
    counts = torch.randint(0, q + 1, (bsz,), generator=g).tolist()
    dprobs = logits_to_probs((torch.randn(bsz * q, vocab, generator=g) + logits[:, :q].reshape(
        -1, vocab)), [p.temperature for p in params for _ in range(q)],
        [p.top_k for p in params for _ in range(q)], [p.top_p for p in params for _ in range(q)])
    return logits, drafts, counts, dprobs.view(bsz, q, vocab)


def chain_outputs(
    logits: Tensor, drafts: Tensor, counts: list[int], dprobs: Tensor | None,
    point: list[bool], params: Sequence[SamplingParams],
) -> list[tuple[int, ...]]:
    """The same batch as chains through ``accept_tree``: draft probs per request (None for the
    point-mass ones), the leaf row NaN to show it is never used; fresh seeded generators."""
    trees = [DraftTree.chain(drafts[b, :n].tolist()) for b, n in enumerate(counts)]
    rows = [logits[b, : n + 1] for b, n in enumerate(counts)]
    probs = None if dprobs is None else [
        None if pm else torch.cat([dprobs[b, :n], torch.full((1, logits.shape[-1]), torch.nan)])
        for b, (n, pm) in enumerate(zip(counts, point, strict=True))]
    gens = [make_generator(p) for p in params]
    return [v.tokens for v in accept_tree(rows, trees, probs, params, gens)]


def test_greedy_chain_equals_accept_drafts() -> None:
    bsz, q, vocab = 300, 5, 6
    params = [GREEDY] * bsz
    logits, drafts, counts, dprobs = random_chains(0, bsz, q, vocab, params)
    want = accept_drafts(logits, drafts, counts, None, params)
    assert 0 < sum(want.num_accepted.tolist()) and max(want.num_accepted.tolist()) == q
    got = chain_outputs(logits, drafts, counts, None, [True] * bsz, params)
    assert got == [tuple(o) for o in want.output_tokens]
    got = chain_outputs(logits, drafts, counts, dprobs, [False] * bsz, params)
    assert got == [tuple(o) for o in want.output_tokens]


def test_seeded_chain_equals_accept_drafts() -> None:
    """Seeded requests draw the same uniforms and exponentials as ``accept_drafts``, so a chain
    gives the very same tokens, in a batch mixing greedy, filtered, model and point-mass rows."""
    bsz, q, vocab = 300, 4, 6
    choices = [DEFAULT, FILTERED, GREEDY, SamplingParams(temperature=1.3, top_p=0.8)]
    params = [SamplingParams(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, seed=b)
              for b, c in enumerate(choices[b % 4] for b in range(bsz))]
    logits, drafts, counts, dprobs = random_chains(1, bsz, q, vocab, params)
    point = [b % 3 == 0 for b in range(bsz)]
    chain_probs = dprobs.clone()
    for b in range(bsz):  # point-mass rows of a mixed chain batch are one-hot
        if point[b]:
            chain_probs[b] = torch.nn.functional.one_hot(drafts[b], vocab).float()
    want = accept_drafts(logits, drafts, counts, chain_probs, params,
                         [make_generator(p) for p in params])
    accepted = want.num_accepted.tolist()
    assert 0 < sum(accepted) < sum(counts)  # both accepted and rejected drafts occur
    got = chain_outputs(logits, drafts, counts, dprobs, point, params)
    assert got == [tuple(o) for o in want.output_tokens]
    # and the seeded requests do not depend on their batch
    alone = [chain_outputs(logits[b : b + 1], drafts[b : b + 1], counts[b : b + 1],
                           dprobs[b : b + 1], point[b : b + 1], params[b : b + 1])[0]
             for b in range(0, bsz, 37)]
    assert alone == got[::37]


# ---------------------------------------------------------------------------------------------
# Sampling: chi-square tests of the whole speculative loop

Verify = Callable[[Tensor, list[DraftTree], Tensor | None, SamplingParams], list[tuple[int, ...]]]


def bfs_parents(branching: Sequence[int]) -> tuple[int, ...]:
    """Parents of a full tree, BFS order: each node at depth d has branching[d] children."""
    parents: list[int] = []
    level = [-1]
    for k in branching:
        nxt = []
        for par in level:
            for _ in range(k):
                nxt.append(len(parents))
                parents.append(par)
        level = nxt
    return tuple(parents)


def draft_trees(
    draft_p: Tensor,  # [V, V] processed draft distribution given the previous token
    ctx: Tensor,  # [B] the root tokens
    parents: tuple[int, ...],
    children: str,  # "iid": sampled from q at the parent; "topk": q's most likely, distinct
) -> Tensor:  # [B, N]
    toks = torch.empty(len(ctx), len(parents), dtype=torch.long)
    rank = [sum(1 for a in parents[:i] if a == par) for i, par in enumerate(parents)]
    for i, par in enumerate(parents):
        q = draft_p[ctx if par < 0 else toks[:, par]]  # [B, V]
        if children == "iid":
            toks[:, i] = sample(q)
        else:
            toks[:, i] = q.sort(dim=-1, descending=True, stable=True).indices[:, rank[i]]
    return toks


def run_trees(
    verify: Verify, params: SamplingParams, branching: Sequence[int], children: str,
    point_mass: bool, seed: int = 0,
) -> Tensor:  # [N_ROWS, N_OUT]
    """The full speculative loop; each round, only the rows still short of N_OUT tokens."""
    torch.manual_seed(seed)
    target, draft = markov_tables(seed=1234)
    draft_p = logits_to_probs(draft, params.temperature, params.top_k, params.top_p)  # [V, V]
    parents = bfs_parents(branching)
    outs: list[list[int]] = [[] for _ in range(N_ROWS)]
    todo = list(range(N_ROWS))
    while todo:
        ctx = torch.tensor([outs[r][-1] if outs[r] else C0 for r in todo])
        toks = draft_trees(draft_p, ctx, parents, children)
        inputs = torch.cat([ctx[:, None], toks], dim=1)  # [b, N+1]: the query positions
        trees = [DraftTree(tuple(row), parents) for row in toks.tolist()]
        dprobs = None if point_mass else draft_p[inputs].reshape(-1, V)
        got = verify(target[inputs].reshape(-1, V), trees, dprobs, params)
        for r, new in zip(todo, got, strict=True):
            outs[r].extend(new)
        todo = [r for r in todo if len(outs[r]) < N_OUT]
    return torch.tensor([o[:N_OUT] for o in outs])


def real_verify(
    logits: Tensor, trees: list[DraftTree], dprobs: Tensor | None, params: SamplingParams,
    seen: Counter[str] | None = None,  # what the verdicts exercised
) -> list[tuple[int, ...]]:
    verdicts = accept_tree(logits, trees, dprobs, [params] * len(trees))
    for tree, v in zip(trees, verdicts, strict=True):
        assert v.path == (tree.path(v.path[-1]) if v.path else ())  # a path of the tree
        assert v.tokens[:-1] == tuple(tree.tokens[i] for i in v.path)
        if seen is not None:
            seen[f"depth {len(v.path)}"] += 1
            # accepted after a rejected sibling: the residual update was in play
            seen["later sibling"] += sum(tree.children(tree.parents[i])[0] != i for i in v.path)
    return [v.tokens for v in verdicts]


def statistic(
    verify: Verify, params: SamplingParams, branching: Sequence[int] = (3, 2),
    children: str = "iid", point_mass: bool = False,
) -> tuple[float, float]:
    target, _ = markov_tables(seed=1234)
    tokens = run_trees(verify, params, branching, children, point_mass)
    cells = (tokens * torch.tensor([V * V, V, 1])).sum(-1)
    counts = torch.bincount(cells, minlength=V**N_OUT).double()
    stat, df = chi_square(counts, exact_joint(target, params))
    return stat, critical_value(df)


CASES = {  # name: (params, branching, children, point_mass)
    "tree-iid-default": (DEFAULT, (3, 2), "iid", False),
    "tree-iid-filtered": (FILTERED, (3, 2), "iid", False),
    "chain-iid-default": (DEFAULT, (1, 1, 1), "iid", False),
    "tree-topk-point-mass": (DEFAULT, (3, 2), "topk", True),
    "tree-topk-point-mass-filtered": (FILTERED, (3, 2), "topk", True),
    "tree-iid-point-mass": (DEFAULT, (2, 2), "iid", True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tree_sampling_matches_target(case: str) -> None:
    params, branching, children, point_mass = CASES[case]
    seen: Counter[str] = Counter()
    verify: Verify = lambda logits, trees, dprobs, params: real_verify(
        logits, trees, dprobs, params, seen)
    stat, crit = statistic(verify, params, branching, children, point_mass)
    assert stat < crit, f"chi2 {stat:.1f} >= critical {crit:.1f}"
    depth = len(branching)
    assert seen[f"depth {depth}"] > 0.05 * N_ROWS, seen  # whole paths get accepted
    if branching[0] > 1:
        assert seen["later sibling"] > 0.05 * N_ROWS, seen


def _accept_all(u: Tensor, p_x: Tensor, q_x: Tensor) -> Tensor:
    return torch.ones_like(u, dtype=torch.bool)


def _recover_from_p(p: Tensor, q: Tensor) -> Tensor:
    return p


@pytest.mark.parametrize(
    "attr,wrong", [("_accept_mask", _accept_all), ("_residual", _recover_from_p)],
    ids=["accept-all", "recover-from-p"],
)
def test_wrong_tree_sampler_is_detected(
    monkeypatch: pytest.MonkeyPatch, attr: str, wrong: object
) -> None:
    monkeypatch.setattr(tree_mod, attr, wrong)
    stat, crit = statistic(real_verify, DEFAULT)
    assert stat > crit, f"wrong sampler passed: chi2 {stat:.1f} <= critical {crit:.1f}"


def _draw(dist: list[float], rng: random.Random) -> int:
    x = rng.random() * sum(dist)
    for tok, w in enumerate(dist):
        if x < w:
            return tok
        x -= w
    return max(range(len(dist)), key=lambda t: dist[t])


def reference_walk(
    tree: DraftTree, p_rows: list[list[float]], q_rows: list[list[float]] | None,
    rng: random.Random, update_siblings: bool, residual_extra: bool,
) -> tuple[int, ...]:
    """Recursive rejection sampling written the plain way, one request at a time; the flags
    switch on two tree-specific bugs."""
    node, out = -1, []
    while True:
        p = cur = res = p_rows[node + 1]  # target; tested against; extra drawn from
        for child in tree.children(node):
            x = tree.tokens[child]
            q = q_rows[node + 1] if q_rows is not None else [float(t == x) for t in range(V)]
            if rng.random() * q[x] < cur[x]:
                node = child
                out.append(x)
                break
            r = [max(0.0, a - b) for a, b in zip(cur, q, strict=True)]
            if sum(r) > 0:
                res = [v / sum(r) for v in r]
                cur = res if update_siblings else cur
        else:
            return (*out, _draw(res if residual_extra else p, rng))


def reference_verify(update_siblings: bool = True, residual_extra: bool = True) -> Verify:
    rng = random.Random(0)

    def verify(
        logits: Tensor, trees: list[DraftTree], dprobs: Tensor | None, params: SamplingParams
    ) -> list[tuple[int, ...]]:
        p = logits_to_probs(logits, params.temperature, params.top_k, params.top_p).tolist()
        q = None if dprobs is None else dprobs.tolist()
        out, at = [], 0
        for t in trees:
            n = len(t) + 1
            out.append(reference_walk(t, p[at : at + n], None if q is None else q[at : at + n],
                                      rng, update_siblings, residual_extra))
            at += n
        return out

    return verify


def test_reference_sampler_matches_target() -> None:
    stat, crit = statistic(reference_verify(), DEFAULT)
    assert stat < crit, f"chi2 {stat:.1f} >= critical {crit:.1f}"


@pytest.mark.parametrize(
    "bug", [{"update_siblings": False}, {"residual_extra": False}],
    ids=["siblings-tested-against-p", "extra-drawn-from-p"],
)
def test_wrong_reference_sampler_is_detected(bug: dict[str, bool]) -> None:
    stat, crit = statistic(reference_verify(**bug), DEFAULT)
    assert stat > crit, f"wrong sampler passed: chi2 {stat:.1f} <= critical {crit:.1f}"

