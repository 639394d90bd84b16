"""The round pipeline of each mode as a task graph, run by the event simulator.

One builder per mode (registered with ``@builder``) lays out ``policy.rounds`` rounds of a batch
as tasks on the ``link`` (copy stream), ``compute`` (target device) and, for parallel-spec,
``draft_gpu`` resources; ``simulate_round`` runs it and measures one steady-state round.
Conventions shared by the builders:

- verification of a group = one target forward over 1 + q query positions per request (a
  chain of q drafts, or a token tree of q nodes: ``Batch.shape``), attending to the request's
  whole context; drafting = one draft forward per level of the shape (q for a chain, the
  tree's depth for a tree), each over that level's share of the nodes per request;
- every copy on the link pays ``link_copy_s`` (a DMA's fixed cost): one per request per layer
  in the restore modes, one per request per chunk per layer in the stream modes;
- a request's cold history (``Batch.cold``: what its tail, or in ``fill`` its share of the free
  device memory, does not keep) crosses the link once per round; a prefix every request of
  the batch shares (``Batch.shared``, prefix sharing) crosses it once per verification for
  all the requests verified together (``Batch.link_cold``), and each of them still attends
  all of it;
- round 0 starts with its drafts already made (the pipeline fill), so the steady state is
  measured between the ends of group 0's verification in the first and last rounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from specstream.engine.policy.round_shape import Shape
from specstream.sim.costs import Costs
from specstream.sim.events import Graph, Task
from specstream.sim.host import HostSplit, host_split
from specstream.sim.memory import MemoryPlan, plan
from specstream.sim.policy import STREAM_MODES, SimPolicy, check_mode

MAX_CHUNKS = 32  # chunks per layer are coarsened past this, to bound the task count


@dataclass(frozen=True)
class Batch:
    """What a builder needs: the costs, the policy, the contexts and q (or a round shape)."""

    costs: Costs
    policy: SimPolicy
    contexts: tuple[float, ...]
    q: int  # drafts per request (a chain); a tree's node count when ``shape`` is one
    mode: str
    # the engine's round shape (engine/policy/round_shape.py); None: Shape(q)
    shape: Shape | None = None
    host: bool = False  # streamed modes: the host attends its share of the cold history
    # leading tokens every request's context shares (one document): prefix sharing moves
    # their cold part once per verification (0: nothing shared, every request its own copy)
    shared: float = 0.0

    @cached_property
    def split(self) -> HostSplit:
        """Link and host rates for this round's cold history (host rate 0 when not ``host``)."""
        return host_split(self.costs, self.positions, self.host)

    @property
    def round_shape(self) -> Shape:
        return self.shape if self.shape is not None else Shape(self.q)

    @property
    def positions(self) -> int:
        """Query positions per request in a verification: the last token and every draft."""
        return 1 + self.round_shape.num_nodes

    @property
    def levels(self) -> int:
        """Draft forwards per round: one per level of the chain or tree."""
        return self.round_shape.levels

    @property
    def level_tokens(self) -> float:
        """Draft tokens per request in one draft forward (a tree's nodes spread over its
        levels)."""
        s = self.round_shape
        return s.num_nodes / s.levels if s.levels else 0.0

    @cached_property
    def memory(self) -> MemoryPlan:
        """Where the batch's KV lives: the restore sub-batch and the fill residency level."""
        return plan(self.mode, self.costs, self.policy, self.contexts, self.shared)

    def cold(self, ctx: float) -> float:
        """Tokens of a request's history that cross the link each round."""
        return self.policy.cold_tokens(self.mode, ctx, self.memory.share)

    @property
    def sharers(self) -> float:
        """Requests one verification covers, on average: a group (specstream,
        parallel-spec: two), within it a restore sub-batch (restore modes); they read one copy
        of the shared prefix."""
        n = len(self.contexts)
        grouped = self.mode in ("specstream", "parallel-spec")
        groups = min(self.policy.groups, n) if grouped else 1
        pieces = 1 if self.mode in STREAM_MODES else math.ceil(
            math.ceil(n / groups) / self.memory.sub_batch)
        return n / (groups * pieces)

    def link_cold(self, ctx: float) -> float:
        """Tokens of the cold history that cross the link (the rest the host attends): a
        request's own, and its part of the one copy of the shared prefix its verification
        moves for all its sharers."""
        cold = self.cold(ctx)
        shared = min(self.shared, cold)  # the prefix is the oldest history: cold first
        return (cold - shared * (1.0 - 1.0 / max(1.0, self.sharers))) * (1.0 - self.split.share)

    def attended_cold(self, ctx: float) -> float:
        """Tokens of the cold history that the device attends (all of it, shared or not)."""
        return self.cold(ctx) * (1.0 - self.split.share)

    def host_s(self, ctx: Sequence[float]) -> float:
        """The host's attention over its share of the requests' cold history, all layers."""
        if not self.split.host_rate:
            return 0.0
        tokens = sum(self.cold(x) for x in ctx) * self.split.share
        return tokens * self.costs.kv_bytes("target") / self.split.host_rate

    def groups(self, n: int) -> list[tuple[float, ...]]:
        """Split the requests round-robin into at most n non-empty groups."""
        n = max(1, min(n, len(self.contexts)))
        return [self.contexts[i::n] for i in range(n)]

    def verify_s(self, ctx: Sequence[float]) -> float:
        """Target forward over ``positions`` tokens per request (1 when not speculating)."""
        c = self.costs
        n = len(ctx) * self.positions
        return c.linear_s("target", n) + c.attention_s("target", self.positions, sum(ctx) + n)

    def draft_step_s(self, ctx: Sequence[float]) -> float:
        """One draft forward: ``level_tokens`` per request over its windowed draft KV."""
        c, t = self.costs, max(1.0, self.level_tokens)
        window = sum(self.policy.draft_tokens(x) for x in ctx)
        return c.linear_s("draft", len(ctx) * t) + c.attention_s("draft", t, window)

    def link_s(self, ctx: Sequence[float]) -> float:
        """The requests' cold history over the link (less the host's share), with a copy's
        fixed cost per request per layer (restore modes)."""
        c = self.costs
        moving = [x for x in ctx if self.link_cold(x) > 0]
        copies = len(moving) * c.layers("target") * c.link_copy_s
        return sum(self.link_cold(x) for x in moving) * c.kv_bytes("target") / c.link_bw + copies


