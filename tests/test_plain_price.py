"""No speculation's price where drafting slows the rounds after it (policy/plain.py): a policy
that drafts measures every round in that state and priced a round without drafts high (the
matrix's c11); settled rounds without drafts, or a stretch of them run to measure, set it."""

from __future__ import annotations

import random

import pytest

from specstream import SamplingParams
from specstream.engine.contract import DraftWork, SeqWork, StepOutput, StepPlan
from specstream.engine.policy.plain import REMEASURE, SETTLE, STRETCH, PlainRounds
from specstream.engine.policy.round_shape import AcceptanceEstimate, RoundCosts, Shape
from specstream.engine.policy.shaping import RoundShaper

GREEDY = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)


def _machine(shaper: RoundShaper, rounds: int, hidden_s: float, per_position_s: float,
             accept: float = 0.6) -> tuple[list[int], float]:
    """One request decoding on a machine where verification takes 5 ms + ``per_position_s``
    a query position, a draft forward 1 ms, and every round within two after a drafting one
    ``hidden_s`` more (the caches the draft's forwards took). The engine's order: the shape
    is chosen before a step, which verifies the last step's drafts and drafts in the new
    shape after. Returns the depths chosen and the seconds a token."""
    rng, picks, drafts, since = random.Random(0), [], 0, 99
    seconds = tokens = 0.0
    for i in range(rounds):
        depth = shaper.shape(1, history_tokens=1024).depth
        picks.append(depth)
        accepted = 0
        while accepted < drafts and rng.random() < accept:
            accepted += 1
        verify_s = 0.005 + per_position_s * (1 + drafts) + (hidden_s if since < 2 else 0.0)
        seq = SeqWork("r", (1,) * (1 + drafts), 1024 + i, drafts, prefill=False, sample=True,
                      host_tokens=0, device_blocks=(), restore_chunks=(), params=GREEDY)
        work = DraftWork("r", (1,) * 8, depth, room=1000, params=GREEDY, after_verify=True)
        out = StepOutput()
        out.new_tokens["r"] = [1] * (accepted + 1)
        if depth:
            out.drafts["r"] = [2] * depth
        plan = StepPlan((seq,), (work,) if depth else ())
        shaper.observe_step(plan, out, 0.0, verify_s, 0.001 * depth, prefill=False)
        seconds, tokens = seconds + verify_s + 0.001 * depth, tokens + accepted + 1
        drafts, since = depth, 0 if depth else since + 1
    return picks, seconds / tokens


def test_the_rounds_after_drafting_less_the_settled_ones_measure_its_surcharge() -> None:
    plain = PlainRounds()
    plain.observe(True, 0.010, 0.008, decision=1)
    assert plain.affected(drafted=False) and plain.affected(drafted=True)
    for k in range(SETTLE):  # right after drafting: slowed by 2 ms over the fit's price
        plain.observe(False, 0.009, 0.007, decision=2 + k)
    assert plain.hidden_s == 0.0 and plain.due(10) and not plain.affected(drafted=False)
    for k in range(STRETCH - SETTLE):  # settled: 0.5 ms over it
        plain.observe(False, 0.0075, 0.007, decision=4 + k)
    assert plain.hidden_s == pytest.approx(0.0015) and plain.measured_at == 3 + STRETCH - SETTLE
    assert not plain.due(10) and plain.due(plain.measured_at + REMEASURE)
    # a run cut short by drafting measures what it has; one with no settled round, nothing
    plain.observe(False, 0.009, 0.007, decision=20)
    plain.observe(True, 0.010, 0.008, decision=21)
    assert plain.hidden_s == pytest.approx(0.0015)
    for k in range(SETTLE + 1):
        plain.observe(False, 0.007, 0.007, decision=22 + k)
    plain.observe(True, 0.010, 0.008, decision=30)  # slowed by nothing: the average falls
    assert plain.hidden_s == pytest.approx(0.7 * 0.0015)
    # what the fit reads: the surcharge off the rounds that carry it
    assert plain.observe(True, 0.010, 0.008, decision=31) == pytest.approx(0.010 - 0.00105)
    assert plain.observe(False, 0.009, 0.008, decision=32) == pytest.approx(0.009 - 0.00105)
    for k in range(SETTLE - 1):
        plain.observe(False, 0.009, 0.008, decision=33 + k)
    assert plain.observe(False, 0.007, 0.008, decision=40) == 0.007


