"""RoundFeedback: step measurements in, the scheduler's Estimates out (engine/policy/feedback.py).

Hand-built measurements, no model: what makes ``auto`` host attention give the host a share
(a link-bound pure decode round) and what must not take it away (a round that also prefilled:
the bench regression guard caught this, host attention's decode-only speed-up halved)."""

from __future__ import annotations

from dataclasses import replace

from specstream.config import EngineConfig
from specstream.engine.contract import SeqWork, StepMeasures, StepOutput, StepPlan
from specstream.engine.policy.feedback import RoundFeedback

LINK = 1e9  # emulated 1 GB/s


def _feedback() -> RoundFeedback:
    return RoundFeedback(EngineConfig(mode="specstream", proposer="ngram", host_attention="auto",
                                      link_gbps=LINK / 1e9, device_kv_bytes=64 << 20))


def _step(fb: RoundFeedback, *, history: int, host: int, compute_s: float,
          prefill: int = 0, jobs: tuple[tuple[int, float, int], ...] = ()) -> None:
    m = StepMeasures(wall_s=compute_s, wait_s=0.0, draft_s=0.0, link_busy_s=history / LINK,
                     link_bytes=history, history_bytes=history, prefill_tokens=prefill,
                     decode=True, host_attends=True, host_bytes=host, host_serial_s=0.002,
                     host_jobs=jobs)
    fb.observe(StepPlan(seqs=()), StepOutput(), m)


def test_a_compute_bound_decode_round_takes_the_hosts_share_away() -> None:
    fb = _feedback()
    assert fb.estimates().host_pays  # until measured
    _step(fb, history=10_000_000, host=0, compute_s=0.050)  # 10 ms of link, 50 ms of compute
    assert not fb.estimates().host_pays
    _step(fb, history=60_000_000, host=20_000_000, compute_s=0.050)  # 80 ms of link
    assert fb.estimates().host_pays


def test_a_round_that_also_prefilled_leaves_the_verdict_alone() -> None:
    fb = _feedback()
    _step(fb, history=60_000_000, host=20_000_000, compute_s=0.050)
    assert fb.estimates().host_pays
    # a prefill chunk's compute dwarfs the link: that says nothing of decode rounds
    _step(fb, history=60_000_000, host=20_000_000, compute_s=2.0, prefill=2048)
    assert fb.estimates().host_pays
    _step(fb, history=10_000_000, host=0, compute_s=0.050)  # a decode round still decides
    assert not fb.estimates().host_pays


def _group(*rids: str) -> StepPlan:
    return StepPlan(seqs=tuple(SeqWork(r, (5,), start_pos=4000, num_drafts=0, prefill=False,
                                       sample=True, host_tokens=3968, device_blocks=(),
                                       restore_chunks=()) for r in rids))


def test_each_group_keeps_its_own_verdict_on_the_host() -> None:
    """Two groups alternate; the one of four requests is link-bound, the one of three is not.
    One verdict for both handed each group the other's: the host attended every other round
    and the link-bound group waited on the link in each of its own (the matrix's c01)."""
    from specstream.engine.sched.host_split import MeasuredSplit

    fb = _feedback()
    m = dict(wait_s=0.0, draft_s=0.0, prefill_tokens=0, decode=True, host_attends=True,
             host_serial_s=0.002)
    four, three = _group("a", "b", "c", "d"), _group("e", "f", "g")
    for _ in range(3):  # 40 ms of cold history against 33 ms of compute; 31 against 39
        fb.observe(four, StepOutput(), StepMeasures(
            wall_s=0.033, link_busy_s=0.02, link_bytes=20_000_000, history_bytes=20_000_000,
            host_bytes=20_000_000, **m))
        fb.observe(three, StepOutput(), StepMeasures(
            wall_s=0.039, link_busy_s=0.031, link_bytes=31_000_000,
            history_bytes=31_000_000, host_bytes=0, **m))
    est = fb.estimates()
    assert not est.host_pays  # the last round's verdict ...
    assert est.host_pays_for("abcd") and not est.host_pays_for("efg")  # ... is the three's
    split = MeasuredSplit(EngineConfig(mode="specstream", proposer="ngram",
                                       host_attention="auto"), block_bytes=1 << 20)
    assert sum(split.counts(four.seqs, [30] * 4, est)) > 0
    assert split.counts(three.seqs, [30] * 3, est) == [0.0] * 3
    assert not est.host_pays_for(["new"])  # one no decode round verified: the last verdict
    # a finished request's verdict is forgotten (the last round's stands in for it)
    fb.observe(StepPlan(seqs=(), finished=("a", "b", "c", "d")), StepOutput(),
               StepMeasures(wall_s=0.0, wait_s=0.0, draft_s=0.0, link_busy_s=0.0,
                            link_bytes=0, history_bytes=0, prefill_tokens=0, decode=False))
    assert not fb.estimates().host_pays_for("abcd")