Builder = Callable[[Graph, Batch], list[int]]
BUILDERS: dict[str, Builder] = {}


def builder(mode: str) -> Callable[[Builder], Builder]:
    """Register a graph builder; it returns the task id ending each round of group 0."""
    def register(fn: Builder) -> Builder:
        BUILDERS[check_mode(mode)] = fn
        return fn
    return register


def _chain(g: Graph, prev: list[int], deps: Sequence[int] = (), **fields: Any) -> int:
    """Add a task that follows ``prev`` (a one-item list updated in place) on its stream."""
    tid = g.add(Task(deps=[*deps, *prev[:1]], **fields))
    prev[:] = [tid]
    return tid


def _sub_batches(b: Batch, ctx: tuple[float, ...]) -> list[tuple[float, ...]]:
    size = b.memory.sub_batch
    return [ctx[i:i + size] for i in range(0, len(ctx), size)]


def _restore_verify(g: Graph, b: Batch, ctx: tuple[float, ...], compute: list[int],
                    link: list[int], after: Sequence[int] = (), **fields: Any) -> int:
    """Restore then verify ``ctx`` as the engine's ``restore`` modes do: layer by layer, the
    next layer's history prefetched while this one is verified, two layers of room (the
    restore of layer l waits for the verification of layer l - 2 to free its slot); the first
    layer's restore starts when the step does; ``after``: what its verification also waits
    for (parallel-spec: the group's drafts). Returns the last verify task."""
    layers = b.costs.layers("target")
    restore, verify = b.link_s(ctx) / layers, b.verify_s(ctx) / layers
    start = compute[:1]  # the step starts after the compute before it
    done: list[int] = []
    for layer in range(layers):
        deps = [done[layer - 2]] if layer >= 2 else list(start)
        got = (_chain(g, link, deps, name=f"restore L{layer}", resource="link",
                      duration=restore, kind="link", **fields) if restore > 0 else None)
        need = ([got] if got is not None else []) + (list(after) if layer == 0 else [])
        done.append(_chain(g, compute, need, name=f"verify L{layer}",
                           resource="compute", duration=verify, kind="verify", **fields))
    return done[-1]


