"""Tree sampling is lossless: chi-square tests of the whole speculative loop (draft a tree,
verify it, continue from the last output token) on the first-order Markov "language model" of
``test_acceptance``; they pass for ``accept_tree`` and fail for deliberately wrong samplers (the
real module with a broken step monkeypatched in, and a plain reference sampler with a
tree-specific bug switched on). See ``test_tree_acceptance.py``'s docstring for the method.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch
from test_acceptance import C0, V, joint_statistic, markov_tables
from test_tree_acceptance import DEFAULT, FILTERED, N_OUT, N_ROWS
from torch import Tensor

from specstream.sampling import logits_to_probs, sample
from specstream.sampling_params import SamplingParams
from specstream.spec import tree as tree_mod
from specstream.spec.tree import DraftTree, accept_tree

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
    return joint_statistic(run_trees(verify, params, branching, children, point_mass), target,
                           params)


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
    "attr,wrong", [("accept_mask", _accept_all), ("residual", _recover_from_p)],
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

