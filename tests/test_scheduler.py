"""The scheduler as a specification: schedule -> hand-built StepOutput -> update, no model.

The scheduler decides what each step does (which requests, which prefill chunks, who drafts
when) and folds the worker's output back into the requests; nothing here runs a tensor.
"""

from __future__ import annotations

from specstream.config import EngineConfig
from specstream.engine.contract import StepOutput, StepPlan
from specstream.engine.policy.feedback import Estimates
from specstream.engine.request import Request
from specstream.engine.sched.scheduler import Scheduler
from specstream.kvcache.manager import KVManager
from specstream.kvcache.residency import OffloadPolicy
from specstream.sampling_params import SamplingParams

EOS = 2


def _offload_scheduler(history_token_bytes: int = 0, **cfg) -> Scheduler:
    config = EngineConfig(**{**dict(mode="specstream", block_size=16, max_prefill_tokens=64,
                                    proposer="ngram", num_speculative_tokens=2,
                                    speculative_policy="fixed",
                                    offload_after_tokens=64, resident_tail_tokens=32,
                                    chunk_tokens=64), **cfg})
    policy = OffloadPolicy(offload=True, resident_tail_tokens=32, offload_after_tokens=64,
                           chunk_tokens=64, residency=config.residency)
    return Scheduler(config, KVManager(16, 256, 256, policy), max_model_len=4096,
                     eos_token_ids=[EOS], history_token_bytes=history_token_bytes)


def _resident_scheduler(**cfg) -> Scheduler:
    config = EngineConfig(**{**dict(mode="resident", block_size=16, max_prefill_tokens=64,
                                    speculative_policy="fixed"), **cfg})
    return Scheduler(config, KVManager(16, 256, 0, OffloadPolicy(offload=False)),
                     max_model_len=4096, eos_token_ids=[EOS])


def _emit(plan: StepPlan, accepted: int = 0, token: int = 5, drafts=(6, 7)) -> StepOutput:
    """What a worker would return: every sampling request accepts ``accepted`` drafts and
    emits ``token`` after them; every draft job proposes ``drafts``."""
    out = StepOutput()
    for s in plan.seqs:
        if s.sample:
            drafted = list(s.token_ids[len(s.token_ids) - s.num_drafts:])
            out.new_tokens[s.request_id] = drafted[:accepted] + [token]
    for d in plan.drafts:
        out.drafts[d.request_id] = list(drafts)[: d.num_tokens]
    return out


def test_prefill_budget_goes_to_the_oldest_prompt_first() -> None:
    sched = _resident_scheduler()
    for i in range(3):
        sched.add(Request(str(i), list(range(3, 153)), SamplingParams(max_tokens=4)))
    starts = []
    for _ in range(2):  # the rotation starts elsewhere each step; prefill order does not
        plan = sched.schedule()
        assert [s.request_id for s in plan.seqs] == ["0"] and plan.seqs[0].prefill
        starts.append(plan.seqs[0].start_pos)
        sched.update(plan, StepOutput())  # a chunk that samples nothing: KV committed
    assert starts == [0, 64]
    plan = sched.schedule()  # request 0 has 22 tokens left: the rest of the budget is 1's
    assert [(s.request_id, len(s.token_ids)) for s in plan.seqs] == [("0", 22), ("1", 42)]
    assert plan.seqs[0].sample and not plan.seqs[1].sample


def test_two_groups_alternate_and_prefill_steps_verify_everyone() -> None:
    """A decode-only step verifies one group while the other drafts; a step that carries a
    prefill chunk verifies every request with drafts, and they draft right after it."""
    sched = _offload_scheduler()
    params = SamplingParams(max_tokens=8)
    for i in range(2):
        sched.add(Request(f"d{i}", list(range(3, 43)), params))
    plan = sched.schedule()  # d0's whole prompt and the start of d1's
    assert [(s.request_id, len(s.token_ids)) for s in plan.seqs] == [("d0", 40), ("d1", 24)]
    assert [(d.request_id, d.after_verify) for d in plan.drafts] == [("d0", True)]
    sched.update(plan, _emit(plan))
    assert sched.requests["d0"].draft_token_ids == [6, 7]
    plan = sched.schedule()  # d0 verifies beside the rest of d1's prompt
    assert {s.request_id for s in plan.seqs} == {"d0", "d1"}
    assert {d.request_id for d in plan.drafts if d.after_verify} == {"d0", "d1"}
    sched.update(plan, _emit(plan))
    assert sorted(r.group for r in sched.running) == [0, 1]
    plan = sched.schedule()  # decode only: one group verifies, the other drafts meanwhile
    (verified,) = [s.request_id for s in plan.seqs]
    assert [(d.request_id, d.after_verify) for d in plan.drafts] == []  # both have drafts
    sched.update(plan, _emit(plan))
    assert sched.requests[verified].needs_draft  # it drafts during the next step
    plan = sched.schedule()
    other = ({"d0", "d1"} - {verified}).pop()
    assert [s.request_id for s in plan.seqs] == [other]
    assert [(d.request_id, d.after_verify) for d in plan.drafts] == [(verified, False)]
    sched.update(plan, _emit(plan))
    sched.add(Request("p", list(range(3, 100)), params))  # a new prompt arrives
    plan = sched.schedule()  # every request with drafts verifies beside the prompt's chunk
    assert {s.request_id for s in plan.seqs} == {verified, "p"}
    # the request verified last drafts meanwhile; the verified one drafts right after (the
    # prompt's chunk samples nothing yet, so it does not draft)
    assert {(d.request_id, d.after_verify) for d in plan.drafts} == {
        (other, False), (verified, True)}


