"""What drafting costs the rounds after it, measured where a stretch of rounds has no drafts.

On the CPU backend a drafting round leaves the target's next rounds slower (its draft
forwards, like a prefill chunk, push the target's weights and KV out of the caches). A policy
that drafts measures every round in that state: the verification fit read a round without
drafts at the drafting rounds' cost (the matrix's cell c11: 7.5 ms, where a run without a draft
model took 5.9-6.9 ms), and drafted where no speculation was faster. ``PlainRounds`` measures
that cost: in a run of rounds without drafts, the first ``SETTLE`` (right after drafting) over
the fit's price, less the settled ones after them, is the surcharge a drafting round carries
(``hidden_s``, a moving average). The policy adds it to every drafting shape's price and takes
it off the rounds it feeds the fit, which then prices rounds without drafts as they settle.
Where nothing has measured it for ``REMEASURE`` decisions and the choice would flip were the
surcharge ``SURCHARGE_SHARE`` of a round without drafts, the policy runs ``STRETCH`` rounds without
drafts to measure it; decisions that cannot flip pay nothing. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from specstream.engine.policy.estimators import Ewma
from specstream.engine.policy.round_shape import AcceptanceEstimate, RoundCosts, Shape, choose

SETTLE = 2  # rounds without drafts right after a drafting one: still slowed
STRETCH = 5  # a measuring stretch: SETTLE rounds slowed, the rest settled
SURCHARGE_SHARE = 0.3  # the surcharge a stretch is run to rule out, as a plain round's share
REMEASURE = 128  # decisions after the last measurement before a stretch measures again


@dataclass
class PlainRounds:
    run: int = 0  # decode rounds in a row without drafting
    hidden: Ewma = field(default_factory=Ewma)  # a drafting round's surcharge, seconds
    measured_at: int | None = None  # the decision of the last measurement or stretch
    left: int = 0  # rounds of a measuring stretch still to run
    slowed: list[float] = field(default_factory=list)  # this run's residuals over the fit
    settled: list[float] = field(default_factory=list)

    @property
    def hidden_s(self) -> float:
        return self.hidden.value

    def affected(self, drafted: bool) -> bool:
        """Whether a round (``drafted``: it drafted) carries the surcharge."""
        return drafted or self.run < SETTLE

    def observe(self, drafted: bool, verify_s: float, priced_s: float, decision: int) -> float:
        """One decode round: whether it drafted, its verification time and the fit's price
        for it (before it was added). Returns the time the fit reads: the surcharge taken off
        a round that carries it."""
        fit_s = max(0.0, verify_s - self.hidden_s) if self.affected(drafted) else verify_s
        if drafted:
            self._measure(decision)
            self.run = 0
            return fit_s
        (self.slowed if self.run < SETTLE else self.settled).append(verify_s - priced_s)
        self.run += 1
        if self.run == STRETCH:
            self._measure(decision)
        return fit_s

    def _measure(self, decision: int) -> None:
        if self.slowed and self.settled:
            gap = sum(self.slowed) / len(self.slowed) - sum(self.settled) / len(self.settled)
            self.hidden.add(max(0.0, gap))
            self.measured_at = decision
        self.slowed.clear()
        self.settled.clear()

    def due(self, decision: int) -> bool:
        """Whether a stretch would measure anything new."""
        return self.measured_at is None or decision - self.measured_at >= REMEASURE

    def measure_now(self, pick: Shape, num_requests: int, costs: RoundCosts,
                    acc: AcceptanceEstimate, drafting: str, decision: int) -> bool:
        """Whether a measuring stretch starts instead of ``pick`` (a drafting shape): where
        none measured for ``REMEASURE`` decisions and no speculation would win were drafting
        to cost its rounds ``SURCHARGE_SHARE`` of one without drafts more. This round is its first;
        one that measures nothing (its rounds prefilling, say) runs again ``REMEASURE`` on."""
        if not self.due(decision):
            return False
        surcharge = SURCHARGE_SHARE * costs.round_s(Shape(0), num_requests, drafting)
        dearer = replace(costs, draft_round_s=costs.draft_round_s + surcharge)
        if choose([pick, Shape(0)], num_requests, dearer, acc, drafting).depth:
            return False
        self.left, self.measured_at = STRETCH - 1, decision
        return True

    def take(self) -> bool:
        """Whether this round belongs to a measuring stretch (then it counts)."""
        if not self.left:
            return False
        self.left -= 1
        return True