@builder("resident")
@builder("offload")
@builder("offload-spec")
def _sequential(g: Graph, b: Batch) -> list[int]:
    """One stream of steps: restore layer by layer under the verification (``_restore_verify``;
    nothing to restore in ``resident``), then the q draft steps."""
    compute: list[int] = []
    link: list[int] = []
    marks = []
    for r in range(b.policy.rounds):
        for sub in _sub_batches(b, b.contexts):
            last = _restore_verify(g, b, sub, compute, link, round=r)
        marks.append(last)
        for _ in range(b.levels):
            _chain(g, compute, name="draft", resource="compute",
                   duration=b.draft_step_s(b.contexts), kind="draft", round=r)
    return marks


@builder("offload-spec-restore-all")
def _restore_all(g: Graph, b: Batch) -> list[int]:
    """The ablation many systems run: restore the whole history, then verify, then draft, one
    stream, nothing overlaps."""
    prev: list[int] = []
    marks = []
    for r in range(b.policy.rounds):
        for sub in _sub_batches(b, b.contexts):
            if b.link_s(sub) > 0:
                _chain(g, prev, name="restore", resource="link", duration=b.link_s(sub),
                       kind="link", round=r)
            last = _chain(g, prev, name="verify", resource="compute", duration=b.verify_s(sub),
                          kind="verify", round=r)
        marks.append(last)
        for _ in range(b.levels):
            _chain(g, prev, name="draft", resource="compute",
                   duration=b.draft_step_s(b.contexts), kind="draft", round=r)
    return marks


@builder("parallel-spec")
def _parallel(g: Graph, b: Batch) -> list[int]:
    """Target: restore (layer by layer, as offload-spec) and verify per group; the draft GPU
    drafts the other group meanwhile."""
    target: list[int] = []
    link: list[int] = []
    groups = b.groups(b.policy.groups)
    drafted: dict[int, list[int]] = {}
    verified: dict[int, int] = {}
    marks = []
    for r in range(b.policy.rounds):
        for gi, ctx in enumerate(groups):
            draft_prev = [verified[gi]] if gi in verified else []
            for _ in range(b.levels):
                _chain(g, draft_prev, name="draft", resource="draft_gpu",
                       duration=b.draft_step_s(ctx), kind="draft", group=gi, round=r)
            drafted[gi] = draft_prev
            for sub in _sub_batches(b, ctx):
                verified[gi] = _restore_verify(g, b, sub, target, link,
                                               drafted[gi] if r else (), group=gi, round=r)
            if gi == 0:
                marks.append(verified[gi])
    return marks


@builder("specstream")
def _specstream(g: Graph, b: Batch) -> list[int]:
    """Chunks stream layer by layer through the staging ring; each is verified as it lands
    (partial attention, LSE merge); the other group's drafts fill the compute gaps at low
    priority. Verification runs ``corun_slowdown`` slower for sharing the device."""
    return _stream(g, b, gaps=True)


@builder("specstream-sequential")
def _specstream_sequential(g: Graph, b: Batch) -> list[int]:
    """Streamed verification as specstream, one group, its drafts after it on the same
    stream; a round's first copy waits for the step before it to end (the engine issues a
    step's copies when the step starts)."""
    return _stream(g, b, gaps=False)


