"""`speculative_policy = "auto"`: the shape of each round's drafts, chosen from measurements.

The engine feeds every verification round in (``observe``): how long its parts took, how many
query positions and draft tokens it had, how many drafts each request had accepted. The
shaper keeps the estimates the cost model (``spec/round_shape.py``) reads: per-token
acceptance (decayed counts, the model card's figure as prior), the link time of a round, the
verification time as ``a + b x query positions`` and a draft forward's as ``c + d x tokens``
(both exponentially weighted least squares). Before each step the scheduler asks it for the
shape (``shape``): the candidate with the most expected tokens per second among chains of
depth 0 (no speculation) to ``max_depth`` and, where token trees are allowed
(``max_topk`` > 1), trees of that branching with 2, 4, 8 ... times their depth in nodes up to
``max_nodes``. Tree rounds teach it acceptance by rank (which of a node's children the target
took). Pure Python: it sees numbers, never tensors.

Probing and exploration: the first rounds draft half the allowed depth (acceptance and draft
cost), then one round drafts nothing (a second point for the verification line: its slope is
what tells a compute-bound round, where every position costs, from a link-bound one); then the
model decides. While the choice is 0 nothing is drafted and nothing new is learnt about
acceptance, so every ``explore_every``-th decision drafts one token (the cheapest probe; the
model extends a chain's acceptance by position from it). Probes and explorations draft for one
request of the step only (``probing``): a request's first drafts make the draft prefill its
window, which is wasted wherever speculation turns out not to pay.
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
    max_topk: int = 1  # speculative_topk: trees of this branching allowed when > 1
    max_nodes: int = 0  # speculative_num_draft_tokens: a tree's node budget at most
    prior_acceptance: float = 0.6  # per-token acceptance before any round is seen
    explore_every: int = 32
    probe_rounds: int = 3
    acceptance: AcceptanceEstimate = field(init=False)
    link_s: float = 0.0
    verify: _LineFit = field(default_factory=_LineFit)
    draft: _LineFit = field(default_factory=_LineFit)
    decisions: int = 0
    chosen: dict[int, int] = field(default_factory=dict)  # depth -> rounds it was chosen
    chosen_nodes: dict[int, int] = field(default_factory=dict)  # nodes -> rounds (trees too)
    probing: bool = False  # the last shape is a probe: one request of the step drafts it

    def __post_init__(self) -> None:
        # the prior by rank: the first candidate as the model card's per-token figure, the
        # others a quarter of the one before
        a = self.prior_acceptance
        self.acceptance = AcceptanceEstimate(prior=(a, a / 4, a / 16, a / 64),
                                             prior_weight=20.0, decay=0.995)
        depths = sorted({d for d in DEPTHS if d <= self.max_depth} | {self.max_depth})
        self.candidates = [Shape(d) for d in depths]
        if self.max_topk > 1:
            for d in (d for d in depths if d):
                n = 2 * d
                while n <= self.max_nodes:
                    self.candidates.append(Shape(d, topk=self.max_topk, nodes=n))
                    n *= 2
                if self.max_nodes > d and Shape(d, self.max_topk, self.max_nodes) not in (
                        self.candidates):
                    self.candidates.append(Shape(d, topk=self.max_topk, nodes=self.max_nodes))

    def observe(self, link_s: float, verify_s: float, query_tokens: int,
                draft_steps: Sequence[int], draft_s: float,
                verified: Sequence[tuple[int, int]],
                tree_walks: Sequence[Sequence[tuple[int, int | None]]] = ()) -> None:
        """One decode step: its link busy time, verification time and query positions, the
        draft tokens of each of its draft forwards and their time, per verified chain request
        (drafts, accepted), and per verified tree its walk ((children, rank taken) of each
        node reached)."""
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
        for walk in tree_walks:
            for children, rank in walk:
                self.acceptance.observe(children, rank)

    def costs(self) -> RoundCosts:
        va, vb = self.verify.coef()
        da, db = self.draft.coef()
        return RoundCosts(link_s=self.link_s, verify_base_s=va, verify_per_position_s=vb,
                          draft_level_s=da, draft_per_node_s=db)

    def shape(self, num_requests: int) -> Shape:
        """The drafts' shape for the next round of ``num_requests`` verified requests."""
        self.decisions += 1
        self.probing = False
        if self.decisions <= self.probe_rounds or self.draft.n == 0:
            pick, self.probing = Shape(max(1, self.max_depth // 2)), True
        elif self.decisions == self.probe_rounds + 1:
            pick = Shape(0)
        else:
            pick = choose(self.candidates, max(1, num_requests), self.costs(), self.acceptance,
                          self.drafting)
            if pick.depth == 0 and self.decisions % self.explore_every == 0:
                pick, self.probing = Shape(1), True
        self.chosen[pick.depth] = self.chosen.get(pick.depth, 0) + 1
        self.chosen_nodes[pick.num_nodes] = self.chosen_nodes.get(pick.num_nodes, 0) + 1
        return pick
