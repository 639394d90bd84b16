"""Measurement feedback: every step's measurements go in here, frozen ``Estimates`` come out.

The engine (and the simulator's replay, which drives the same object) hands each step's plan,
output and ``StepMeasures`` to ``RoundFeedback.observe``; the scheduler reads what it needs of
them only from the ``Estimates`` it is handed before the next step. Everything the engine
learns from timing lives here: the link's rate, a prefill chunk's compute, the host
attention's cost per byte and its idle time, whether a round is link-bound, and (through the
round-shape policy it feeds, ``RoundShaper``) the verification, draft and acceptance models.
Pure Python: numbers in, numbers out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from specstream.config import EngineConfig
from specstream.engine.contract import StepMeasures, StepOutput, StepPlan
from specstream.engine.policy.estimators import Ewma, LineFit
from specstream.engine.policy.round_shape import HostCosts
from specstream.engine.policy.shaping import RoundShaper


@dataclass(frozen=True)
class Estimates:
    """What the scheduler knows of the machine before a step (zeros: not measured yet)."""

    # The link's bytes/s: the emulated rate where one is set, else measured on busy copies.
    link_bps: float = 0.0
    # Compute seconds of a step that carried a prefill chunk.
    prefill_chunk_s: float = 0.0
    # host_attention: the host's measured costs (None: nothing measured yet).
    host: HostCosts | None = None
    # Whether the last decode round with cold history was link-bound (streaming all of it
    # would take longer than its compute): only then does the host get a share.
    host_pays: bool = True
    # Whether decode rounds' history takes the link longer than their verification: only
    # then do `specstream`'s two groups pay (one drafts in the other's transfer gaps); where
    # verification hides the link anyway they merge into one (half the rounds, every draft
    # batched). A moving average of the two, with hysteresis (``MERGE_BELOW``,
    # ``SPLIT_ABOVE``); True until measured.
    link_bound: bool = True
    # ``host_pays`` per request: the verdict of the last decode round that verified it. Two
    # groups alternate, and one can be link-bound while the other is not: one verdict for
    # both handed each group the other's (c01: the host attended every other round, and the
    # group of four waited 13-16 ms on the link in each of its rounds).
    host_pays_of: Mapping[str, bool] = field(default_factory=dict)

    def host_pays_for(self, request_ids: Iterable[str]) -> bool:
        """Whether the host gets a share of a step verifying ``request_ids``: where any of
        them was last verified in a link-bound round (``host_pays`` where none was yet)."""
        verdicts = [self.host_pays_of[r] for r in request_ids if r in self.host_pays_of]
        return any(verdicts) if verdicts else self.host_pays


# decode rounds' link time over their verification time (a moving average): the groups merge
# below the first and split again above the second
MERGE_BELOW = 0.8
SPLIT_ABOVE = 1.0


def _verifies(plan: StepPlan) -> bool:
    """Whether a step verified anything (one that only drafted did not)."""
    return any(s.sample and not s.prefill for s in plan.seqs)


class RoundFeedback:
    """Takes every step's measurements and keeps the estimates current (``Ewma`` averages and
    ``LineFit`` lines, nothing hand-rolled elsewhere)."""

    def __init__(self, config: EngineConfig, shaper: RoundShaper | None = None,
                 draft_share: float = 0.0, link_bps: float | None = None) -> None:
        """``shaper``: the round-shape policy the scheduler consults (fed here);
        ``draft_share``: the draft model's share of the target's parameters (its first
        estimate of a token's catching-up cost, from the target's prefill); ``link_bps``: the
        link's rate where it is known (the simulator's), else the emulated one
        (``link_gbps``), else measured."""
        known = link_bps or (config.link_gbps * 1e9 if config.link_gbps else 0.0)
        self.emulated_bps = known
        self.shaper, self.draft_share = shaper, draft_share
        # a first guess until copies are measured (the emulated rate where one is set)
        self.link = Ewma(value=self.emulated_bps or 10e9)
        self.prefill_chunk = Ewma()
        self.host_cost = LineFit(decay=0.98)  # seconds per byte against query positions
        self.host_serial = Ewma()
        self.host_pays = True
        self.host_pays_of: dict[str, bool] = {}
        self.link_over_verify = Ewma()
        self.link_bound = True

    @property
    def link_bps(self) -> float:
        """The link's rate: the emulated one where set, else the measured estimate."""
        return self.emulated_bps or self.link.value

    def estimates(self) -> Estimates:
        host = None
        if self.host_cost.n:
            a, b = self.host_cost.coef()
            host = HostCosts(a, b, self.host_serial.value)
        return Estimates(self.link_bps, self.prefill_chunk.value, host, self.host_pays,
                         self.link_bound, dict(self.host_pays_of))

    def observe(self, plan: StepPlan, out: StepOutput, m: StepMeasures) -> None:
        """One step, as it ran."""
        for rid in plan.finished:
            self.host_pays_of.pop(rid, None)
        if m.link_bytes >= 1 << 20 and m.link_busy_s > 0:  # a few tiny copies say little
            self.link.add(m.link_bytes / m.link_busy_s)
        for positions, seconds, nbytes in m.host_jobs:
            if nbytes:
                self.host_cost.add(positions, seconds / nbytes)
        if not (m.decode or m.prefill_tokens):
            return  # nothing was done
        if m.prefill_tokens:
            self.prefill_chunk.add(m.compute_s)
        self._observe_host(plan, m)
        self._observe_link_bound(plan, m)
        shaper = self.shaper
        if shaper is None:
            return
        if m.prefill_tokens:
            shaper.catch_up.prior(m.compute_s / m.prefill_tokens * self.draft_share)
            shaper.prior_position(max(0.0, m.compute_s - m.draft_s) / m.prefill_tokens,
                                  m.prefill_tokens)
        if m.decode:
            # verification: the time neither blocked on the link (nor on the host's partials)
            # nor drafting
            verify = max(0.0, m.wall_s - m.host_wait_s - m.wait_s - m.draft_s)
            shaper.observe_step(plan, out, self.history_link_s(m), verify, m.draft_s,
                                bool(m.prefill_tokens))

    def history_link_s(self, m: StepMeasures) -> float:
        """The link time of a step's history (host to device): what a decode round's shape
        weighs against its compute. Not the link's busy time, which also counts the KV a
        prefill chunk writes out: after every new request's prefill over a slow link, rounds
        that move nothing looked link-bound and the deepest tree free."""
        return m.history_bytes / self.link_bps if self.link_bps > 0 else m.link_busy_s

    def _observe_link_bound(self, plan: StepPlan, m: StepMeasures) -> None:
        """After a decode round with no prefill chunk: its history's time over its
        verification time (neither blocked on the link or the host nor drafting). The
        history's time is the longer of its two paths as they ran, the link's share and the
        host's (host attention reads the rest where it lives, merged or not); counting the
        host's bytes as link time called c01's rounds of seven link-bound (70 ms of history
        against 33 ms of verification) where the link carried 17 ms of it and the host 5,
        and split them into groups of three and four. A step that only drafted (its
        group had nothing to verify) is no round: its ratio of nothing over nothing read as 0
        and pulled the average of a slow link's rounds towards a merge."""
        if not m.decode or m.prefill_tokens or not _verifies(plan):
            return
        verify_s = m.wall_s - m.wait_s - m.draft_s - m.host_wait_s
        if verify_s <= 0:
            return
        history_s = max(m.history_bytes / self.link_bps, m.host_busy_s if m.host_bytes else 0.0)
        ratio = self.link_over_verify.add(history_s / verify_s)
        if self.link_bound and ratio < MERGE_BELOW:
            self.link_bound = False
        elif not self.link_bound and ratio > SPLIT_ABOVE:
            self.link_bound = True

    def _observe_host(self, plan: StepPlan, m: StepMeasures) -> None:
        """After a decode round with cold history and no prefill chunk: whether it is
        link-bound (streaming all of it, what the host attended included, would take longer
        than the device's compute, its wait for the host excluded), the host's idle time, and
        what the round-shape policy weighs its shapes' host time with. A round that also
        prefilled says nothing of this: its chunk's compute would call every such round
        compute-bound and take the host's share away from the decode rounds after it."""
        cold = m.history_bytes + m.host_bytes
        if not (m.decode and not m.prefill_tokens and cold and m.host_attends):
            return
        self.host_pays = cold / self.link_bps > m.compute_s - m.host_wait_s
        self.host_pays_of.update((s.request_id, self.host_pays) for s in plan.seqs
                                 if s.sample and not s.prefill)
        if m.host_bytes:
            self.host_serial.add(m.host_serial_s)
        if self.shaper is not None:
            verified = sum(1 for s in plan.seqs if s.sample and not s.prefill)
            cost = self.host_cost.coef() if self.host_pays and self.host_cost.n else None
            self.shaper.observe_host(
                cold / max(1, verified), self.link_bps,
                None if cost is None else HostCosts(*cost, self.host_serial.value))