def test_update_appends_accepted_drafts_and_rolls_the_rest_back() -> None:
    sched = _resident_scheduler(proposer="ngram", num_speculative_tokens=3)
    sched.add(Request("r", list(range(3, 23)), SamplingParams(max_tokens=20)))
    plan = sched.schedule()
    sched.update(plan, _emit(plan, drafts=(8, 9, 10)))  # prefill: first token 5, drafts
    req = sched.requests["r"]
    assert req.output_token_ids == [5] and req.num_computed_tokens == 20
    plan = sched.schedule()
    assert plan.seqs[0].token_ids == (5, 8, 9, 10)
    update = sched.update(plan, _emit(plan, accepted=2, token=11, drafts=(12, 13, 14)))
    assert req.output_token_ids == [5, 8, 9, 11]
    assert update.num_appended == 3
    # KV kept for 5, 8 and 9; the rejected draft 10 rolled back; 11 has none yet
    assert req.num_computed_tokens == 23 and sched.kv.num_tokens("r") == 23
    assert (req.num_rounds, req.num_proposed, req.num_accepted) == (1, 3, 2)


def test_stops_end_requests_and_free_their_kv() -> None:
    sched = _resident_scheduler()
    sched.add(Request("eos", [3, 4, 5], SamplingParams(max_tokens=10)))
    sched.add(Request("len", [3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True)))
    sched.add(Request("ign", [3, 4, 5], SamplingParams(max_tokens=10, ignore_eos=True)))
    told = []
    for _ in range(2):
        plan = sched.schedule()
        told += plan.finished
        sched.update(plan, _emit(plan, token=EOS))
    reqs = sched.requests
    assert (reqs["eos"].finish_reason, reqs["eos"].output_token_ids) == ("stop", [EOS])
    assert (reqs["len"].finish_reason, reqs["len"].output_token_ids) == ("length", [EOS, EOS])
    assert not reqs["ign"].finished
    assert set(sched.kv.seqs) == {"ign"}  # finished requests hold no blocks
    told += sched.schedule().finished
    assert sorted(told) == ["eos", "len"]  # the worker is told once, in the next plan
    assert sched.schedule().finished == ()


def test_errors_fail_their_request_and_a_missing_output_is_retried() -> None:
    sched = _resident_scheduler()
    for rid in ("bad", "later", "ok"):
        sched.add(Request(rid, [3, 4, 5], SamplingParams(max_tokens=4)))
    plan = sched.schedule()
    out = _emit(plan)
    out.errors["bad"] = "KV restore failed: injected"
    del out.new_tokens["later"]  # it did not run (e.g. another request's drafting failed)
    sched.update(plan, out)
    assert sched.requests["bad"].finish_reason == "error"
    assert sched.requests["bad"].error == "KV restore failed: injected"
    assert "bad" not in sched.kv.seqs
    later = sched.requests["later"]
    assert later.output_token_ids == [] and later.num_computed_tokens == 0
    plan = sched.schedule()
    assert [s for s in plan.seqs if s.request_id == "later"][0].start_pos == 0  # again


def test_tails_past_the_threshold_are_written_back() -> None:
    sched = _offload_scheduler(mode="offload", proposer=None, num_speculative_tokens=None,
                               residency="tail")
    sched.add(Request("r", list(range(3, 103)), SamplingParams(max_tokens=8)))
    moves = {}
    while sched.requests["r"].in_prefill:
        plan = sched.schedule()
        update = sched.update(plan, _emit(plan))
        moves.update(update.writebacks)
        sched.complete_writebacks(update.writebacks, {})
    # 101 tokens with KV: past 64, everything but a 32-token tail (whole blocks) moves
    assert len(moves["r"]) == 4 and sched.kv.host_tokens("r") == 64
    held = len(sched.kv.seqs["r"].device_blocks)
    assert sched.kv.device.num_used == held  # the copied blocks were freed


