"""`speculative_policy = "auto"`: the depth of each round's chains, chosen from measurements.

The engine feeds every verification round in (``observe``): how long its parts took, how many
query positions and draft tokens it had, how many drafts each request had accepted. The
shaper keeps the estimates the cost model (``spec/round_shape.py``) reads: per-token
acceptance (decayed counts, the model card's figure as prior), the link time of a round, the
verification time as ``a + b x query positions`` and a draft forward's as ``c + d x tokens``
(both exponentially weighted least squares). Before each step the scheduler asks it for the
depth (``depth``): the candidate with the most expected tokens per second, 0 meaning no
speculation. Pure Python: it sees numbers, never tensors.

Probing and exploration: the first rounds draft half the allowed depth (acceptance and draft
cost), then one round drafts nothing (a second point for the verification line: its slope is
what tells a compute-bound round, where every position costs, from a link-bound one); then the
model decides. While the choice is 0 nothing is drafted and nothing new is learnt about
acceptance, so every ``explore_every``-th decision drafts one token (the cheapest probe; the
model extends a chain's acceptance by position from it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specstream.spec.round_shape import AcceptanceEstimate, RoundCosts, Shape, choose

# The reference implementation's choices of q, and twice its largest for link-bound rounds.
DEPTHS = (0, 1, 2, 4, 6, 8, 12, 16)


@dataclass
class _LineFit:
    """y = a + b x by exponentially weighted least squares (b >= 0)."""

    decay: float = 0.95
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def coef(self) -> tuple[float, float]:
        if self.n == 0:
            return 0.0, 0.0
        var = self.n * self.sxx - self.sx**2
        b = max(0.0, (self.n * self.sxy - self.sx * self.sy) / var) if var > 1e-12 else 0.0
        if var <= 1e-12:  # one x so far: all of it is the fixed part
            return self.sy / self.n, 0.0
        return max(0.0, (self.sy - b * self.sx) / self.n), b


@dataclass
class RoundShaper:
    max_depth: int  # num_speculative_tokens: the deepest chain allowed
    drafting: str  # the mode's drafting strategy ("sequential", "gaps", "parallel")
    prior_acceptance: float = 0.6  # per-token acceptance before any round is seen
    explore_every: int = 32
    probe_rounds: int = 3
    acceptance: AcceptanceEstimate = field(init=False)
    link_s: float = 0.0
    verify: _LineFit = field(default_factory=_LineFit)
    draft: _LineFit = field(default_factory=_LineFit)
    decisions: int = 0
    chosen: dict[int, int] = field(default_factory=dict)  # depth -> rounds it was chosen

    def __post_init__(self) -> None:
        self.acceptance = AcceptanceEstimate(prior=(self.prior_acceptance,), prior_weight=20.0,
                                             decay=0.995)
        self.candidates = [Shape(d) for d in DEPTHS if d <= self.max_depth]
        if Shape(self.max_depth) not in self.candidates:
            self.candidates.append(Shape(self.max_depth))

    def observe(self, link_s: float, verify_s: float, query_tokens: int,
                draft_steps: Sequence[int], draft_s: float,
                verified: Sequence[tuple[int, int]]) -> None:
        """One decode step: its link busy time, verification time and query positions, the
        draft tokens of each of its draft forwards and their time, and per verified request
        (drafts, accepted)."""
        if query_tokens:
            self.link_s = 0.7 * self.link_s + 0.3 * link_s if self.decisions else link_s
            self.verify.add(query_tokens, verify_s)
        if draft_steps:
            per = draft_s / len(draft_steps)
            for n in draft_steps:
                self.draft.add(n, per)
        for num_drafts, accepted in verified:
            if num_drafts:
                self.acceptance.observe_chain(num_drafts, accepted)

    def costs(self) -> RoundCosts:
        va, vb = self.verify.coef()
        da, db = self.draft.coef()
        return RoundCosts(link_s=self.link_s, verify_base_s=va, verify_per_position_s=vb,
                          draft_level_s=da, draft_per_node_s=db)

    def depth(self, num_requests: int) -> int:
        """The chain depth for the next round of ``num_requests`` verified requests."""
        self.decisions += 1
        if self.decisions <= self.probe_rounds or self.draft.n == 0:
            pick = max(1, self.max_depth // 2)
        elif self.decisions == self.probe_rounds + 1:
            pick = 0
        else:
            pick = choose(self.candidates, max(1, num_requests), self.costs(), self.acceptance,
                          self.drafting).depth
            if pick == 0 and self.decisions % self.explore_every == 0:
                pick = 1
        self.chosen[pick] = self.chosen.get(pick, 0) + 1
        return pick
