"""Verification priced per request and per query position apart (issue 30, item 4).

A compute-bound long-context round reads each request's history once however many query
positions attend it; a line over query positions alone, fitted on rounds that differ in request
count and not in depth, charges that read to every position and turns speculation off where it
pays. The plane fit separates the two where the rounds do, and prices a position at the
target's prefill time per token where they do not.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from specstream.engine.policy.estimators import LineFit, PlaneFit
from specstream.engine.policy.round_shape import RoundCosts, Shape, choose
from specstream.engine.policy.shaping import RoundShaper

# the true round: 2 ms fixed, 6 ms per request (its history), 0.2 ms per query position
A, PER_REQUEST, PER_POSITION = 0.002, 0.006, 0.0002


def verify_s(requests: int, positions: int) -> float:
    return A + PER_REQUEST * requests + PER_POSITION * positions


def test_rounds_that_differ_in_depth_give_every_part_its_price() -> None:
    fit = PlaneFit(prior_b2=3 * PER_POSITION)  # a prior off 3x: the points outweigh it
    for requests in (8, 6, 4, 7):
        for depth in (0, 2, 4):
            positions = requests * (1 + depth)
            fit.add(requests, positions, verify_s(requests, positions))
    a, b1, b2 = fit.coef()
    assert a == pytest.approx(A, rel=0.05)
    assert b1 == pytest.approx(PER_REQUEST, rel=0.02)
    assert b2 == pytest.approx(PER_POSITION, rel=0.05)


def test_rounds_that_differ_only_in_request_count_price_a_position_at_the_prior() -> None:
    fit = PlaneFit(prior_b2=PER_POSITION * 1.5)
    for requests in (8, 6, 4, 7, 5):  # all at depth 4: positions move with requests
        fit.add(requests, requests * 5, verify_s(requests, requests * 5))
    a, b1, b2 = fit.coef()
    assert b2 == pytest.approx(PER_POSITION * 1.5, rel=0.01)
    # the rest of the slope is the requests': the rounds seen are still predicted exactly
    for requests in (8, 4):
        assert a + b1 * requests + b2 * requests * 5 == pytest.approx(
            verify_s(requests, requests * 5), rel=0.01)


def test_without_a_prior_collinear_rounds_read_as_all_positions_and_one_point_fits() -> None:
    fit = PlaneFit()
    for requests in (8, 4):
        fit.add(requests, requests * 5, verify_s(requests, requests * 5))
    a, b1, b2 = fit.coef()
    assert b1 == 0.0 and b2 > 0
    assert a + b2 * 40 == pytest.approx(verify_s(8, 40))
    one = PlaneFit(prior_b2=PER_POSITION)
    one.add(8, 40, verify_s(8, 40))
    a, b1, b2 = one.coef()
    assert b2 == PER_POSITION and a + b1 * 8 + b2 * 40 == pytest.approx(verify_s(8, 40))
    assert PlaneFit().coef() == (0.0, 0.0, 0.0)


def test_the_request_price_keeps_speculation_on_where_a_position_line_turns_it_off() -> None:
    """The case of the issue: compute-bound rounds of 8 x 4K (no link), depth 4 every round,
    request counts varying as requests finish. A line over positions prices a position at
    (per-request + 5 x per-position) / 5 and finds no speculation best; the plane, with the
    prefill prior, keeps drafting."""
    rounds = [(r, r * 5) for r in (8, 8, 7, 6, 6, 5, 4)]
    line, plane = LineFit(), PlaneFit(prior_b2=PER_POSITION)
    for requests, positions in rounds:
        line.add(positions, verify_s(requests, positions))
        plane.add(requests, positions, verify_s(requests, positions))
    shaper = RoundShaper(4, "sequential")
    acc = shaper.acceptance  # the prior: 0.6 per token
    draft = dict(draft_level_s=0.0015, draft_per_node_s=0.0001)
    la, lb = line.coef()
    by_line = choose(shaper.candidates, 8, RoundCosts(verify_base_s=la, verify_per_position_s=lb,
                                                      **draft), acc)
    pa, pr, pb = plane.coef()
    by_plane = choose(shaper.candidates, 8, RoundCosts(
        verify_base_s=pa, verify_per_request_s=pr, verify_per_position_s=pb, **draft), acc)
    truth = choose(shaper.candidates, 8, RoundCosts(
        verify_base_s=A, verify_per_request_s=PER_REQUEST, verify_per_position_s=PER_POSITION,
        **draft), acc)
    assert by_line == Shape(0)
    assert by_plane == truth and truth.depth >= 2


def test_the_shaper_learns_the_prior_from_prefill_and_fits_verified_requests() -> None:
    shaper = RoundShaper(4, "sequential")
    shaper.prior_position(PER_POSITION)
    for requests in (8, 6, 4):
        shaper.observe(0.0, verify_s(requests, requests * 5), requests * 5, [], 0.0,
                       [(4, 2)] * requests)
    costs = shaper.costs()
    assert costs.verify_per_position_s == pytest.approx(PER_POSITION, rel=0.01)
    assert costs.verify_per_request_s == pytest.approx(PER_REQUEST, rel=0.05)


@pytest.mark.parametrize("prior", [None, PER_POSITION])
@pytest.mark.parametrize("requests", [1, 3, 0.7])
def test_a_constant_request_count_prices_no_request_and_stays_finite(prior, requests) -> None:
    """One request at a time (or always the same number): the request count has no spread,
    but the decayed sums leave a rounding residue in its variance (1e-15, not 0). Solved as if
    it were spread, that residue priced a request at ~1e13 s, every round the same ~1e16 s, and
    the policy picked the shape with the most tokens whatever it cost (32-node trees on a
    compute-bound CPU). The fit must see no spread and price depth from the points."""
    rng = random.Random(1)
    fit = PlaneFit(prior_b2=prior)
    for i in range(100):
        positions = requests * (1 + rng.choice((1, 2, 4, 32)))
        fit.add(requests, positions, 0.012 + PER_POSITION * positions + rng.gauss(0, 1e-4))
        a, b1, b2 = fit.coef()
        assert b1 < 1.0, (i, b1)  # seconds a request: the residue's price was ~1e13
    assert b2 == pytest.approx(PER_POSITION, rel=0.1)
    assert a + b1 * requests == pytest.approx(0.012, rel=0.05)


def test_verification_is_priced_per_token_of_history_read() -> None:
    """The matrix's 6K x 2 cell: the first rounds verify one request at a short context (a
    probe before the long prefill), then two requests at 6K with depths 1 to 16, then one at
    6K. Over request counts, the cheap short-context round reads as a cheap request and the
    fit put every query position at nothing, so drafting looked free. Over history tokens
    read, the same rounds give each part its price, and the next round's per-request price is
    the history it will read."""
    per_token, per_position, base = 7e-6, 4e-3, 2e-3

    def t(contexts: tuple[int, ...], depth: int) -> float:
        return base + per_token * sum(contexts) + per_position * len(contexts) * (1 + depth)

    shaper = RoundShaper(8, "sequential")
    rounds = [((40,), 2), ((41,), 1)] + [((6144 + i, 6150 + i), d) for i, d in
                                         enumerate((1, 4, 8, 8, 2, 8, 1, 8, 8))]
    rounds += [((6200 + i,), d) for i, d in enumerate((8, 1, 1, 2, 1))]
    for contexts, depth in rounds:
        shaper.observe(0.0, t(contexts, depth), len(contexts) * (1 + depth), [], 0.0,
                       [(depth, 0)] * len(contexts), num_requests=len(contexts),
                       history_tokens=sum(contexts))
    _, _, b2 = shaper.verify.coef()
    assert b2 == pytest.approx(per_position, rel=0.05)
    shaper.shape(2, history_tokens=2 * 6300)
    costs = shaper.costs()
    assert costs.verify_per_request_s == pytest.approx(per_token * 6300, rel=0.05)
    for depth in (0, 4):
        assert costs.round_s(Shape(depth), 2, "sequential") == pytest.approx(
            t((6300, 6300), depth), rel=0.03)


def test_a_sliver_of_spread_is_no_spread() -> None:
    """The 6K x 2 cell's first rounds: one request verified at 64 then 65 tokens of history,
    a timing jitter of 1.4 ms between them. Read as spread, that jitter priced 1K tokens of
    history at ~1.4 s, and the 6K rounds after it at seconds each."""
    shaper = RoundShaper(8, "sequential")
    shaper.prior_position(0.002)  # the warm-up request's prefill, per token
    for history, positions, seconds in ((64, 3, 0.0184), (65, 2, 0.0170)):
        shaper.observe(0.0, seconds, positions, [], 0.0, [(positions - 1, 0)],
                       num_requests=1, history_tokens=history)
    _, b1, _ = shaper.verify.coef()
    assert b1 == 0.0
    shaper.shape(2, history_tokens=2 * 6144)
    assert shaper.costs().round_s(Shape(1), 2, "sequential") < 0.1


def test_near_collinear_rounds_whose_noise_reads_a_negative_position_price_take_the_prior() -> None:
    """Requests verified at one depth (c01 during its prefills: q0 rounds of 3 to 7 requests):
    query positions are the request count and the history nearly so, a few tokens apart a
    request. Timing noise that follows the jitter solved to a negative price a position; it
    was clamped to 0 and the shaper took 32-node trees in compute-bound rounds. The position
    is the prior's there, and the rest of the slope the history's."""
    prior = 1.4e-3
    fit = PlaneFit(prior_b2=prior)
    for requests, jitter in ((3, 0.1), (4, -0.1), (7, 0.05), (5, -0.05), (6, 0.1), (4, 0.1)):
        history = requests + jitter  # units of history: the requests' prompts, nearly equal
        # 6.4 ms a request in all, and 8 ms per unit of the jitter (the noise that follows it)
        fit.add(history, requests, 0.010 + 0.0064 * requests + 0.008 * jitter)
    a, b1, b2 = fit.coef()
    assert b2 == pytest.approx(prior, rel=0.05)
    assert b1 == pytest.approx(0.0064 - prior, rel=0.35)
    # a tree of 32 nodes is priced for its positions: far dearer than a chain of 4
    costs = RoundCosts(verify_base_s=a, verify_per_request_s=b1, verify_per_position_s=b2)
    assert costs.round_s(Shape(4, 4, 32), 4, "gaps") > 3 * costs.round_s(Shape(4), 4, "gaps")
    # where positions moved on their own (other depths), the points' own reading stands
    free = PlaneFit(prior_b2=prior)
    for requests in (3, 5, 7):
        for depth in (0, 2, 4):
            free.add(requests, requests * (1 + depth), 0.010 + 0.006 * requests)
    # (the prior, worth 8 points a position from the rest, draws it a sliver toward itself)
    assert free.coef()[2] < 0.03 * prior


def test_one_round_of_more_positions_does_not_read_a_position_as_free() -> None:
    """The matrix's c03 (one request a round, no speculation chosen): rounds of 1 query
    position, and among them one exploration of 2 that happened to run 3 ms faster than the
    rounds around it. That point was x2's only spread, its noise read a position at nothing,
    and the next decision took a 32-node tree (33 positions: 45 ms, not the 12 ms priced).
    The prior counts as a few points: the price stays near it until rounds of other depths
    outweigh them."""
    rng = random.Random(3)
    prior = 5e-4
    fit = PlaneFit(prior_b2=prior)
    history = 1.0
    for i in range(66):
        history += 1 / 1024
        positions, noise = (2, -0.003) if i == 60 else (1, rng.gauss(0, 1e-3))
        fit.add(history, positions, 0.012 + 0.001 * (positions - 1) + noise)
    assert fit.coef()[2] > 0.4 * prior
    # and where rounds of other depths came, their reading (1 ms a position) stands
    for q in (4, 1, 2, 8, 0, 3) * 3:
        fit.add(history, 1 + q, 0.012 + 0.001 * q + rng.gauss(0, 1e-3))
    assert fit.coef()[2] == pytest.approx(0.001, rel=0.2)


def test_no_round_is_priced_below_its_positions_at_the_compute_bound_prefill_rate() -> None:
    """A roofline: rounds of five requests with 5 or 9 query positions took the same time
    (memory-bound: a forward of a few tokens reads the weights once), so the fit priced a
    position at nothing and a tree of 32 nodes for each of the five (165 positions) as free;
    its prefill of 1,024-token chunks says 165 tokens take 66 ms. Short chunks (memory-bound
    too) set no floor."""
    shaper = RoundShaper(8, "sequential", max_topk=4, max_nodes=32)
    for positions in (5, 9, 5, 9, 5, 9):
        shaper.observe(0.0, 0.025, positions, [5.0], 0.001, [(4, 2)] * 5, num_requests=5)
    tree = Shape(4, topk=4, nodes=32)
    free = shaper.costs().round_s(tree, 5, "sequential")
    assert free < 0.03  # the fit alone: 165 positions for the price of five (and 4 ms drafts)
    shaper.prior_position(0.0004, 1024)
    costs = shaper.costs()
    assert costs.verify_floor_per_position_s == pytest.approx(0.0004)
    assert costs.round_s(tree, 5, "sequential") >= 165 * 0.0004
    # rounds of few positions keep the fit's price: the floor binds only past it
    assert costs.round_s(Shape(0), 5, "sequential") == pytest.approx(
        replace(costs, verify_floor_per_position_s=0.0).round_s(Shape(0), 5, "sequential"))
    short = RoundShaper(8, "sequential")
    short.prior_position(0.002, 16)  # a last chunk of 16 tokens, memory-bound: no floor
    assert short.costs().verify_floor_per_position_s == 0.0


def test_rounds_that_drop_requests_and_stalls_together_leave_a_position_its_price() -> None:
    """The matrix's c01 as requests finish: rounds of 7 requests ran slower than the line
    through the rounds of 5 after them (here: 15 ms more, as if they stalled). Across the
    drop, the history's slope reads that too, and the line through the points' mean leaves
    a negative fixed part. Capping the position's price to make up for it priced a position
    at nothing (decisions 54-70 of a traced run), and a chain of 4 for five requests read as
    free. The history's slope is the one read across the change of regime: it gives way
    first."""
    rng = random.Random(7)
    prior = 3.6e-4

    def machine(history: float, positions: int) -> float:
        return 0.007 + 0.0032 * history + 0.001 * positions

    fit = PlaneFit(prior_b2=prior)
    for i in range(30):  # 7 requests a round, 1K of history each, 15 ms of link stalls
        positions = 4 if i % 10 == 3 else 7  # a probe now and then: 4 positions for 1 request
        history = 1.0 if positions == 4 else 7.0
        stall = 0.0 if positions == 4 else 0.015
        fit.add(history, positions, machine(history, positions) + stall + rng.gauss(0, 3e-4))
    for _ in range(20):  # requests finish: 5 a round, everything on the device
        fit.add(5.0, 5, machine(5.0, 5) + rng.gauss(0, 3e-4))
    a, b1, b2 = fit.coef()
    assert a >= 0.0
    assert b2 > 0.5 * 0.001  # measured at 1 ms a position; the cap read 0
    # and the plain round of five requests is priced near the rounds just seen (the fit
    # still carries the stalls of the rounds before, fading)
    assert a + 5 * b1 + 5 * b2 == pytest.approx(machine(5.0, 5), rel=0.15)
