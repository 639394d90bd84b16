"""Request-level simulation: admission, prefill, then rounds until every request is done.

Requests are admitted FIFO while fewer than ``min(concurrency, max concurrency in memory)`` are
running; admitted requests are prefilled (one after another, on the target device, the cold
part of their KV written to the host behind the compute) before the next round. Each round
takes the steady-state period of ``rounds.best_round`` for the running set (cached per context
bucket; q is the best of the policy's candidates for that round, as a dynamic-q engine picks
it) and gives every request ``tokens_per_round`` tokens (fractional: an expectation).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from specstream.sim.costs import Costs
from specstream.sim.memory import max_concurrency
from specstream.sim.policy import OFFLOAD_MODES, SimPolicy
from specstream.sim.rounds import RoundResult, best_round
from specstream.sim.workload import AcceptanceModel, Workload


@dataclass(frozen=True)
class ModeResult:
    """What a deployment team asks of one mode."""

    mode: str
    feasible: bool  # at least one request of the longest context fits
    gpus: int
    q: int  # the q of most rounds (q is chosen per round unless the policy fixes it)
    max_concurrency: int  # within device memory, at the longest context + output
    admitted: int  # requests in flight at most: min(concurrency, max_concurrency)
    throughput: float  # output tokens/s, end to end (prefill included)
    ttft_s: float  # mean time to first token (queueing + prefill)
    tpot_s: float  # mean time per output token after the first
    link_utilisation: float  # link busy / makespan
    makespan_s: float
    round: RoundResult | None  # the first full-batch round (for verdicts and plots)

    @property
    def throughput_per_gpu(self) -> float:
        return self.throughput / self.gpus


@dataclass
class _Request:
    arrival: float
    context: float
    generated: float = 0.0
    first_token: float = math.nan
    finish: float = math.nan


def _write_back_s(mode: str, costs: Costs, policy: SimPolicy, context: float) -> float:
    """Writing a prefilled prompt's KV to the host: its cold part (``tail``), or all of it
    (``fill``: write-through, so the host holds every request's whole history)."""
    if policy.residency == "fill" and mode in OFFLOAD_MODES:
        tokens = context
    else:
        tokens = policy.cold_tokens(mode, context)
    return tokens * costs.kv_bytes("target") / costs.link_bw


def _prefill_s(mode: str, costs: Costs, policy: SimPolicy, context: float) -> float:
    compute = costs.prefill_s("target", context)
    if mode != "offload":
        compute += costs.prefill_s("draft", context)
    return max(compute, _write_back_s(mode, costs, policy, context))


def simulate_mode(mode: str, costs: Costs, policy: SimPolicy, workload: Workload,
                  acceptance: AcceptanceModel) -> ModeResult:
    """Serve the workload in one mode; returns throughput, latencies and the round used."""
    gpus = costs.gpus + (1 if mode == "parallel-spec" else 0)  # its draft's own device
    peak = workload.max_context + workload.output_len
    max_conc = max_concurrency(mode, costs, policy, peak)
    if max_conc == 0:
        nan = math.nan
        return ModeResult(mode, False, gpus, 0, 0, 0, 0.0, nan, nan, 0.0, nan, None)
    cap = min(workload.concurrency or max_conc, max_conc)
    waiting = [_Request(t, float(c)) for t, c in workload.requests()]
    q_rounds: Counter[int] = Counter()
    cache: dict[tuple[int, ...], RoundResult] = {}
    running: list[_Request] = []
    done: list[_Request] = []
    now = link_busy = 0.0
    first_round: RoundResult | None = None
    bucket = policy.context_bucket
    while waiting or running:
        while waiting and waiting[0].arrival <= now and len(running) < cap:
            req = waiting.pop(0)
            prefill = _prefill_s(mode, costs, policy, req.context)
            now += prefill
            link_busy += min(prefill, _write_back_s(mode, costs, policy, req.context))
            req.first_token, req.generated, req.context = now, 1.0, req.context + 1
            if req.generated >= workload.output_len:
                req.finish = now
                done.append(req)
            else:
                running.append(req)
        if not running and not waiting:
            break
        if not running:
            now = max(now, waiting[0].arrival)
            continue
        key = tuple(sorted(int(r.context // bucket + 1) * bucket for r in running))
        if key not in cache:  # q is chosen per round from the policy's candidates
            cache[key] = best_round(mode, costs, policy, key, acceptance)
        rnd = cache[key]
        q_rounds[rnd.q] += 1
        if first_round is None and len(running) == cap:
            first_round = rnd
        now += rnd.period_s
        link_busy += rnd.link_s
        for r in running:
            r.generated += rnd.tokens_per_round
            r.context += rnd.tokens_per_round
            if r.generated >= workload.output_len:
                r.finish = now
        done += [r for r in running if not math.isnan(r.finish)]
        running = [r for r in running if math.isnan(r.finish)]
    start = min(r.arrival for r in done)
    makespan = max(r.finish for r in done) - start
    tokens = workload.output_len * len(done)
    tpots = [(r.finish - r.first_token) / max(1, workload.output_len - 1) for r in done]
    return ModeResult(
        mode=mode, feasible=True, gpus=gpus, q=q_rounds.most_common(1)[0][0] if q_rounds else 0,
        max_concurrency=max_conc, admitted=cap,
        throughput=tokens / makespan, ttft_s=sum(r.first_token - r.arrival for r in done)
        / len(done), tpot_s=sum(tpots) / len(tpots), link_utilisation=link_busy / makespan,
        makespan_s=makespan, round=first_round or next(iter(cache.values()), None),
    )
