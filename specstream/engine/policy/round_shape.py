"""The shape of a round: how many draft positions to verify, chosen from what the engine measures.

A round verifies, per request, a chain of ``depth`` drafts or a tree of ``nodes`` drafts
(``topk`` children per expanded node, at most ``depth`` deep); ``depth = 0`` is no speculation.
What a shape buys is expected tokens per request per round; what it costs is round time:

- tokens: with acceptance ``beta[r]`` (the probability that the target's choice is the draft's
  rank-``r`` candidate at a node whose path was accepted; ``beta[0]`` is a chain's per-token
  acceptance), a node on a path of ranks ``r_1 .. r_d`` is accepted with probability
  ``prod beta[r_i]``, and a round yields ``1 + sum over nodes`` tokens in expectation (the
  bonus or recovered token is the 1). The best tree for a node budget takes the nodes of the
  highest such probability (Sequoia's dynamic program reduces to this greedy choice when
  acceptance depends on the rank only), so ``expected_tokens`` builds exactly that tree.
- time: ``max(link, verify) + draft`` when drafting is serial (``offload-spec``, ``resident``),
  ``max(link, verify + draft)`` when it runs in the link's gaps (``specstream``; the draft of
  one group fills the other group's transfers), ``max(link, verify, draft)`` on a second
  device; verify = ``a + b x query positions``, draft = ``f + levels x (c + d x nodes per
  level)`` (``f``: once a round, its first forward feeding what the last round accepted).

``choose`` maximises tokens per second over the candidate shapes; everything it reads is an
estimate the engine keeps current (``RoundCosts``, ``AcceptanceEstimate``). Pure Python.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from specstream.options import Drafting


def transfer_s(cold_bytes: float, link_bps: float, seconds_per_byte: float,
               serial_s: float) -> float:
    """A round's time on its cold history with the best split (the link alone where the host
    cannot help): the longer of the two paths when both finish together."""
    if cold_bytes <= 0 or link_bps <= 0:
        return 0.0
    link_only = cold_bytes / link_bps
    if seconds_per_byte <= 0:
        return link_only
    host = (link_only - serial_s) / (1 / link_bps + seconds_per_byte)
    if host <= 0:
        return link_only
    host = min(host, cold_bytes)
    return max((cold_bytes - host) / link_bps, serial_s + host * seconds_per_byte)


@dataclass(frozen=True)
class Shape:
    depth: int  # the deepest draft; 0 = no speculation
    topk: int = 1  # children per expanded node; 1 = a chain
    nodes: int = 0  # draft positions per request (a chain: depth)

    def __post_init__(self) -> None:
        if self.depth < 0 or self.topk < 1:
            raise ValueError(f"bad shape {self}")
        if self.topk == 1 and self.nodes not in (0, self.depth):
            raise ValueError(f"a chain of depth {self.depth} has {self.depth} nodes")

    @property
    def num_nodes(self) -> int:  # draft positions per request
        return self.depth if self.topk == 1 else self.nodes

    @property
    def levels(self) -> int:
        """Draft forwards a round of this shape costs (one per depth level)."""
        return self.depth


@dataclass
class AcceptanceEstimate:
    """Acceptance by candidate rank, as exponentially weighted counts with a prior, and the
    first candidate's by depth, each depth's counts shrunk towards the pooled estimate.

    By depth because a draft's acceptance is not flat along a path: a draft that has matched
    the target so far tends to keep matching (in the matrix's cell c11, chains of 2 imply
    0.72 a token, chains of 4 0.80). A pooled figure, dominated by the many shallow nodes,
    mixes the depths; each depth's own counts, with the pooled estimate as their prior
    (``depth_weight`` observations), do not."""

    prior: Sequence[float] = (0.6, 0.12, 0.05, 0.03)  # beta by rank (the first: a chain's)
    prior_weight: float = 20.0  # the prior counts as this many observations
    decay: float = 0.995  # per observation: old rounds fade
    depth_weight: float = 8.0  # the pooled estimate counts as this many at each depth
    hits: list[float] = field(default_factory=list)
    tries: list[float] = field(default_factory=list)
    # the first candidate at depth d + 1 (1: the drafts right after the last sampled token)
    depth_hits: list[float] = field(default_factory=list)
    depth_tries: list[float] = field(default_factory=list)
    # ``table``'s and ``expected_tokens``'s answers since the last observation (a decision
    # prices ~40 shapes; while nothing is drafted, nothing is observed)
    _memo: dict[tuple[int, int], list[list[float]]] = field(default_factory=dict, repr=False)
    _expected: dict[Shape, float] = field(default_factory=dict, repr=False)

    def pooled(self, rank: int) -> float:
        """The rank-``rank`` candidate's acceptance over every depth."""
        p = self.prior[rank] if rank < len(self.prior) else self.prior[-1] / 2 ** (
            rank - len(self.prior) + 1)
        h = self.hits[rank] if rank < len(self.hits) else 0.0
        t = self.tries[rank] if rank < len(self.tries) else 0.0
        return (h + p * self.prior_weight) / (t + self.prior_weight)

    def beta(self, rank: int, depth: int = 0) -> float:
        """Probability that the target's token is the draft's rank-``rank`` candidate (0 =
        its first choice) at a node whose path was accepted, ``depth`` levels below the last
        sampled token (0: pooled over depths). The other ranks share what the first leaves
        in the proportions pooled over depths."""
        first = self.pooled(0)
        d = depth - 1
        at_depth = first
        if 0 <= d < len(self.depth_tries):
            at_depth = ((self.depth_hits[d] + first * self.depth_weight)
                        / (self.depth_tries[d] + self.depth_weight))
        if rank == 0:
            return at_depth
        rest = self.pooled(rank)
        return rest * (1 - at_depth) / (1 - first) if first < 1 else rest

    def table(self, depth: int, topk: int) -> list[list[float]]:
        """``beta(r, d)`` for depths 0 .. ``depth`` and ranks below ``topk``, as [d][r]."""
        key = (depth, topk)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = [[self.beta(r, d) for r in range(topk)]
                                     for d in range(depth + 1)]
        return got

    def observed(self) -> float:
        """Observations of the first candidate so far (decayed; the prior not counted)."""
        return self.tries[0] if self.tries else 0.0

    def data_led(self) -> AcceptanceEstimate:
        """What the rounds say: the same counts, the prior worth one observation and every
        rank's scaled to the first candidate's figure they give."""
        led = replace(self, prior_weight=1.0, _memo={}, _expected={})
        k = led.pooled(0) / self.prior[0] if self.prior[0] else 1.0
        led.prior = tuple(p * k for p in self.prior)  # nothing priced on it yet: no memo
        return led

    def observe(self, num_candidates: int, matched_rank: int | None, depth: int = 0) -> None:
        """One verified node whose path was accepted, ``depth`` levels down (0: not known):
        the draft offered ``num_candidates`` candidates for the next token and the target's
        was ``matched_rank`` (or none)."""
        self._memo.clear()
        self._expected.clear()
        while len(self.tries) < num_candidates:
            self.tries.append(0.0)
            self.hits.append(0.0)
        for r in range(len(self.tries)):
            self.tries[r] *= self.decay
            self.hits[r] *= self.decay
        for r in range(num_candidates):
            self.tries[r] += 1.0
        if matched_rank is not None and matched_rank < num_candidates:
            self.hits[matched_rank] += 1.0
        if depth > 0 and num_candidates:
            while len(self.depth_tries) < depth:
                self.depth_tries.append(0.0)
                self.depth_hits.append(0.0)
            d = depth - 1
            self.depth_tries[d] = self.depth_tries[d] * self.decay + 1.0
            self.depth_hits[d] = self.depth_hits[d] * self.decay + (matched_rank == 0)

    def observe_chain(self, num_drafts: int, num_accepted: int) -> None:
        """A chain round: drafts 1..num_accepted matched, the next one (if any) did not."""
        for d in range(min(num_accepted + 1, num_drafts)):
            self.observe(1, 0 if d < num_accepted else None, depth=d + 1)

    def observe_walk(self, walk: Sequence[tuple[int, int | None]]) -> None:
        """A tree round's walk: (children, rank taken) of each node reached, root first."""
        for d, (children, rank) in enumerate(walk):
            self.observe(children, rank, depth=d + 1)


