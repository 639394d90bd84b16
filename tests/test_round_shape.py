"""The round-shape cost model: expected tokens of chains and trees, and the choice it makes in
link-bound, compute-bound and drafting-does-not-pay regimes."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from specstream.engine.policy.round_shape import (
    AcceptanceEstimate,
    RoundCosts,
    Shape,
    choose,
    expected_tokens,
)

CHAINS = [Shape(0), *(Shape(q) for q in (1, 2, 4, 6, 8, 16))]


def _acc(*betas: float) -> AcceptanceEstimate:
    """Acceptance known exactly (no prior weight)."""
    return AcceptanceEstimate(prior=betas, prior_weight=1e-9, decay=1.0)


def test_chain_expectation_is_the_geometric_sum():
    acc = _acc(0.75)
    assert expected_tokens(Shape(0), acc) == 1.0
    assert expected_tokens(Shape(4), acc) == pytest.approx(1 + 0.75 + 0.75**2 + 0.75**3 + 0.75**4)
    # the figures: q = 4, 8, 16 at 0.75 accept 3.05, 3.70, 3.97 tokens per round
    assert [round(expected_tokens(Shape(q), acc) - 1, 2) for q in (4, 8, 16)] == [
        2.05, 2.70, 2.97]


def test_tree_expectation_equals_brute_force_best_tree():
    """The greedy tree is the best one: every tree of the budget (enumerated) does no better,
    and its value is the sum of its nodes' path probabilities."""
    acc = _acc(0.6, 0.2, 0.1)
    betas = [0.6, 0.2, 0.1]

    def all_trees(budget, depth):  # nodes as rank paths; a node needs its parent
        paths = [p for d in range(1, depth + 1) for p in itertools.product(range(3), repeat=d)]
        for nodes in itertools.combinations(paths, budget):
            s = set(nodes)
            if all(len(p) == 1 or p[:-1] in s for p in nodes):
                yield nodes

    def value(nodes):
        total = 1.0
        for p in nodes:
            v = 1.0
            for r in p:
                v *= betas[r]
            total += v
        return total

    for budget, depth in ((3, 2), (4, 3), (5, 3)):
        best = max(value(t) for t in all_trees(budget, depth))
        got = expected_tokens(Shape(depth, topk=3, nodes=budget), acc)
        assert got == pytest.approx(best)
    # a tree of one child per node is the chain
    assert expected_tokens(Shape(4, topk=2, nodes=4), _acc(0.7, 0.0)) == pytest.approx(
        expected_tokens(Shape(4), _acc(0.7)))


def test_acceptance_estimate_learns_from_rounds():
    rng = random.Random(0)
    acc = AcceptanceEstimate(prior=(0.6, 0.1), prior_weight=20, decay=0.999)
    for _ in range(3000):  # chains whose drafts each pass with probability 0.3
        n = 0
        while n < 4 and rng.random() < 0.3:
            n += 1
        acc.observe_chain(4, n)
    assert acc.beta(0) == pytest.approx(0.3, abs=0.04)
    acc.observe(3, 1)  # a tree node whose second candidate matched
    assert acc.beta(1) > 0.1


def test_choice_follows_the_regime():
    acc = _acc(0.75)
    # link-bound (a round is mostly link, verification cheap per position): verify long chains
    link = RoundCosts(link_s=0.76, verify_base_s=0.005, verify_per_position_s=0.0002,
                      draft_level_s=0.004, draft_per_node_s=0.0001)
    assert choose(CHAINS, 8, link, acc, "gaps").depth >= 8
    # compute-bound, each position cheap next to the step (a GPU reading its weights): a
    # short chain (q = 2 and 4 give 373 and 374 tokens/s here, q = 8 307, none 235)
    compute = RoundCosts(link_s=0.0, verify_base_s=0.03, verify_per_position_s=0.0005,
                         draft_level_s=0.003, draft_per_node_s=0.0001)
    assert 2 <= choose(CHAINS, 8, compute, acc, "sequential").depth <= 4
    # ... and where every position costs as much as the step, none
    heavy = RoundCosts(link_s=0.0, verify_base_s=0.01, verify_per_position_s=0.004,
                       draft_level_s=0.012, draft_per_node_s=0.001)
    assert choose(CHAINS, 8, heavy, acc, "sequential") == Shape(0)
    # drafting does not pay (a draft step costs as much as a target step, weak acceptance)
    costly = RoundCosts(link_s=0.0, verify_base_s=0.01, verify_per_position_s=0.0005,
                        draft_level_s=0.01, draft_per_node_s=0.0005)
    assert choose(CHAINS, 1, costly, _acc(0.2), "sequential") == Shape(0)
    # trees beat chains where verification is nearly free and acceptance is spread over ranks
    trees = CHAINS + [Shape(6, topk=4, nodes=n) for n in (16, 32, 64)]
    pick = choose(trees, 8, link, _acc(0.55, 0.2, 0.08, 0.04), "gaps")
    assert pick.topk > 1


def test_shape_validation():
    with pytest.raises(ValueError):
        Shape(-1)
    with pytest.raises(ValueError):
        Shape(3, topk=1, nodes=5)


def _depth_chains(acc: AcceptanceEstimate, rates: tuple[float, ...], rounds: int) -> None:
    """Chains of len(rates) drafts whose draft at depth d passes with rates[d - 1]."""
    rng = random.Random(1)
    for _ in range(rounds):
        n = 0
        while n < len(rates) and rng.random() < rates[n]:
            n += 1
        acc.observe_chain(len(rates), n)


def test_acceptance_is_learnt_by_depth():
    """Drafts that pass 0.5 of the time right after the sampled token and 0.9 once on a
    matched path: each depth's estimate finds its own rate, and a depth-4 chain's expected
    tokens are the product of them, where the pooled rate (which mixes the depths) is more
    than 10% off."""
    rates = (0.5, 0.9, 0.9, 0.9)
    acc = AcceptanceEstimate(prior=(0.6, 0.1), prior_weight=20, decay=0.999)
    _depth_chains(acc, rates, 4000)
    assert acc.beta(0, 1) == pytest.approx(0.5, abs=0.04)
    assert acc.beta(0, 3) == pytest.approx(0.9, abs=0.04)
    true = 1 + sum(math.prod(rates[:d]) for d in range(1, 5))
    assert expected_tokens(Shape(4), acc) == pytest.approx(true, rel=0.05)
    pooled = 1 + sum(acc.beta(0) ** d for d in range(1, 5))
    assert abs(pooled - true) > 0.1 * true
    # a tree at depth 3: its other ranks share what the first candidate leaves
    acc.observe_walk([(2, 1), (2, 0), (2, None)])
    for d in (1, 2, 3):
        assert acc.beta(0, d) + acc.beta(1, d) <= 1.0


def test_unobserved_depths_read_the_pooled_estimate():
    """No depth seen (the simulator's estimates are priors only): every depth is the pooled
    figure and the chain is the geometric sum, as before acceptance was kept by depth."""
    acc = AcceptanceEstimate(prior=(0.7, 0.2))
    assert [acc.beta(r, d) for r in (0, 1) for d in (1, 5)] == [0.7, 0.7, 0.2, 0.2]
    assert expected_tokens(Shape(3), acc) == pytest.approx(1 + 0.7 + 0.49 + 0.343)
    acc.observe_chain(2, 2)  # depths 1 and 2 seen; 3 and deeper read the pooled one
    assert acc.beta(0, 3) == acc.beta(0)
