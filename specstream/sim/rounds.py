"""Run a mode's round graph and measure one steady-state round."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from specstream.engine.policy.round_shape import AcceptanceEstimate, Shape, expected_tokens
from specstream.sim.costs import Costs
from specstream.sim.events import Graph, Task, busy_time
from specstream.sim.pipeline import BUILDERS, Batch
from specstream.sim.policy import STREAM_MODES, SimPolicy, check_mode
from specstream.sim.workload import AcceptanceModel


@dataclass(frozen=True)
class RoundResult:
    """One steady-state round of a batch (every request gets ``tokens_per_round`` tokens)."""

    mode: str
    q: int
    batch: int
    tokens_per_round: float  # per request: accepted drafts + bonus (1 without speculation)
    period_s: float  # time between the ends of two consecutive rounds of the same request
    link_s: float  # link busy time within one period
    verify_s: float  # target compute busy time within one period
    draft_s: float  # draft compute busy time within one period (either device)
    verify_wait_s: float  # time verification sat waiting for restored KV, per period
    link_bytes: float  # history bytes over the link per period (each request's cold KV once)
    tasks: tuple[Task, ...]  # the simulated tasks (for the timeline plot)
    window: tuple[float, float]  # the measured period [t0, t1] within ``tasks``
    shape: Shape | None = None  # the round's shape when given as one (chains: None, q drafts)
    host_s: float = 0.0  # host attention busy time within one period (0: host attention off)
    host_bytes: float = 0.0  # cold history bytes the host attends per period
    host_share: float = 0.0  # the split: fraction of each request's cold history on the host
    host_rate: float = 0.0  # bytes/s the host attends at (sim/host.py)

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.tokens_per_round / self.period_s if self.period_s else 0.0

    @property
    def floor_s(self) -> float:
        """max(link, verify + draft on the target device): no schedule beats this."""
        on_target = self.verify_s + (0.0 if self.mode == "parallel-spec" else self.draft_s)
        return max(self.link_s, on_target)

    @property
    def link_utilisation(self) -> float:
        return self.link_s / self.period_s if self.period_s else 0.0

    @property
    def waits_on_restore(self) -> bool:
        """Verification spends > 5% of the round waiting for the link."""
        return self.verify_wait_s > 0.05 * self.period_s


def _verify_wait(tasks: Sequence[Task], t0: float, t1: float) -> float:
    """Per verify task, the part of its link dependency that it could not hide."""
    total = 0.0
    for t in tasks:
        if t.kind != "verify" or not t0 <= t.start < t1:
            continue
        links = [tasks[d] for d in t.deps if tasks[d].kind == "link"]
        if not links:
            continue
        link = max(links, key=lambda x: x.end)
        others = [tasks[d].end for d in t.deps if tasks[d].kind != "link"]
        total += max(0.0, link.end - max([link.start, *others]))
    return total


def simulate_round(mode: str, costs: Costs, policy: SimPolicy, contexts: Sequence[float],
                   q: int, acceptance: AcceptanceModel, shape: Shape | None = None,
                   estimate: AcceptanceEstimate | None = None, shared: float = 0.0
                   ) -> RoundResult:
    """Simulate ``policy.rounds`` rounds of the batch and measure the steady state.

    ``shape``: the round's shape (a chain or a token tree, the engine's ``Shape``) instead of a
    chain of ``q``; its tokens per round are the engine's ``expected_tokens`` under
    ``estimate`` (acceptance by rank), or ``acceptance`` for a chain without one. ``shared``:
    leading tokens every request's context shares, moved once per verification
    (``Batch.shared``: prefix sharing)."""
    check_mode(mode)
    if not contexts:
        raise ValueError("a round needs at least one request")
    if shape is not None:
        q = shape.num_nodes
    batch = Batch(costs, policy, tuple(float(c) for c in contexts), q, mode, shape,
                  shared=shared)
    if policy.host_attention == "auto" and mode in STREAM_MODES:
        split = replace(batch, host=True)
        if split.split.host_rate > 0:  # auto: host attention only where it pays
            off, on = _run(batch, acceptance, estimate), _run(split, acceptance, estimate)
            return on if on.period_s < off.period_s else off
    return _run(batch, acceptance, estimate)


def _run(batch: Batch, acceptance: AcceptanceModel,
         estimate: AcceptanceEstimate | None) -> RoundResult:
    mode, q, shape, contexts, costs = batch.mode, batch.q, batch.shape, batch.contexts, \
        batch.costs
    if shape is not None and (estimate is not None or shape.topk > 1):
        if estimate is None:
            raise ValueError("a token tree's tokens per round need acceptance by rank")
        tokens = expected_tokens(shape, estimate)
    else:
        tokens = acceptance.expected_tokens(q)
    graph = Graph()
    marks = BUILDERS[mode](graph, batch)
    tasks = graph.run()
    t0, t1 = tasks[marks[-2]].end, tasks[marks[-1]].end
    period = t1 - t0
    draft = busy_time(tasks, "draft_gpu", t0, t1) + sum(
        max(0.0, min(t.end, t1) - max(t.start, t0))
        for t in tasks if t.kind == "draft" and t.resource == "compute")
    verify = sum(max(0.0, min(t.end, t1) - max(t.start, t0))
                 for t in tasks if t.kind == "verify")
    return RoundResult(
        mode=mode, q=q, batch=len(contexts), tokens_per_round=tokens,
        period_s=period, link_s=busy_time(tasks, "link", t0, t1), verify_s=verify,
        draft_s=draft, verify_wait_s=_verify_wait(tasks, t0, t1),
        link_bytes=sum(batch.link_cold(c) for c in contexts) * costs.kv_bytes("target"),
        tasks=tuple(tasks),
        window=(t0, t1), shape=shape,
        host_s=busy_time(tasks, "host", t0, t1),
        host_bytes=sum(batch.cold(c) for c in contexts) * batch.split.share
        * costs.kv_bytes("target"),
        host_share=batch.split.share, host_rate=batch.split.host_rate,
    )


def best_round(mode: str, costs: Costs, policy: SimPolicy, contexts: Sequence[float],
               acceptance: AcceptanceModel, shared: float = 0.0) -> RoundResult:
    """The round at the q (from the policy's candidates) that gives the most tokens/s
    (``shared``: as ``simulate_round``)."""
    results = [simulate_round(mode, costs, policy, contexts, q, acceptance, shared=shared)
               for q in policy.candidate_qs(mode)]
    return max(results, key=lambda r: r.tokens_per_s)