def _stream(g: Graph, b: Batch, gaps: bool) -> list[int]:
    p, c = b.policy, b.costs
    layers = c.layers("target")
    slow = 1.0 + p.corun_slowdown if gaps else 1.0
    link_prev: list[int] = []
    verify_prev: list[int] = []
    attn_ids: list[int] = []  # every chunk's attention, in link order: frees a staging slot
    groups = b.groups(p.groups if gaps else 1)
    verified: dict[int, int] = {}
    marks = []
    for r in range(p.rounds):
        for gi, ctx in enumerate(groups):
            draft_prev = [verified[gi]] if gi in verified else []
            step = b.draft_step_s(ctx) / c.layers("draft")
            for _ in range(b.levels if r and gaps else 0):
                for _ in range(c.layers("draft")):
                    _chain(g, draft_prev, name="draft", resource="compute", duration=step,
                           kind="draft", group=gi, round=r, priority=1)
            cold = [b.link_cold(x) for x in ctx]  # what streams; the host attends the rest
            attend = sum(map(b.attended_cold, ctx)) / sum(cold) if sum(cold) else 1.0
            host = b.host_s(ctx) / layers
            chunk = max(p.chunk_tokens, math.ceil(max(cold) / MAX_CHUNKS))
            n_chunks = math.ceil(max(cold) / chunk)
            # DMA copies per layer: one per request per (engine-sized) chunk, spread over the
            # coarsened chunks in proportion to their tokens
            copies = sum(math.ceil(x / p.chunk_tokens) for x in cold)
            n = len(ctx) * b.positions
            lin = c.linear_s("target", n) / layers
            hot = sum(ctx) - sum(b.cold(x) for x in ctx) + n
            hot_attn = c.attention_s("target", b.positions, hot) / layers
            step_start = list(verify_prev) if not gaps else []
            for layer in range(layers):
                qkv = _chain(g, verify_prev, name=f"L{layer} qkv+tail", resource="compute",
                             duration=(0.25 * lin + hot_attn) * slow, kind="verify", group=gi,
                             round=r, deps=draft_prev if layer == 0 else [])
                # the queries go down to the host after the projection; its partial results
                # (output, lse per query row) merge before the MLP
                attended = [g.add(Task(name=f"L{layer} host attn", resource="host",
                                       duration=host, kind="host", deps=[qkv], group=gi,
                                       round=r))] if host > 0 else []
                for k in range(n_chunks):
                    tokens = sum(min(chunk, max(0.0, x - k * chunk)) for x in cold)
                    free_slot = attn_ids[-p.staging_buffers:][:1] \
                        if len(attn_ids) >= p.staging_buffers else []
                    if layer == 0 and k == 0:
                        free_slot = [*free_slot, *step_start]
                    copy_s = copies * tokens / sum(cold) * c.link_copy_s if sum(cold) else 0.0
                    link = _chain(g, link_prev, name=f"L{layer} c{k}", resource="link",
                                  duration=tokens * c.kv_bytes("target") / layers / c.link_bw
                                  + copy_s, kind="link", group=gi, round=r, deps=free_slot)
                    # every request attends its whole cold history, shared chunks included
                    attn = c.attention_s("target", b.positions, tokens * attend) / layers
                    attn_ids.append(_chain(g, verify_prev, name=f"L{layer} c{k} attn",
                                           resource="compute", duration=attn * slow,
                                           kind="verify", group=gi, round=r, deps=[link]))
                verified[gi] = _chain(g, verify_prev, attended, name=f"L{layer} merge+mlp",
                                      resource="compute", duration=0.75 * lin * slow,
                                      kind="verify", group=gi, round=r)
            if gi == 0:
                marks.append(verified[gi])
            if not gaps:  # the drafts for the next round, after the verification
                for _ in range(b.levels):
                    _chain(g, verify_prev, name="draft", resource="compute",
                           duration=b.draft_step_s(ctx), kind="draft", group=gi, round=r)
    return marks