def expected_tokens(shape: Shape, acc: AcceptanceEstimate) -> float:
    """Expected tokens one request gets from a round of ``shape`` (accepted drafts + 1)."""
    if shape.depth == 0:
        return 1.0
    got = acc._expected.get(shape)
    if got is None:
        got = acc._expected[shape] = _expected_tokens(shape, acc)
    return got


def _expected_tokens(shape: Shape, acc: AcceptanceEstimate) -> float:
    betas = acc.table(shape.depth, shape.topk)
    if shape.topk == 1:
        total, p = 1.0, 1.0
        for d in range(1, shape.depth + 1):
            p *= betas[d][0]
            total += p
        return total
    # the best tree: nodes by path probability, children of accepted-so-far nodes (a node is
    # never likelier than its parent or its earlier sibling, so the greedy set is a tree)
    heap: list[tuple[float, int, int]] = [(-betas[1][0], 1, 0)]  # (-prob, depth, rank)
    total, count = 1.0, 0
    while heap and count < shape.nodes:
        neg, depth, rank = heapq.heappop(heap)
        prob = -neg
        total += prob
        count += 1
        if rank + 1 < shape.topk:  # the next sibling
            b = betas[depth]
            heapq.heappush(heap, (-prob / b[rank] * b[rank + 1], depth, rank + 1))
        if depth < shape.depth:  # the first child
            heapq.heappush(heap, (-prob * betas[depth + 1][0], depth + 1, 0))
    return total


