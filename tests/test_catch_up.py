"""Drafting's one-off cost: the draft catching up on the tokens it has not seen, charged so
that the round-shape policy drafts exactly where drafting shortens a request's remaining life
(``policy/round_shape.py``, ``sched/drafts.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specstream.config import EngineConfig
from specstream.engine.policy.round_shape import (
    AcceptanceEstimate,
    RoundCosts,
    Shape,
    choose,
    expected_tokens,
)
from specstream.engine.policy.shaping import RoundShaper
from specstream.engine.request import Request
from specstream.engine.sched.drafts import DraftPlanner
from specstream.options import Drafting
from specstream.sampling_params import SamplingParams

CATCH_UP_TOKEN_S = 1e-4  # the draft's time per token it catches up on
VERIFY_S, PER_POSITION_S, DRAFT_LEVEL_S = 0.008, 0.0005, 0.002


def _life_s(shape: Shape, acc: AcceptanceEstimate, room: int, unseen: int) -> float:
    """A lone request's remaining life, written the plain way: with no drafts, ``room``
    rounds of one position; drafting, the catching up once, then room / E rounds."""
    rounds = room / expected_tokens(shape, acc)
    verify = VERIFY_S + PER_POSITION_S * (1 + shape.num_nodes)
    if not shape.depth:
        return room * verify
    return CATCH_UP_TOKEN_S * unseen + rounds * (verify + DRAFT_LEVEL_S * shape.depth)


@pytest.mark.parametrize("unseen", [0, 100, 300, 600, 900, 1200, 2000])
def test_the_policy_drafts_exactly_where_drafting_shortens_the_requests_life(unseen):
    """One request, 32 tokens to go, a draft that has not seen ``unseen`` of them: the
    policy's choice between no drafts and a chain of 2 is the one with the shorter life.
    (Charged per token of room rather than per token a round gives, the catching up let it
    draft at 900 and 1,200 tokens here, where the life is longer drafting.)"""
    acc = AcceptanceEstimate(prior=(0.7, 0.2, 0.05, 0.01))
    room = 32
    costs = RoundCosts(verify_base_s=VERIFY_S, verify_per_position_s=PER_POSITION_S,
                       draft_level_s=DRAFT_LEVEL_S,
                       draft_setup_s=CATCH_UP_TOKEN_S * unseen / room)
    candidates = [Shape(0), Shape(2)]
    pick = choose(candidates, 1, costs, acc, "sequential")
    best = min(candidates, key=lambda s: _life_s(s, acc, room, unseen))
    assert pick == best


def test_the_boundary_of_the_test_above_lies_inside_its_range():
    """The parametrised catch-ups straddle the break-even (the test above can fail)."""
    acc = AcceptanceEstimate(prior=(0.7, 0.2, 0.05, 0.01))
    lives = {u: _life_s(Shape(2), acc, 32, u) < _life_s(Shape(0), acc, 32, u)
             for u in (0, 2000)}
    assert lives == {0: True, 2000: False}


class Recording(RoundShaper):
    """The policy as the planner asks it: records the catch-up share it was given."""

    def __init__(self) -> None:
        super().__init__(max_depth=4, drafting="sequential")
        self.asked: list[tuple[int, float]] = []

    def shape(self, num_requests, catch_up=0.0, history_tokens=None):
        self.asked.append((num_requests, catch_up))
        return Shape(0)


def test_a_prompt_counts_its_catching_up_at_the_step_of_its_last_chunk():
    """A request drafts right after its last prefill chunk, in the shape chosen for that step,
    so its catching up (its prompt, up to the draft's window) counts in that choice; a prompt
    with chunks to go after this step is decided at the step of its last, and a later prompt
    the step's prefill budget does not reach is not counted yet."""
    cfg = EngineConfig(proposer="draft", draft_model="d", draft_cache="full",
                       max_prefill_tokens=1024)
    shaper = Recording()
    planner = DraftPlanner(cfg, shaper, max_model_len=8192)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    last = Request("p", list(range(1, 1001)), params)  # 1,000 tokens: one chunk
    later = Request("q", list(range(1, 801)), params)  # the 24 tokens left do not reach it
    assert last.in_prefill and later.in_prefill
    planner.choose_shape([last, later], two_groups=False)
    assert shaper.asked == [(0, pytest.approx(1000 / 32))]
    long = Request("r", list(range(1, 3001)), params)  # three chunks: not this step
    planner.choose_shape([long], two_groups=False)
    assert shaper.asked[-1] == (0, 0.0)


def test_expected_tokens_follow_every_observation():
    """The expected tokens a decision reads are kept until the next observation (rounds
    without drafts observe nothing, and a decision prices ~40 shapes): each answer equals a
    fresh estimate's with the same observations, before and after one."""
    shapes = [Shape(4), Shape(8), Shape(4, topk=4, nodes=16), Shape(8, topk=2, nodes=32)]
    kept, history = AcceptanceEstimate(), []
    for drafts, accepted in [(4, 4), (4, 0), (8, 3), (2, 2)]:
        fresh = AcceptanceEstimate()
        for d, a in history:
            fresh.observe_chain(d, a)
        for s in shapes:
            assert expected_tokens(s, kept) == pytest.approx(expected_tokens(s, fresh),
                                                             rel=1e-12)
        kept.observe_chain(drafts, accepted)
        history.append((drafts, accepted))
    assert expected_tokens(Shape(4), kept) != expected_tokens(Shape(4), AcceptanceEstimate())


def test_everyones_catching_up_is_decided_on_the_rounds_not_on_the_prior():
    """Prompts of random ids (the matrix's c12 at 128 tokens a request), link-bound rounds
    (30 ms on the link, 12-16 ms of verification): the prior (0.6 a token) says drafting
    pays for every request's catching up; the probe's request, caught up already, misses
    every draft. Until its rounds are as many observations as the prior is worth, the shape
    stays its probe; then they decide alone: no speculation, where the prior-weighted
    estimate (0.29 after eight misses) would still have everyone catch up; with less than a
    room to catch up, the misses reject the prior's rate and the data decide too. Where the rounds
    match three drafts in four, everyone drafts. Where the draft runs in the link's gaps
    (``specstream``), the link hides that catching up and the prior decides as before."""
    for outcomes, drafts, drafting in ((((2, 0),), False, "sequential"),
                                       (((2, 2), (2, 1)), True, "sequential"),
                                       (((2, 0),), True, Drafting.GAPS)):
        shaper = RoundShaper(max_depth=4, drafting=drafting)
        shaper.catch_up.prior(0.0001)  # 0.1 ms a token
        for _ in range(60):  # the costs, at 0.7 a token (that acceptance is reset below)
            q = shaper.shape(4).depth
            shaper.observe(0.030, 0.010 + 0.0005 * 4 * (q + 1), 4 * (q + 1), [4] * q,
                           0.001 * q, [(q, min(q, round(0.7 + 0.49 * (q > 1))))] * 4)
        shaper.acceptance = replace(shaper.acceptance, hits=[], tries=[], depth_hits=[],
                                    depth_tries=[], _memo={}, _expected={})
        first = shaper.shape(4, catch_up=1.0)
        if drafting is Drafting.GAPS:
            assert first.depth > 0 and not shaper.probing
            continue
        assert first == Shape(2) and shaper.probing
        while shaper.acceptance.observed() < shaper.prior_weight:
            for drafted, accepted in outcomes:
                shaper.acceptance.observe_chain(drafted, accepted)
        pick = shaper.shape(4, catch_up=1.0)
        assert not shaper.probing and (pick.depth > 0) == drafts, pick
        prior_led = choose(shaper.candidates, 4, shaper.costs(1.0), shaper.acceptance)
        assert prior_led.depth > 0  # what the prior-weighted estimate would have done
        # less than a room: the estimate decides, and eight misses in a row reject the prior's
        # rate (below_rate), so the data decide there too; three hits in four do not
        assert (shaper.shape(4, catch_up=0.5).depth > 0) == drafts
