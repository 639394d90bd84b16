"""`speculative_policy = "auto"`: the shape of each round's drafts, chosen from measurements.

The engine feeds every verification round in (``observe``): how long its parts took, how many
query positions and draft tokens it had, how many drafts each request had accepted. The
shaper keeps the estimates the cost model (``policy/round_shape.py``) reads: per-token
acceptance (decayed counts, the model card's figure as prior), the link time of a round, the
verification time as ``a + r x requests + b x query positions`` and a draft forward's as
``c + d x tokens`` (both exponentially weighted least squares). Before each step the scheduler
asks it for the shape (``shape``): the candidate with the most expected tokens per second
among chains of depth 0 (no speculation) to ``max_depth`` and, where token trees are allowed
(``max_topk`` > 1), binary trees and trees of that branching with 2, 4, 8 ... times their
depth in nodes up to ``max_nodes``. Tree rounds teach it acceptance by rank (which of a node's
children the target took). Pure Python: it sees numbers, never tensors.

Probing and exploration: until a verified round has had drafts, rounds draft half the allowed
depth for one request; then the model decides. Where it would have requests catch up a room's
worth of tokens or more (a cost the link does not hide), it decides on the observations alone
(the prior worth one), and until there are as many as the prior is worth, the probe's request
drafts on. Where the first candidate's hits reject the prior's rate (5%, one-sided: a draft
that misses, as on random ids), every decision reads the data alone. Prefill steps teach
acceptance, the link time and the draft's cost, not the verification fit. History read and
query positions are priced apart (a request's history is read once however many positions
attend it); where the rounds do not tell them apart (they differed in request count, not
depth), a query position is priced as a prefill token of the target (``prior_position``).
While the choice is 0, every ``explore_every``-th decision drafts one token for one request
(the cheapest probe; it also gives the verification line a second size). Probes and
explorations draft for one request of the step only (``probing``): a request's first drafts
make the draft prefill its window, wasted where speculation does not pay.

What else a round costs: the draft's catching up on what it has not seen (``catch_up.py``),
what drafting leaves the rounds after it (``plain.py``), and at least a prefill token's time a
query position however cheap the rounds seen so far made one (``compute_token_s``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specstream.config import EngineConfig
from specstream.engine.contract import StepOutput, StepPlan
from specstream.engine.policy.catch_up import CatchUp
from specstream.engine.policy.estimators import Ewma, LineFit, PlaneFit, below_rate
from specstream.engine.policy.plain import PlainRounds
from specstream.engine.policy.round_shape import (
    AcceptanceEstimate,
    HostCosts,
    RoundCosts,
    Shape,
    choose,
)
from specstream.options import SpeculativePolicy

# x1 of the verification fit: a round's history read, in these many tokens (not its request
# count: a fit over request counts reads a short-context round's low cost as a cheap request)
HISTORY_UNIT = 1024
# The reference implementation's choices of q, 3 between them (a chain of 3 verifies nearly as
# fast as one of 2: `bench/policy_replay.py`), and twice the largest for link-bound rounds.
DEPTHS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
FLOOR_TOKENS = 256  # a prefill chunk this long is compute-bound: its time a token is a floor


@dataclass
class RoundShaper:
    max_depth: int  # num_speculative_tokens: the deepest chain allowed
    drafting: str  # the mode's drafting strategy ("sequential", "gaps", "parallel")
    max_topk: int = 1  # speculative_topk: trees of this branching allowed when > 1
    max_nodes: int = 0  # speculative_num_draft_tokens: a tree's node budget at most
    prior_acceptance: float = 0.6  # per-token acceptance before any round is seen
    # ... worth this many observations: few, so that a draft that misses is read as missing
    # soon (twenty took forty rounds); not fewer, lest one unlucky round end a tree that pays
    prior_weight: float = 8.0
    explore_every: int = 32
    acceptance: AcceptanceEstimate = field(init=False)
    link_s: float = 0.0
    # x1 history read (tokens / HISTORY_UNIT, summed over the round's requests; request counts
    # where a caller gives no history), x2 query positions
    verify: PlaneFit = field(default_factory=PlaneFit)
    history_per_request: float = 1.0  # a request's x1: the last round's, or as ``shape`` is told
    prefill_token_s: Ewma = field(default_factory=Ewma)  # the target's prefill, per token
    compute_token_s: Ewma = field(default_factory=Ewma)  # ... of chunks of FLOOR_TOKENS or more
    draft: LineFit = field(default_factory=LineFit)  # a draft forward over its nodes
    # a drafting round over its forwards and nodes (its fixed part: ``draft_coef``)
    draft_round: PlaneFit = field(default_factory=PlaneFit)
    decisions: int = 0
    chosen: dict[int, int] = field(default_factory=dict)  # depth -> rounds it was chosen
    chosen_nodes: dict[int, int] = field(default_factory=dict)  # nodes -> rounds (trees too)
    probing: bool = False  # the last shape is a probe: one request of the step drafts it
    seen_drafts: bool = False  # a verification round with drafts was measured
    link_seen: bool = False  # link_s holds a measurement
    exploring: bool = False  # ... one made while the choice is no speculation
    explored_at: int = 0  # the decision of the last exploration that ran
    explore_share: float = 0.05  # of the time between explorations, the most one may cost
    catch_up: CatchUp = field(default_factory=CatchUp)  # the draft's time a token unseen
    # host_attention auto (observe_host): a verified request's cold bytes per round, the link's
    # rate, the host's costs; None while the host has no share
    host: tuple[float, float, HostCosts] | None = None
    plain: PlainRounds = field(default_factory=PlainRounds)  # no speculation's own price
    _led: tuple[AcceptanceEstimate, tuple[float, float], AcceptanceEstimate] | None = None

    @classmethod
    def for_config(cls, config: EngineConfig) -> RoundShaper | None:
        """The policy of ``speculative_policy="auto"`` (None: fixed, or no speculation)."""
        if not (config.speculative and config.policy is SpeculativePolicy.AUTO):
            return None
        return cls(config.q, config.mode_spec.drafting, config.topk, config.num_draft_tokens)

    def __post_init__(self) -> None:
        # the prior by rank: the first candidate as the model card's per-token figure, the
        # others a quarter of the one before
        a = self.prior_acceptance
        self.acceptance = AcceptanceEstimate(prior=(a, a / 4, a / 16, a / 64),
                                             prior_weight=self.prior_weight, decay=0.995)
        depths = sorted({d for d in DEPTHS if d <= self.max_depth} | {self.max_depth})
        self.candidates = [Shape(d) for d in depths]
        # trees: binary ones and the widest allowed, each with 2, 4, 8 ... times its depth in
        # nodes up to the budget (and the budget itself)
        for k in sorted({min(2, self.max_topk), self.max_topk} - {1}):
            for d in (d for d in depths if d):
                n = 2 * d
                while n <= self.max_nodes:
                    self.candidates.append(Shape(d, topk=k, nodes=n))
                    n *= 2
                if self.max_nodes > d and Shape(d, k, self.max_nodes) not in self.candidates:
                    self.candidates.append(Shape(d, topk=k, nodes=self.max_nodes))

    def observe(self, link_s: float, verify_s: float, query_tokens: int,
                draft_steps: Sequence[float], draft_s: float,
                verified: Sequence[tuple[int, int]],
                tree_walks: Sequence[Sequence[tuple[int, int | None]]] = (),
                num_requests: int | None = None, history_tokens: int | None = None) -> None:
        """One decode step: its history's link time, verification time and query positions
        (of ``num_requests`` requests, None: the verified ones; ``history_tokens``: the history
        they read, None: one unit a request), the draft tokens of each of its draft forwards
        and their time, per verified chain request (drafts, accepted), and per verified tree
        its walk ((children, rank taken) of each node reached)."""
        if verified or tree_walks or query_tokens:  # it verified requests
            self.link_s = 0.7 * self.link_s + 0.3 * link_s if self.link_seen else link_s
            self.link_seen = True
            self.seen_drafts = self.seen_drafts or any(n for n, _ in verified) or any(tree_walks)
        if query_tokens:
            requests = len(verified) + len(tree_walks) if num_requests is None else num_requests
            reads = (max(1, requests) if history_tokens is None
                     else history_tokens / HISTORY_UNIT)
            self.history_per_request = reads / max(1, requests)
            self.verify.add(reads, query_tokens, verify_s)
        if draft_steps:
            per = draft_s / len(draft_steps)
            for n in draft_steps:
                self.draft.add(n, per)
            self.draft_round.add(len(draft_steps), sum(draft_steps), draft_s)
        for num_drafts, accepted in verified:
            if num_drafts:
                self.acceptance.observe_chain(num_drafts, accepted)
        for walk in tree_walks:
            self.acceptance.observe_walk(walk)

    def explore_now(self, catch_up_tokens: int, num_requests: int,
                    rounds_left: float | None = None) -> bool:
        """Whether the exploration due runs (then it counts as run): where feeding the draft
        ``catch_up_tokens`` costs at most ``explore_share`` of the rounds since the last that
        ran (``explore_every`` at least: the catching up grows while the choice sits at 0)
        and of the ``rounds_left`` of the known work, which alone can use what it learns.
        The first probes always run."""
        if not self.exploring:
            return True
        since = min(max(self.explore_every, self.decisions - self.explored_at),
                    float("inf") if rounds_left is None else rounds_left)
        rounds = since * self.costs().round_s(Shape(0), max(1, num_requests), self.drafting)
        if self.catch_up.seconds(catch_up_tokens) > self.explore_share * rounds:
            return False
        self.explored_at = self.decisions
        return True

    def observe_step(self, plan: StepPlan, out: StepOutput, link_s: float, verify_s: float,
                     draft_s: float, prefill: bool) -> None:
        """``observe`` for one decode step of the engine (or the simulator's replay of it).
        The draft's forwards are one per level of its drafts; the first also feeds what the
        draft had not seen. A step where that catching up dominates measures the time per
        token caught up on; the others, less that, measure the forwards (the draft line). A
        step that also carried a prefill chunk teaches acceptance and the draft's cost, not
        the verification line."""
        drafted = {rid: d for rid, d in out.drafts.items() if d}
        levels = out.draft_levels()
        nodes = sum(len(d) for d in drafted.values())
        unseen = sum(w.unseen for w in plan.drafts if w.request_id in drafted)
        steps: list[float] = []
        if unseen > 4 * nodes:
            df, da, db = self.draft_coef()
            forwards = df + levels * da + db * nodes if self.draft.n else 0.0
            self.catch_up.measure(draft_s - forwards, unseen)
        elif levels:
            draft_s = max(0.0, draft_s - self.catch_up.seconds(unseen))
            steps = [nodes / levels] * levels
        done = [s for s in plan.seqs if s.sample and s.request_id in out.new_tokens]
        history = sum(s.start_pos for s in plan.seqs)
        if done and not prefill:  # what drafting cost it (plain.py), off what the fit reads
            va, vr, vb = self.verify.coef()
            verify_s = self.plain.observe(bool(drafted) or draft_s > 0, verify_s, va + vr
                                          * history / HISTORY_UNIT + vb * plan.num_tokens,
                                          self.decisions)
        chains = [(s.num_drafts, len(out.new_tokens[s.request_id]) - 1) for s in done
                  if s.request_id not in out.tree_ranks]
        walks = [out.tree_ranks[s.request_id] for s in done if s.request_id in out.tree_ranks]
        self.observe(link_s, verify_s, 0 if prefill else plan.num_tokens, steps, draft_s,
                     chains, walks, num_requests=len(plan.seqs), history_tokens=history)

    def observe_host(self, cold_bytes: float, link_bps: float, cost: HostCosts | None) -> None:
        """After a decode round with host attention on: a verified request's cold history,
        the link's rate and the host's costs. None: the host has no share (not measured, or
        the round is compute-bound), and the round's history is the link's."""
        has = cost is not None and bool(cost.seconds_per_byte
                                        or cost.seconds_per_byte_per_position)
        self.host = (cold_bytes, link_bps, cost) if has and cost is not None else None

    def prior_position(self, token_s: float, tokens: int = 0) -> None:
        """The target's prefill time a token, on a prefill step of ``tokens``: a query position's
        price where the rounds do not tell positions and requests apart, and (chunks of
        ``FLOOR_TOKENS`` or more: compute-bound) the least one costs (``compute_token_s``)."""
        self.verify.prior_b2 = self.prefill_token_s.add(token_s)
        if tokens >= FLOOR_TOKENS:
            self.compute_token_s.add(token_s)

    def costs(self, catch_up: float = 0.0) -> RoundCosts:
        va, vr, vb = self.verify.coef()
        df, da, db = self.draft_coef()
        host = {}
        if self.host is not None:
            cold, link_bps, c = self.host
            host = dict(cold_bytes=cold, link_bps=link_bps, host_s_per_byte=c.seconds_per_byte,
                        host_s_per_byte_per_position=c.seconds_per_byte_per_position,
                        host_serial_s=c.serial_s)
        return RoundCosts(link_s=self.link_s, verify_base_s=va,
                          verify_per_request_s=vr * self.history_per_request,
                          verify_per_position_s=vb, draft_level_s=da, draft_per_node_s=db,
                          draft_round_s=df + self.plain.hidden_s,
                          draft_setup_s=self.catch_up.seconds(catch_up),
                          verify_floor_per_position_s=self.compute_token_s.value, **host)

    def draft_coef(self) -> tuple[float, float, float]:
        """A drafting round's seconds: once, per forward, per node (where rounds of one depth
        do not tell the first two apart, every second is a forward's)."""
        if self.draft_round.moved(1):
            return self.draft_round.coef()
        return (0.0, *self.draft.coef())

    def draft_s(self, shape: Shape, num_requests: int) -> float | None:
        """The draft forwards of ``shape`` for ``num_requests`` requests (None: none measured)."""
        return self.costs().draft_s(shape, num_requests) if self.draft.n else None

    def _acceptance(self) -> AcceptanceEstimate:
        """What a decision reads: the data alone where they reject the prior (``below_rate``)."""
        a = self.acceptance
        hits = a.hits[0] if a.hits else 0.0
        return self._data_led() if below_rate(hits, a.observed(), self.prior_acceptance) else a

    def _data_led(self) -> AcceptanceEstimate:
        """``acceptance.data_led()``, kept while nothing is observed."""
        a = self.acceptance
        stamp = (a.hits[0] if a.hits else 0.0, a.observed())
        if self._led is None or self._led[0] is not a or self._led[1] != stamp:
            self._led = (a, stamp, a.data_led())
        return self._led[2]

    def shape(self, num_requests: int, catch_up: float = 0.0,
              history_tokens: int | None = None) -> Shape:
        """The drafts' shape for the next round of ``num_requests`` verified requests (whose
        history is ``history_tokens``; None: as the last verified round's). ``catch_up``: the
        tokens the draft must feed before drafting for them, each request's over the tokens
        it has left to generate (drafting's one-off cost spread over the requests' lives,
        counted in every drafting round times the tokens it gives a request)."""
        self.decisions += 1
        self.probing = self.exploring = False
        if history_tokens is not None and num_requests:
            self.history_per_request = history_tokens / HISTORY_UNIT / num_requests
        if self.plain.take():  # a stretch measuring no speculation's price (plain.py)
            pick = Shape(0)
        elif not self.seen_drafts or self.draft.n == 0:
            pick, self.probing = Shape(max(1, self.max_depth // 2)), True
        else:
            n, costs, acc = max(1, num_requests), self.costs(catch_up), self._acceptance()
            pick = choose(self.candidates, n, costs, acc, self.drafting)
            if (pick.depth and catch_up >= 1 and acc is self.acceptance
                    and costs.setup_shows(pick, n, self.drafting)):  # decided on data alone
                if acc.observed() < self.prior_weight:
                    pick, self.probing = Shape(max(1, self.max_depth // 2)), True
                else:
                    acc = self._data_led()
                    pick = choose(self.candidates, n, costs, acc, self.drafting)
            elif pick.depth == 0 and self.decisions % self.explore_every == 0:
                pick, self.probing = Shape(1), True
                self.exploring = True
            if (pick.depth and not self.probing  # the drafts known: measure what they leave
                    and self.acceptance.observed() >= self.prior_weight
                    and self.plain.measure_now(pick, n, costs, acc, self.drafting,
                                               self.decisions)):
                pick = Shape(0)
        self.chosen[pick.depth] = self.chosen.get(pick.depth, 0) + 1
        self.chosen_nodes[pick.num_nodes] = self.chosen_nodes.get(pick.num_nodes, 0) + 1
        return pick