def test_a_stretch_runs_only_where_the_choice_could_flip() -> None:
    acc = AcceptanceEstimate(prior=(0.6, 0.15, 0.04, 0.01))
    # a chain of 2 at 0.6 a token: 1.96 tokens in 11 ms against one in 6 ms, 7% ahead
    close = RoundCosts(verify_base_s=0.005, verify_per_position_s=0.001, draft_level_s=0.0015)
    plain = PlainRounds()
    assert plain.measure_now(Shape(2), 1, close, acc, "sequential", decision=10)
    assert [plain.take() for _ in range(STRETCH)] == [True] * (STRETCH - 1) + [False]
    assert not plain.measure_now(Shape(2), 1, close, acc, "sequential", decision=11)  # not due
    # drafting far ahead (a cheap draft, verification nearly free a position): no stretch
    clear = RoundCosts(verify_base_s=0.005, verify_per_position_s=0.00001, draft_level_s=0.0001)
    fresh = PlainRounds()
    assert not fresh.measure_now(Shape(2), 1, clear, acc, "sequential", decision=10)
    # link-bound and drafting in its gaps: what drafting leaves is hidden
    linked = RoundCosts(link_s=0.050, verify_base_s=0.005, verify_per_position_s=0.0005,
                        draft_level_s=0.001)
    assert not fresh.measure_now(Shape(2), 1, linked, acc, "gaps", decision=10)
    assert fresh.left == 0


def test_a_cost_drafting_leaves_behind_is_measured_and_no_speculation_chosen() -> None:
    """Drafting costs 3 ms in the rounds after it: a chain of 2 gives 1.96 tokens in 11.5 ms
    (5.9 ms a token) against 5.5 ms for a round without drafts. Priced on drafting rounds
    only, no speculation read 8.5 ms and the policy drafted; a stretch without drafts
    measures it and the choice turns to no speculation. (Drafting, priced on the rounds
    without drafts, then reads cheap again now and then: a round or two of depth 1 teach
    the fit otherwise.)"""
    control = RoundShaper(max_depth=4, drafting="sequential")
    control.prior_position(0.0005)
    control.plain.due = lambda decision: False  # type: ignore[method-assign]  # no stretch
    picks, control_s = _machine(control, 120, hidden_s=0.003, per_position_s=0.0005)
    assert picks[60:].count(0) == 0, picks  # the fit alone never sees it
    shaper = RoundShaper(max_depth=4, drafting="sequential")
    shaper.prior_position(0.0005)
    picks, token_s = _machine(shaper, 120, hidden_s=0.003, per_position_s=0.0005)
    assert shaper.plain.measured_at is not None
    late = picks[60:]
    assert late.count(0) >= 0.75 * len(late), picks
    assert token_s < 0.97 * control_s


def test_where_drafting_clearly_pays_no_stretch_runs() -> None:
    """Cheap query positions, no hidden cost: drafting wins by far more than any cost it could
    leave behind, so the policy never stops drafting to measure."""
    shaper = RoundShaper(max_depth=4, drafting="sequential")
    shaper.prior_position(0.0001)
    picks, _ = _machine(shaper, 120, hidden_s=0.0, per_position_s=0.0001, accept=0.8)
    assert 0 not in picks[1:], picks
    assert shaper.plain.measured_at is None


def test_a_stretch_that_finds_no_hidden_cost_leaves_the_choice_to_drafting() -> None:
    """A close call (drafting pays about 10%): the stretch runs once, finds rounds without
    drafts cost what the fit says, and the policy drafts again until it is due again."""
    shaper = RoundShaper(max_depth=4, drafting="sequential")
    shaper.prior_position(0.001)
    picks, _ = _machine(shaper, 120, hidden_s=0.0, per_position_s=0.001, accept=0.7)
    assert shaper.plain.measured_at is not None
    assert shaper.plain.hidden_s < 0.0002
    late = picks[40:]
    assert late.count(0) <= 0.1 * len(late), picks