def test_decode_write_backs_ride_along_the_next_step() -> None:
    """A decode round that pushes the tail past its budget plans the copies for the next step
    (they overlap its round, and the tail blocks are attended on the device meanwhile); a prefill
    chunk's copies are made before the next chunk, which needs the room."""
    sched = _offload_scheduler(mode="offload", proposer=None, num_speculative_tokens=None,
                               residency="tail")
    sched.add(Request("r", list(range(3, 40)), SamplingParams(max_tokens=80, ignore_eos=True)))
    plan = sched.schedule()  # the whole 37-token prompt: below the 64-token threshold
    update = sched.update(plan, _emit(plan))
    assert update.writebacks == {}
    while sched.kv.seqs["r"].num_tokens <= 64:  # decode until the tail passes the threshold
        plan = sched.schedule()
        assert plan.writebacks == ()
        update = sched.update(plan, _emit(plan))
    assert update.writebacks == {}  # not copied at the end of the step...
    moving = sched.kv.seqs["r"].moving
    assert len(moving) == 2 and sched.kv.host_tokens("r") == 0
    plan = sched.schedule()  # ...but during the next one, the blocks still in the tail
    assert plan.writebacks == (("r", tuple(moving)),)
    assert plan.seqs[0].host_tokens == 0 and plan.seqs[0].device_blocks[:2] == tuple(
        d for d, _ in moving)
    sched.update(plan, _emit(plan))
    assert sched.kv.host_tokens("r") == 32 and not sched.kv.seqs["r"].moving
    assert sched.schedule().seqs[0].restore_chunks  # now restored from the host


def test_a_prefill_step_verifies_everyone_only_where_its_chunk_hides_their_history() -> None:
    """Where streaming every decoding request's history would take longer than the chunk's
    compute (a slow link), a two-group step that carries a prefill chunk verifies one group,
    as any other step; where the chunk hides it, every request with drafts."""
    def ready() -> Scheduler:
        sched = _offload_scheduler(residency="tail", history_token_bytes=1000)
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        for i in range(2):
            sched.add(Request(f"d{i}", list(range(3, 123)), params))
        for _ in range(20):
            plan = sched.schedule()
            update = sched.update(plan, _emit(plan))
            sched.complete_writebacks(update.writebacks, {})
            if all(r.group >= 0 and r.draft_token_ids for r in sched.running):
                break
        assert all(sched.kv.host_tokens(r.request_id) > 0 for r in sched.running)
        sched.add(Request("p", list(range(3, 100)), params))
        return sched

    slow = ready()
    plan = slow.schedule(Estimates(link_bps=1e3, prefill_chunk_s=0.01))  # history: s; chunk: ms
    assert "p" in {s.request_id for s in plan.seqs}
    assert len({s.request_id for s in plan.seqs} - {"p"}) == 1  # one group
    fast = ready()
    plan = fast.schedule(Estimates(link_bps=1e12, prefill_chunk_s=0.01))
    assert {s.request_id for s in plan.seqs} == {"d0", "d1", "p"}


def test_specstream_verifies_every_request_while_the_link_hides_nothing() -> None:
    """Estimates.link_bound False: the two groups merge (every decoding request verifies in
    the step and drafts right after it); True: one group verifies, the other drafts."""
    sch = _offload_scheduler()
    for i in range(4):
        sch.add(Request(str(i), list(range(10, 40)), SamplingParams(max_tokens=16)))
    for _ in range(6):  # prefills, then each group's first drafts
        sch.update(plan := sch.schedule(), _emit(plan))
    split = sch.schedule(Estimates(link_bound=True))
    assert len([s for s in split.seqs if s.sample]) == 2  # one group
    assert not any(d.after_verify for d in split.drafts)  # the other drafts meanwhile
    sch.update(split, _emit(split))
    # the first merged step: the group just verified drafts (while the other verifies)
    first = sch.schedule(Estimates(link_bound=False))
    sch.update(first, _emit(first))
    merged = sch.schedule(Estimates(link_bound=False))
    assert len([s for s in merged.seqs if s.sample]) == 4
    assert len(merged.drafts) == 4 and all(d.after_verify for d in merged.drafts)
    assert sch.groups.merged_steps == 2
    sch.update(merged, _emit(merged))
    again = sch.schedule(Estimates(link_bound=True))  # split again: one group verifies
    assert len([s for s in again.seqs if s.sample]) == 2