@dataclass(frozen=True)
class HostCosts:
    """Host attention as measured: seconds per KV byte as a line in a request's query
    positions, and the device time of a round during which the host has nothing to do."""

    seconds_per_byte: float  # the fixed part
    seconds_per_byte_per_position: float
    serial_s: float

    def per_byte(self, positions: int) -> float:
        return self.seconds_per_byte + self.seconds_per_byte_per_position * positions


@dataclass
class RoundCosts:
    """Seconds a round's parts take, as the engine last measured them (EWMA)."""
    link_s: float = 0.0  # the round's history over the link
    verify_base_s: float = 0.0  # verification: fixed part
    verify_per_position_s: float = 0.0  # ... per query position (all requests)
    verify_per_request_s: float = 0.0  # ... and per request verified (its history's reads)
    draft_level_s: float = 0.0  # one draft forward: fixed part
    draft_per_node_s: float = 0.0  # ... and per node drafted in it (all requests)
    draft_round_s: float = 0.0  # ... and once a round (the first forward feeds the accepted)
    # the draft catching up on tokens it has not seen, spread over the rounds that follow: per
    draft_setup_s: float = 0.0  # round and per token a request gets from it (``tokens``)
    # host_attention "auto": a verified request's cold history per round, the link's rate, the
    # host's seconds per byte (fixed part, per query position of a request) and the device time
    # the host idles per round; the history takes the split that lets link and host finish
    # together (sched/host_split.py), which depends on the shape (query positions slow the host)
    cold_bytes: float = 0.0
    link_bps: float = 0.0
    host_s_per_byte: float = 0.0
    host_s_per_byte_per_position: float = 0.0
    host_serial_s: float = 0.0
    # a roofline: N positions take N prefill tokens' time at least (a line fitted on rounds of
    # a few positions, memory-bound, priced 165 as free in c01)
    verify_floor_per_position_s: float = 0.0

    def history_s(self, shape: Shape, num_requests: int) -> float:
        """The round's time on its cold history: over the link, or split with the host."""
        if not (self.host_s_per_byte and self.link_bps and self.cold_bytes):
            return self.link_s
        per_byte = (self.host_s_per_byte
                    + self.host_s_per_byte_per_position * (1 + shape.num_nodes))
        return transfer_s(num_requests * self.cold_bytes, self.link_bps, per_byte,
                          self.host_serial_s)

    def draft_s(self, shape: Shape, num_requests: int, tokens: float = 1.0) -> float:
        """The draft forwards of ``shape`` for ``num_requests`` requests (0: no drafts), and
        the catching up charged to a round that gives each request ``tokens`` tokens."""
        if not shape.depth:
            return 0.0
        per_level = num_requests * shape.num_nodes / shape.levels
        return (self.draft_round_s
                + shape.levels * (self.draft_level_s + self.draft_per_node_s * per_level)
                + self.draft_setup_s * tokens)

    def round_s(self, shape: Shape, num_requests: int, drafting: str,
                tokens: float = 1.0) -> float:
        """A round of ``shape`` for ``num_requests`` requests, each getting ``tokens`` tokens
        from it (what the catching up charged to it scales with: ``draft_setup_s``)."""
        link = self.history_s(shape, num_requests)
        positions = num_requests * (1 + shape.num_nodes)
        verify = max(self.verify_base_s + self.verify_per_request_s * num_requests + positions
                     * self.verify_per_position_s, self.verify_floor_per_position_s * positions)
        draft = self.draft_s(shape, num_requests, tokens)
        if drafting is Drafting.GAPS:
            return max(link, verify + draft)
        if drafting is Drafting.PARALLEL:
            return max(link, verify, draft)
        return max(link, verify) + draft

    def setup_shows(self, shape: Shape, num_requests: int, drafting: str) -> bool:
        """Whether the catching up lengthens a round of ``shape`` (not hidden by the link)."""
        bare = replace(self, draft_setup_s=0.0).round_s(shape, num_requests, drafting)
        return self.round_s(shape, num_requests, drafting) > bare


def choose(candidates: Sequence[Shape], num_requests: int, costs: RoundCosts,
           acc: AcceptanceEstimate, drafting: str = "sequential") -> Shape:
    """The candidate with the most expected tokens per second (ties: the smaller round)."""
    if not candidates:
        raise ValueError("no candidate shapes")

    def rate(s: Shape) -> tuple[float, int]:
        tokens = expected_tokens(s, acc)
        t = costs.round_s(s, num_requests, drafting, tokens)
        return (num_requests * tokens / t if t > 0 else float("inf"), -s.num_nodes)

    return max(candidates, key=rate)