def test_host_jobs_fit_the_hosts_cost_line() -> None:
    """Seconds per byte against query positions, from every job of every step."""
    fb = _feedback()
    jobs = tuple((p, 1e-9 * (1 + p) * 1_000_000, 1_000_000) for p in (1, 2, 5, 9))
    _step(fb, history=60_000_000, host=4_000_000, compute_s=0.05, jobs=jobs)
    host = fb.estimates().host
    assert host is not None
    assert abs(host.per_byte(3) - 4e-9) < 1e-12 and abs(host.per_byte(9) - 10e-9) < 1e-12
    assert host.serial_s == 0.002


VERIFY = StepPlan(seqs=(SeqWork("r0", (5, 6, 7), start_pos=4000, num_drafts=2, prefill=False,
                               sample=True, host_tokens=3968, device_blocks=(),
                               restore_chunks=()),))


def _decode(fb: RoundFeedback, *, history: int, verify_s: float, draft_s: float = 0.0,
            plan: StepPlan = VERIFY) -> None:
    m = StepMeasures(wall_s=verify_s + draft_s, wait_s=0.0, draft_s=draft_s,
                     link_busy_s=history / LINK, link_bytes=history, history_bytes=history,
                     prefill_tokens=0, decode=True)
    fb.observe(plan, StepOutput(), m)


def test_the_groups_merge_where_verification_hides_the_link_and_split_again() -> None:
    """link time over verification time, averaged, with hysteresis: merged below 0.8, split
    above 1.0; drafting and prefilling rounds leave it alone."""
    fb = _feedback()
    assert fb.estimates().link_bound  # until measured
    for _ in range(3):  # 10 ms of history against 40 ms of verification
        _decode(fb, history=10_000_000, verify_s=0.040, draft_s=0.030)
    assert not fb.estimates().link_bound
    _decode(fb, history=36_000_000, verify_s=0.040)  # 0.9: between the two, stays merged
    assert not fb.estimates().link_bound
    _step(fb, history=400_000_000, host=0, compute_s=0.050, prefill=2048)  # says nothing
    assert not fb.estimates().link_bound
    for _ in range(4):  # 80 ms of history against 40 ms
        _decode(fb, history=80_000_000, verify_s=0.040)
    assert fb.estimates().link_bound


def test_history_the_host_attends_is_the_hosts_time_not_the_links() -> None:
    """Rounds whose cold history the host mostly attends: their history takes the longer of
    the link's share and the host's time, not all of it over the link (c01: 70 ms counted
    against 33 ms of verification, where the link carried 17 and the host 5)."""
    def rounds(host_busy_s: float) -> bool:
        fb = _feedback()
        for _ in range(20):
            fb.observe(VERIFY, StepOutput(), StepMeasures(
                wall_s=0.033, wait_s=0.0, draft_s=0.0, link_busy_s=0.017,
                link_bytes=17_000_000, history_bytes=17_000_000, prefill_tokens=0,
                decode=True, host_attends=True, host_bytes=53_000_000,
                host_busy_s=host_busy_s))
        return fb.estimates().link_bound

    assert not rounds(0.005)  # 17 ms of link, 5 of host, 33 of verification: merged
    assert rounds(0.050)  # the host's 50 ms outlast verification: still two groups


def test_a_step_that_only_drafted_leaves_the_groups_split() -> None:
    """One request decoding (or one group empty): every other step only drafts, moving nothing
    in a fraction of a millisecond. Its ratio of nothing over nothing is no round's: counted as
    0, it pulled a slow link's average (7.7 a round) down to 0.41 of it between rounds, and a
    few slow rounds on a loaded CI machine then merged the groups (test_group_merge)."""
    fb = _feedback()
    for _ in range(20):  # 0.16 s of history against 80 ms of verification: 2.0
        _decode(fb, history=160_000_000, verify_s=0.080)
        _decode(fb, history=0, verify_s=0.0001, draft_s=0.0001, plan=StepPlan(seqs=()))
    assert fb.estimates().link_bound
    assert abs(fb.link_over_verify.value - 2.0) < 1e-9


def test_the_shapes_link_time_is_the_historys_not_a_prefills_writes() -> None:
    """A workload that fits on the device: decode rounds move nothing, each new request's
    prefill writes its KV out over a slow link (device to host). Were the link's busy time a
    round's link time, the rounds after each prefill would look link-bound and the deepest
    tree free; the policy sees the history's bytes over the link's rate."""
    fb = RoundFeedback(EngineConfig(mode="specstream", proposer="ngram", link_gbps=0.1,
                                    device_kv_bytes=64 << 20))
    written = 3_000_000  # a prefill chunk's KV out, 30 ms at 0.1 GB/s; no history in
    m = StepMeasures(wall_s=0.9, wait_s=0.0, draft_s=0.0, link_busy_s=written / 0.1e9,
                     link_bytes=written, history_bytes=0, prefill_tokens=1024, decode=True)
    assert fb.history_link_s(m) == 0.0
    streamed = replace(m, history_bytes=2_000_000, link_bytes=written + 2_000_000)
    assert fb.history_link_s(streamed) == 2_000_000 / 0.1e9
