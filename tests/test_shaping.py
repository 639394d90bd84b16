"""speculative_policy = "auto": the engine picks each round's chain depth from what it measures;
outputs stay exact whatever it picks."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import capture_plans

from specstream import LLM, SamplingParams
from specstream.config import EngineConfig
from specstream.engine.llm_engine import LLMEngine
from specstream.engine.policy.round_shape import Shape
from specstream.engine.policy.shaping import RoundShaper

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)



class Scripted(RoundShaper):
    """The round-shape policy as the engine's public seam takes it: shapes (and whether each
    is a probe) from a script, then the last shape; what it handed out is recorded."""

    def __init__(self, max_depth, drafting, max_topk=1, max_nodes=0, script=(), probes=()):
        super().__init__(max_depth, drafting, max_topk, max_nodes)
        self.script, self.probes = list(script), list(probes)
        self.given: list[Shape] = []
        self.probes_given: list[bool] = []

    def shape(self, num_requests, catch_up=0.0, history_tokens=None):
        k = len(self.given)
        pick = self.script[min(k, len(self.script) - 1)] if self.script else Shape(0)
        if k >= len(self.script) and self.script:
            pick = Shape(self.max_depth)
        self.probing = self.probes[k] if k < len(self.probes) else False
        self.given.append(pick)
        self.probes_given.append(self.probing)
        return pick

def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def _feed(shaper: RoundShaper, rounds: int, link_s: float, verify: tuple[float, float],
          draft: tuple[float, float], accept: float, n: int = 8) -> None:
    """Rounds of n requests with chains of the shaper's current depth, each draft accepted
    with probability ``accept`` (a geometric law, seeded). Not the rounded mean every round:
    a policy that learns acceptance by depth would read that as depths that always pass and
    one that never does."""
    rng = random.Random(0)
    for _ in range(rounds):
        q = shaper.shape(n).depth
        verified = []
        for _ in range(n):
            accepted = 0
            while accepted < q and rng.random() < accept:
                accepted += 1
            verified.append((q, accepted))
        shaper.observe(link_s, verify[0] + verify[1] * n * (q + 1), n * (q + 1),
                       [n] * q, q * (draft[0] + draft[1] * n), verified)


def test_shaper_goes_long_when_link_bound_and_off_when_drafting_does_not_pay():
    link_bound = RoundShaper(max_depth=16, drafting="gaps", prior_acceptance=0.75)
    _feed(link_bound, 60, link_s=0.8, verify=(0.005, 0.0002), draft=(0.004, 0.0001),
          accept=0.75)
    assert link_bound.shape(8).depth >= 8
    useless = RoundShaper(max_depth=8, drafting="sequential", prior_acceptance=0.2)
    _feed(useless, 60, link_s=0.0, verify=(0.01, 0.004), draft=(0.01, 0.004), accept=0.2)
    picks = [useless.shape(8).depth for _ in range(64)]
    # no speculation, but for every 32nd decision, which drafts one token to keep learning
    assert picks.count(0) == 62 and picks.count(1) == 2


def test_auto_policy_is_validated():
    with pytest.raises(ValueError, match="needs a proposer"):
        EngineConfig(mode="resident", speculative_policy="auto")
    with pytest.raises(ValueError, match="'auto', 'fixed'"):
        EngineConfig(mode="resident", proposer="ngram", speculative_policy="sometimes")


@pytest.mark.parametrize("mode", ["resident", "offload-spec", "specstream"])
def test_auto_policy_output_equals_target_only(tiny_target, mode):
    prompts = _prompts((300, 420, 200))
    ref_llm = LLM(tiny_target, mode="resident", device_kv_bytes=4_000_000, block_size=16)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, GREEDY, use_tqdm=False)]
    ref_llm.close()
    llm = LLM(tiny_target, mode=mode, proposer="ngram", num_speculative_tokens=8,
              speculative_policy="auto", block_size=16, chunk_tokens=64,
              device_kv_bytes=600_000 if mode != "resident" else 4_000_000,
              resident_tail_tokens=32, max_prefill_tokens=128)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    chosen = llm.get_metrics()["speculative_depth_chosen"]
    assert sum(chosen.values()) > 0 and all(0 <= d <= 8 for d in chosen)
    llm.close()


def test_shaper_offers_trees_and_takes_one_when_verification_is_nearly_free():
    shaper = RoundShaper(max_depth=6, drafting="gaps", max_topk=4, max_nodes=32,
                         prior_acceptance=0.55)
    assert {s.num_nodes for s in shaper.candidates if s.topk > 1} >= {12, 24, 32}
    # tree walks where the target often takes a lower-ranked child
    walk = [(4, 0), (4, 1), (4, 0), (4, None)]
    for _ in range(80):
        if shaper.shape(8).depth:
            shaper.observe(0.8, 0.01, 8 * 33, [32] * 6, 0.03, [], [walk] * 8)
        else:  # a round without drafts: the verification line's second point
            shaper.observe(0.8, 0.01, 8, [], 0.0, [(0, 0)] * 8)
    pick = shaper.shape(8)
    assert pick.topk in (2, 4) and pick.num_nodes > pick.depth  # binary or widest
    assert shaper.acceptance.beta(1) > 0.15  # learnt from the walks (prior: 0.55 / 4)


def test_auto_policy_with_trees_is_exact_and_learns_ranks(tiny_target):
    """The target drafting for itself accepts nearly everything: on a slow link the policy
    verifies deep trees; outputs equal target-only decoding whatever it picks."""
    prompts = _prompts((300, 420, 360), seed=3)
    ref_llm = LLM(tiny_target, mode="resident", device_kv_bytes=4_000_000, block_size=16)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, GREEDY, use_tqdm=False)]
    ref_llm.close()
    llm = LLM(tiny_target, mode="specstream", draft_model=str(tiny_target),
              num_speculative_tokens=4, speculative_topk=2, speculative_num_draft_tokens=16,
              # 0.01 GB/s: link-bound for this tiny model (at 0.05 its rounds were not
              # reliably so: the groups merged in some steps, and trees ran in 1 to 22 rounds)
              speculative_policy="auto", residency="tail", link_gbps=0.01, block_size=16,
              chunk_tokens=64, device_kv_bytes=600_000, resident_tail_tokens=32,
              offload_after_tokens=64, max_prefill_tokens=128,
              # the link alone carries the history (host attention, auto by default on two
              # cores, would take part of it and make the round less link-bound)
              host_attention="off")
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    m = llm.get_metrics()
    assert m["tree_rounds"] > 0  # trees were chosen and verified
    assert max(m["speculative_nodes_chosen"]) > 4
    assert m["mean_accepted_len"] > 2.5
    llm.close()


def test_drafting_override_is_an_ablation_of_one_device_speculative_modes():
    c = EngineConfig(mode="specstream", proposer="ngram", drafting="sequential")
    assert c.mode_spec.drafting == "sequential" and not c.mode_spec.two_groups
    assert EngineConfig(mode="specstream", proposer="ngram").mode_spec.two_groups
    with pytest.raises(ValueError, match="replaces a one-device"):
        EngineConfig(mode="parallel-spec", proposer="ngram", drafting="gaps")
    with pytest.raises(ValueError, match="'sequential' or 'gaps'"):
        EngineConfig(mode="specstream", proposer="ngram", drafting="parallel")


def test_auto_gives_sampled_requests_chains_when_it_picks_a_tree() -> None:
    from specstream.engine.policy.round_shape import Shape
    from specstream.engine.request import Request
    from specstream.engine.sched.scheduler import Scheduler
    from specstream.kvcache.manager import KVManager
    from specstream.kvcache.residency import OffloadPolicy

    config = EngineConfig(mode="resident", proposer="draft", draft_model="unused",
                          num_speculative_tokens=4, speculative_topk=4,
                          speculative_num_draft_tokens=16, speculative_policy="auto",
                          block_size=16)
    sched = Scheduler(config, KVManager(16, 256, 0, OffloadPolicy(offload=False)),
                      shaper=Scripted(4, "sequential", 4, 16, script=[Shape(4, 4, 16)]))
    sched.add(Request("g", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8)))
    sched.add(Request("s", [1, 2, 3], SamplingParams(temperature=0.8, seed=1, max_tokens=8)))
    sched.schedule()  # the prefills (the policy's shape for the round after them)
    greedy = sched.drafts.draft(sched.requests["g"], after_verify=False)
    sampled = sched.drafts.draft(sched.requests["s"], after_verify=False)
    assert (greedy.topk, greedy.max_nodes) == (4, 16)
    assert (sampled.topk, sampled.max_nodes, sampled.num_tokens) == (1, None, 4)


@pytest.mark.parametrize("mode", ["offload-spec", "specstream"])
def test_shapes_that_stop_drafting_never_stall_a_request_and_probes_draft_for_one(
        tiny_target, mode, monkeypatch):
    """A request waiting for drafts the next shape does not make verifies without them (in
    the two-group mode it used to wait until a shape drafted again); a probe drafts for one
    request of the step only."""
    prompts = _prompts((200, 260, 180, 220), seed=5)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ref_llm = LLM(tiny_target, mode="resident", device_kv_bytes=4_000_000, block_size=16)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params, use_tqdm=False)]
    ref_llm.close()
    script = [Shape(4)] * 12 + [Shape(0)] * 16 + [Shape(2)] * 6
    probing = [False] * 28 + [True] * 6
    shaper = Scripted(4, "gaps" if mode == "specstream" else "sequential", script=script,
                      probes=probing)
    config = EngineConfig(mode=mode, proposer="ngram", num_speculative_tokens=4,
                          speculative_policy="auto", block_size=16, chunk_tokens=64,
                          device_kv_bytes=2_000_000, resident_tail_tokens=32,
                          max_prefill_tokens=1024)
    eng = LLMEngine(tiny_target, config, shaper=shaper)
    plans = capture_plans(eng, monkeypatch)
    try:
        ids = [eng.add_request(p, params) for p in prompts]
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    finally:
        eng.close()
    assert [done[i] for i in ids] == ref
    shapes = list(zip([s.depth for s in shaper.given], shaper.probes_given))
    assert len(plans) == len(shapes) > 34
    # from the last shape that drafted until the stretch without drafts ends, every decoding
    # request is verified at least every other step (the two groups alternate)
    rids = {s.request_id for p in plans for s in p.seqs if not s.prefill}
    for rid in rids:
        steps = [i for i in range(14, 28)
                 if any(s.request_id == rid and not s.prefill for s in plans[i].seqs)]
        assert steps and all(b - a <= 2 for a, b in zip(steps, steps[1:])), (rid, steps)
        assert all(not s.num_drafts for i in steps[1:] for s in plans[i].seqs)
    probes = [p for p, (_, probing) in zip(plans, shapes) if probing]
    assert all(len(p.drafts) <= 1 for p in probes) and any(p.drafts for p in probes)


def _drafting_pays_a_little(shaper: RoundShaper) -> None:
    """Rounds of 4 requests: verification 10 ms + 0.5 ms a position, a draft forward 1 ms,
    no link; acceptance 0.7 (a chain of 2 makes ~2.2 tokens where none makes 1)."""
    for _ in range(60):
        q = shaper.shape(4).depth
        accepted = min(q, round(sum(0.7 ** (d + 1) for d in range(q))))
        shaper.observe(0.0, 0.010 + 0.0005 * 4 * (q + 1), 4 * (q + 1), [4] * q, 0.001 * q,
                       [(q, accepted)] * 4)


def test_drafting_pays_for_the_drafts_catching_up():
    """Drafting's one-off cost (the draft feeding tokens it has not seen, per token the
    requests still generate) counts against drafting; a cheap catch-up does not stop it."""
    shaper = RoundShaper(max_depth=4, drafting="sequential", prior_acceptance=0.7)
    shaper.catch_up.prior(0.0001)  # 0.1 ms a token
    _drafting_pays_a_little(shaper)
    assert shaper.shape(4, catch_up=0.0).depth > 0
    assert shaper.shape(4, catch_up=4.0).depth > 0  # 0.4 ms a round
    assert shaper.shape(4, catch_up=400.0).depth == 0  # 40 ms a round: not worth it


def test_a_step_that_mostly_catches_up_measures_the_catch_up_not_the_forwards():
    from specstream.engine.contract import DraftWork, StepOutput, StepPlan

    shaper = RoundShaper(max_depth=4, drafting="sequential")
    shaper.catch_up.prior(1e-5)
    work = DraftWork("r", (1,) * 1000, 4, room=100, params=GREEDY, after_verify=False,
                     unseen=1000)
    out = StepOutput()
    out.drafts["r"] = [5, 6, 7, 8]
    shaper.observe_step(StepPlan((), (work,)), out, 0.0, 0.0, 0.104, prefill=True)
    assert shaper.catch_up.fed > 0 and shaper.catch_up.token_s == pytest.approx(1.04e-4)
    assert shaper.draft.n == 0  # the draft line did not see a 26 ms "forward"
    shaper.catch_up.prior(1e-5)  # a prior no longer replaces a measurement
    assert shaper.catch_up.token_s == pytest.approx(1.04e-4)
    # a warm request's drafting: the forwards, less the little catching up, feed the line
    warm = DraftWork("r", (1,) * 1006, 4, room=96, params=GREEDY, after_verify=False,
                     unseen=2)
    shaper.observe_step(StepPlan((), (warm,)), out, 0.0, 0.0, 0.004 + 2 * 1.04e-4,
                        prefill=True)
    assert shaper.draft.n > 0 and shaper.draft.coef()[0] == pytest.approx(0.001)
    # an exploration that would make the draft catch up on a whole window is skipped
    shaper.exploring = True
    shaper.verify.add(1, 4, 0.01)
    assert not shaper.explore_now(1000, 4) and shaper.explore_now(10, 4)
    # ... until the rounds since the last exploration that ran pay for it (a choice of no
    # speculation whose catching up grows round by round is not kept from exploring for ever)
    shaper.decisions += 7 * shaper.explore_every
    # ... but never by more rounds than the known work has left, which alone can use what
    # it learns (c09: a 6K request's window fed for its last few tokens)
    assert not shaper.explore_now(1000, 4, rounds_left=3)
    assert shaper.explore_now(1000, 4, rounds_left=1000)
    assert not shaper.explore_now(1000, 4)  # it ran: the allowance starts again


def test_seeded_sampling_keeps_its_chain_whatever_the_policy_picks(tiny_target, tiny_draft):
    """A seeded sampled request's tokens depend on how many drafts each round verifies; under
    auto it drafts its configured chain, so its output is the one the fixed policy gives,
    while the shapes chosen for the others change round by round."""
    prompts = _prompts((150, 120))
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True)
    kw = dict(mode="specstream", draft_model=str(tiny_draft), num_speculative_tokens=3,
              block_size=16, chunk_tokens=64, device_kv_bytes=2_000_000,
              resident_tail_tokens=32, max_prefill_tokens=1024)
    fixed = LLM(tiny_target, speculative_policy="fixed", **kw)
    want = [o.outputs[0].token_ids for o in fixed.generate(prompts, [seeded, GREEDY],
                                                             use_tqdm=False)]
    fixed.close()
    auto = LLM(tiny_target, **kw)
    assert auto.engine.config.policy == "auto"  # the default with a proposer
    sched = auto.engine.scheduler
    depths = iter([0, 3, 1, 2, 0, 0, 3] * 20)

    def scripted(num_requests: int, catch_up: float = 0.0,
                 history_tokens: int | None = None) -> Shape:
        sched.shaper.probing = False
        return Shape(next(depths, 1))

    sched.shaper.shape = scripted
    got = [o.outputs[0].token_ids for o in auto.generate(prompts, [seeded, GREEDY],
                                                          use_tqdm=False)]
    auto.close()
    assert got == want


def test_a_drafting_round_s_fixed_part_is_priced_apart_from_its_forwards():
    """A round's drafting costs a part once (its first forward feeds what the last round
    accepted, the job's set-up) and a part per draft forward: measured on the embedded pair at
    1K context, one request, chains of 2 / 4 / 8 took 4.6 / 7.5 / 13.3 ms, ~1.6 ms + 1.45 ms a
    level. Priced all per level (the rounds' time over their levels), a depth the policy has
    not run is overpriced by the fixed part times its depth over the depths it ran; with rounds
    of two depths seen, the fixed part comes apart and the depth is priced as it runs."""
    fixed, level = 0.0016, 0.00145

    def feed(shaper, depths, rounds=40):
        for i in range(rounds):
            q = depths[i % len(depths)]
            shaper.observe(0.0, 0.0114 + 0.00033 * (q + 1), q + 1, [1] * q, fixed + level * q,
                           [(q, q // 2)])

    both = RoundShaper(max_depth=8, drafting="sequential")
    feed(both, (2, 4))
    assert both.costs().draft_s(Shape(8), 1) == pytest.approx(fixed + 8 * level, rel=0.03)
    assert both.costs().draft_s(Shape(2), 1) == pytest.approx(fixed + 2 * level, rel=0.03)
    # rounds of one depth tell the parts apart nowhere: every level is priced as the rounds
    # ran, the cautious reading (never cheaper than measured per level)
    one = RoundShaper(max_depth=8, drafting="sequential")
    feed(one, (2,))
    assert one.costs().draft_s(Shape(8), 1) == pytest.approx(8 * (fixed + 2 * level) / 2,
                                                            rel=0.03)


def test_a_draft_that_never_matches_is_read_as_missing_within_a_few_rounds():
    """Prompts of random ids, one request a round (the matrix's c03): the draft's first token
    misses every round, one observation a round. A round of 1 query position takes 10 ms,
    each more 0.5 ms, a draft forward 1 ms. A prior worth twenty observations took ~40
    rounds of misses to halve, and the shaper kept drafting trees of 2 and 4 nodes for a
    dozen rounds; worth eight, it stopped within ten; now four misses reject the prior's 0.6
    (0.4^4 < 5%) and it decides on the data from the fifth round."""
    shaper = RoundShaper(max_depth=8, drafting="sequential", max_topk=4, max_nodes=32)
    shaper.prior_position(0.0005)
    picks = []
    for _ in range(16):
        pick = shaper.shape(1)
        picks.append(pick.depth)
        drafted = pick.num_nodes
        walks = [[(pick.topk, None)]] if pick.topk > 1 else []
        chains = [(pick.depth, 0)] if pick.topk == 1 else []
        shaper.observe(0.0, 0.010 + 0.0005 * drafted, 1 + drafted,
                       [drafted / max(1, pick.depth)] * pick.depth, 0.001 * pick.depth,
                       chains, walks)
    assert picks[0] > 0  # the first round probes
    assert picks[4:] == [0] * 12, picks


def test_the_catch_up_rate_weighs_a_whole_prompt_above_a_few_tokens():
    """The draft's time per token caught up on, from steps whose drafting was mostly
    catching up: a step that fed 64 tokens with two forwards the draft line could not take
    off yet (c01: 5.8 ms, read as 0.091 ms a token), then one that fed a 1,024-token prompt
    in 63 ms (0.062). The rate is what the tokens took, the big feed weighing sixteen times
    the small one: not their two per-token readings averaged (0.082)."""
    from specstream.engine.contract import DraftWork, StepOutput, StepPlan

    shaper = RoundShaper(max_depth=4, drafting="sequential")
    out = StepOutput()
    out.drafts["r"] = [5, 6]
    small = DraftWork("r", (1,) * 64, 2, room=32, params=GREEDY, after_verify=False,
                      unseen=64)
    shaper.observe_step(StepPlan((), (small,)), out, 0.0, 0.0, 0.0058, prefill=True)
    assert shaper.catch_up.token_s == pytest.approx(0.0058 / 64)
    out.drafts["r"] = [5, 6, 7, 8]
    whole = DraftWork("r", (1,) * 1024, 4, room=32, params=GREEDY, after_verify=False,
                      unseen=1024)
    shaper.observe_step(StepPlan((), (whole,)), out, 0.0, 0.0, 0.0631, prefill=True)
    assert shaper.catch_up.token_s == pytest.approx((0.7 * 0.0058 + 0.0631) / (0.7 * 64 + 1024))
    assert shaper.catch_up.token_s < 0.064 / 1000


def test_the_rounds_left_count_the_waiting_requests_and_not_the_finished():
    """An exploration's allowance ends with the known work: each unfinished request's tokens
    left, at one a round, spread over the requests decoding now."""
    from specstream.engine.request import Request, Status
    from specstream.engine.sched.drafts import DraftPlanner

    planner = DraftPlanner(EngineConfig(mode="specstream", proposer="ngram"), None, 1 << 16)
    params = SamplingParams(max_tokens=32, temperature=0.0)
    decoding = [Request(f"d{i}", [1] * 100, params, num_computed_tokens=100) for i in range(2)]
    decoding[0].output_token_ids = [7] * 30  # two tokens left
    waiting = Request("w", [1] * 100, params)
    done = Request("f", [1] * 100, params, status=Status.FINISHED)
    requests = {r.request_id: r for r in (*decoding, waiting, done)}
    assert planner.rounds_left(decoding, requests) == (2 + 32 + 32) / 2
