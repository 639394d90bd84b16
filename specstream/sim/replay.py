"""Step-level replay of the engine's scheduler, costed with a bench run's measured steps.

``specstream bench`` on one CPU thread is not in the round pipeline's steady state: every request
arrives at t=0, prompts are prefilled in chunks of at most ``max_prefill_tokens`` per step (the
budget shared by all requests, oldest prompt first), and decode rounds of the already-prefilled
requests ride in the same steps. This module replays what ``specstream.engine.scheduler`` does,
step by step:

- admission: FIFO, as many requests as the engine's block reservations admit
  (``engine_concurrency``), a request replaced when one finishes;
- one step = the prefill chunks it gets (the budget goes to the oldest prompt first) + one
  verification of each decoding request; ``restore`` modes verify only as many requests as the
  restore share holds (``restore_token_cap``); ``specstream`` and ``parallel-spec`` verify one of
  two groups per step while the other drafts, so a request verifies every other step, except in
  steps that carry a prefill chunk: those verify every request with drafts, and all of them
  draft right after;
- each verification accepts each draft with the mode's measured acceptance rate (random draws;
  ``replay_mean`` averages over seeds);
- residency: a run whose settings say ``"residency": "fill"`` keeps, before each step, the
  newest history of the running requests in the device pool (the budget less the staging ring,
  the prefill scratch and the step's new tokens; restore modes also leave two layers of the
  history that still moves), water-filled as the engine's ``_rebalance`` does (each keeps at
  least its resident tail); only the rest crosses the link. Runs without the key are ``tail``.

A step's compute time comes from the mode's measured decode steps (``modes[*].rounds``), fitted
by non-negative least squares on what the step contained: a constant, requests verified, context
tokens attended, prefill tokens and prefill tokens x context (plus the measured total of the
prefill-only steps). Its link time is predicted from the bytes it must move (the host history
of every verified request, plus a prefill chunk's history and write-back in offload modes) over
the measured link rate; the step waits for the part that does not hide behind the fitted
``overlap`` share of its compute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from specstream.sim.calibrate import nnls, residency_of
from specstream.sim.policy import RESTORE_MODES
from specstream.sim.residency import history_capacity, waterfill
from specstream.sim.serving import ModeResult

TWO_GROUP_MODES = frozenset({"specstream", "parallel-spec"})
SEEDS = 16  # acceptance draws the replay averages over
# the columns of a step's feature row (``_row``); the link column is costed by ``overlap``
FEATURES = ("const_s", "per_seq_s", "per_context_token_s", "link_s", "per_prefill_token_s",
            "per_prefill_context_s")


def _row(num_seqs: float, context: float, link_s: float, prefill: float) -> list[float]:
    return [1.0, num_seqs, context, link_s, prefill, prefill * context]


@dataclass(frozen=True)
class StepCost:
    """Wall time of one engine step of a mode, fitted on its measured steps."""

    coef: tuple[float, ...]  # compute: per feature of ``_row`` (the link column unused)
    overlap: float = 0.0  # share of the compute that a step's transfers hide behind

    @classmethod
    def fit(cls, rounds: Sequence[dict[str, Any]],
            prefill_only: tuple[Sequence[Sequence[float]], float] | None = None) -> StepCost:
        """Fit on the measured decode steps, in two parts: the compute (wall - time waiting on
        the link), by non-negative least squares; and the share ``overlap`` of a step's compute
        that its transfers can hide behind (wait = max(0, link - overlap x compute), the best
        fit on a grid over [0, 1]).
        ``prefill_only`` = (the replay's prefill-only steps as feature rows, their measured
        total time): one more row for the compute fit, their sum."""
        link = np.array([r["link_s"] for r in rounds], dtype=float)
        comp = np.array([r["compute_s"] for r in rounds], dtype=float)
        wait = np.array([max(0.0, r["wall_s"] - r["compute_s"]) for r in rounds])
        grid = np.linspace(0.0, 1.0, 101)
        overlap = float(grid[np.argmin([np.sum((wait - np.maximum(0.0, link - h * comp)) ** 2)
                                        for h in grid])])
        rows = [_row(r["num_seqs"] - (1 if r["prefill_tokens"] else 0),
                     r["context_tokens"], 0.0, r["prefill_tokens"]) for r in rounds]
        ys = [r["compute_s"] for r in rounds]
        if prefill_only is not None and len(prefill_only[0]) and prefill_only[1] > 0:
            total = np.sum(np.array(prefill_only[0], dtype=float), axis=0)
            total[3] = 0.0  # prefill-only steps: their link time is in the fitted compute
            rows.append(list(total))
            ys.append(prefill_only[1])
        x, y = np.array(rows, dtype=float), np.array(ys, dtype=float)
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        coef = nnls(x / scale, y) / scale
        return cls(tuple(float(c) for c in coef), overlap)

    def seconds(self, num_seqs: float, context: float, link_s: float, prefill: float) -> float:
        compute = float(np.dot(self.coef, _row(num_seqs, context, 0.0, prefill)))
        return compute + max(0.0, link_s - self.overlap * compute)


@dataclass
class _Req:
    prompt: int
    computed: int = 0
    generated: float = 0.0
    group: int = -1
    drafted: bool = False
    first: float = math.nan
    finish: float = math.nan

    @property
    def in_prefill(self) -> bool:
        return self.computed < self.prompt

    @property
    def context(self) -> float:
        return self.computed + self.generated


@dataclass(frozen=True)
class ReplaySetup:
    """What the replay needs of one mode (all from the bench JSON)."""

    mode: str
    prompts: tuple[int, ...]
    output_len: int
    concurrency: int
    q: int  # drafts per verification
    tokens_per_round: float  # measured mean accepted length, bonus included (for reports)
    acceptance_rate: float  # measured accepted / proposed drafts
    cost: StepCost
    link_bw: float
    kv_bytes: float  # target KV bytes per token, all layers
    resident_tail: int
    offload_threshold: int
    block_size: int = 128
    max_prefill_tokens: int = 1024
    restore_token_cap: int | None = None
    residency: str = "tail"  # "fill": the pool's free blocks keep history (module docstring)
    pool_tokens: float = 0.0  # fill: device KV tokens for requests (budget less staging)
    scratch_tokens: float = 0.0  # fill: kept free while a prompt waits or prefills
    restore_fraction: float = 0.0  # fill, restore modes: two layers of the history that moves
    notes: dict[str, float] = field(default_factory=dict)

    def host_tokens(self, context: float, share: float = 0.0) -> float:
        """Tokens of a request read from the host this step; ``share``: the fill level."""
        if self.mode == "resident":
            return 0.0
        if self.residency != "fill" and context <= self.offload_threshold:
            return 0.0
        cold = context - max(self.resident_tail, share)
        return max(0.0, math.floor(cold / self.block_size) * self.block_size)

    def share(self, needs: Sequence[float], scratch: bool, decoding: int) -> float:
        """The fill level of a step whose running requests need ``needs`` tokens (a prompt
        being prefilled: all of it); 0 in ``tail``."""
        if self.residency != "fill" or self.mode == "resident" or not needs:
            return 0.0
        pool = (self.pool_tokens - (self.scratch_tokens if scratch else 0.0)
                - decoding * (self.q + 1))
        capacity = history_capacity(pool, sum(needs), self.restore_fraction)
        return waterfill(capacity, needs, [min(n, self.resident_tail) for n in needs])


def replay(s: ReplaySetup, record: list[tuple[str, list[float]]] | None = None,
           seed: int = 0) -> ModeResult:
    """Run the engine's schedule for the bench workload; returns the predicted results.

    The schedule does not depend on the costs (all requests arrive at once; admission, chunking
    and groups go by counts), so ``record`` (kind, feature row per step; kind is "decode",
    "prefill-only" or "draft-only") is the same whatever ``s.cost`` is. Each verification
    accepts each of its drafts with the measured acceptance rate (drawn with ``seed``): the
    requests then finish at different steps, as in the engine, and a new request's prefill
    rides along the others' decode steps."""
    rng = np.random.default_rng(seed)
    waiting = [_Req(p) for p in s.prompts]
    running: list[_Req] = []
    done: list[_Req] = []
    now = link_busy = decode_time = 0.0
    rr = parity = 0
    spec = s.mode != "offload"
    two = s.mode in TWO_GROUP_MODES
    offload = s.mode != "resident"
    for _ in range(1_000_000):
        if not waiting and not running:
            break
        while waiting and len(running) < s.concurrency:
            running.append(waiting.pop(0))
        share = s.share([r.prompt if r.in_prefill else r.context for r in running],
                        bool(waiting) or any(r.in_prefill for r in running),
                        sum(not r.in_prefill for r in running))
        group = None
        prefilling = two and any(r.in_prefill for r in running)
        if two and not prefilling:
            ready = {r.group for r in running if not r.in_prefill and r.drafted}
            group = parity if parity in ready or not ready else 1 - parity
            parity = 1 - group
        n = len(running)
        order = [running[(rr + i) % n] for i in range(n)]
        rr += 1
        fcfs = iter([r for r in running if r.in_prefill])  # prefill slots: oldest prompt first
        order = [next(fcfs) if r.in_prefill else r for r in order]
        budget = s.max_prefill_tokens
        history: float | None = s.restore_token_cap
        verified: list[_Req] = []
        chunks: list[tuple[_Req, int]] = []
        context = link_bytes = 0.0
        for r in order:
            if not r.in_prefill and two and (
                    not r.drafted or (group is not None and r.group != group)):
                continue
            host = s.host_tokens(r.context, share)
            if history is not None and host:
                if host > history:
                    continue
                history -= host
            if r.in_prefill:
                take = min(r.prompt - r.computed, budget)
                if take <= 0:
                    continue
                budget -= take
                chunks.append((r, take))
                context += r.computed + take
                link_bytes += (host + (take if offload else 0)) * s.kv_bytes
            else:
                verified.append(r)
                context += r.context + (s.q + 1 if spec else 1)
                link_bytes += host * s.kv_bytes
        drafting = [r for r in running if two and not r.in_prefill and not r.drafted
                    and r not in verified]
        link_s = link_bytes / s.link_bw
        prefill = sum(t for _, t in chunks)
        if not verified and not chunks:  # a step that only drafts the other group
            kind, row = "draft-only", (0.0, 0.0, 0.0, 0.0)
        else:
            kind = "decode" if verified else "prefill-only"
            row = (len(verified), context, link_s, prefill)
        dt = s.cost.seconds(*row)
        if record is not None:
            record.append((kind, _row(*row)))
        now += dt
        if verified:  # the bench's link utilisation: link busy / time, over decode steps
            link_busy += min(link_s, dt)
            decode_time += dt
        for r in verified:
            left = s.output_len - r.generated
            drafts = min(s.q, int(left) - 1) if spec else 0
            r.generated += min(left, 1 + (rng.binomial(drafts, s.acceptance_rate)
                                          if drafts > 0 else 0))
            r.drafted = False
        for r in drafting:
            r.drafted = True
        for r, take in chunks:
            r.computed += take
            if not r.in_prefill:
                r.first, r.generated = now, 1.0
                if two:
                    sizes = [sum(1 for x in running if x.group == g) for g in (0, 1)]
                    r.group = 0 if sizes[0] <= sizes[1] else 1
                r.drafted = not two  # sequential modes draft right after the step
        if prefilling:  # the step's verified and newly prefilled requests draft right after it
            for r in running:
                r.drafted = r.drafted or not r.in_prefill
        for r in running:
            if not r.in_prefill and r.generated >= s.output_len:
                r.finish = now
        done += [r for r in running if not math.isnan(r.finish)]
        running = [r for r in running if math.isnan(r.finish)]
    tokens = s.output_len * len(done)
    tpots = [(r.finish - r.first) / max(1, s.output_len - 1) for r in done]
    return ModeResult(
        mode=s.mode, feasible=True, gpus=2 if s.mode == "parallel-spec" else 1,
        q=0 if not spec else 1, max_concurrency=s.concurrency, admitted=s.concurrency,
        throughput=tokens / now, ttft_s=float(np.median([r.first for r in done])),
        tpot_s=float(np.median(tpots)), makespan_s=now,
        link_utilisation=link_busy / decode_time if decode_time else 0.0,
        round=None,
    )


def engine_concurrency(mode: str, cal: dict[str, Any], block: int, max_prefill: int,
                       max_num_seqs: int = 64, residency: str = "tail") -> int:
    """Requests the engine's scheduler admits at once (``Scheduler._admit``): each reserves
    the device blocks its tail can ever need (``fill``: its resident tail only, the rest is
    shared), out of the device budget less the history reserve (restore: half the budget;
    stream: the staging chunks) and, in offload modes, the scratch blocks kept free for
    prefill chunks."""
    t, eng, w = cal["target"], cal.get("engine", {}), cal["workload"]
    kv = float(t["kv_bytes_per_token"])
    layer = kv / int(t["num_layers"])
    budget = int(cal["device_memory_bytes"])
    history = {"resident": "none", "specstream": "stream"}.get(mode, "restore")
    reserve = {"none": 0, "restore": budget // 2,
               "stream": int(eng.get("staging_buffers", 2)) * int(eng.get("wave_requests", 1))
               * int(eng.get("chunk_tokens", 1024)) * int(layer)}[history]
    blocks = int((budget - reserve) // (block * kv))
    offload = mode != "resident"
    scratch = min(-(-max_prefill // block) + 1, max(2, blocks // 4)) if offload else 0
    total = max(int(c) for c in w["context_lengths"]) + int(w["output_len"])
    step = int(cal.get("q", 4)) + 1
    if offload and residency == "fill":
        tail = min(int(eng.get("resident_tail", 256)) + block, total) + step
    elif offload:
        tail = max(min(total, int(eng.get("offload_threshold", 512))),
                   int(eng.get("resident_tail", 256)) + block) + step
        tail = min(tail, total + step)
    else:
        tail = total + step
    need = -(-tail // block) + 1
    return max(1, min(max_num_seqs, (blocks - scratch) // need))


def setups(data: dict[str, Any]) -> dict[str, ReplaySetup]:
    """One replay setup per measured mode that carries its per-step samples."""
    cal = data["calibration"]
    w, eng = cal["workload"], cal.get("engine", {})
    settings = data.get("settings", {})
    max_prefill = int(eng.get("max_prefill_tokens", settings.get("max_prefill_tokens", 1024)))
    block = int(eng.get("block_size", settings.get("block_size", 128)))
    max_seqs = int(eng.get("max_num_seqs", settings.get("max_num_seqs", 64)))
    t = cal["target"]
    kv = float(t["kv_bytes_per_token"])
    layer_bytes = kv / int(t["num_layers"])
    cap = int(cal["device_memory_bytes"]) // 2 // int(2 * layer_bytes)
    residency = residency_of(data)
    budget = int(settings.get("device_kv_bytes") or cal["device_memory_bytes"])
    out = {}
    for mode, m in data.get("modes", {}).items():
        rounds = m.get("rounds") or []
        if not rounds:
            continue
        n = int(w.get("num_requests") or len(w["context_lengths"]))
        prompts = tuple(int(c) for c in w["context_lengths"])
        prompts = (prompts * -(-n // len(prompts)))[:n]
        conc = min(n, int(w.get("concurrency") or n),
                   engine_concurrency(mode, cal, block, max_prefill, max_seqs, residency))
        # fill: the engine's device pool (RuntimeLayout: the budget less the staging ring in
        # stream modes), in tokens; restore modes leave room for two layers of what moves
        staging = (int(eng.get("staging_buffers", 2)) * int(eng.get("wave_requests", 1))
                   * int(eng.get("chunk_tokens", 1024)) * int(layer_bytes)
                   if mode == "specstream" else 0)
        blocks = (budget - staging) // int(block * kv)
        scratch = min(-(-max_prefill // block) + 1, max(2, blocks // 4))
        setup = ReplaySetup(
            mode=mode, prompts=prompts, output_len=int(w["output_len"]), concurrency=conc,
            q=int(cal.get("q", 4)),
            acceptance_rate=float(m.get("acceptance_rate") or 0.0),
            tokens_per_round=float(m.get("mean_accepted_len") or 1.0),
            cost=StepCost.fit(rounds), link_bw=float(cal["link_bytes_per_s"]), kv_bytes=kv,
            resident_tail=int(eng.get("resident_tail", 256)),
            offload_threshold=int(eng.get("offload_threshold", 512)), block_size=block,
            max_prefill_tokens=max_prefill,
            restore_token_cap=cap if mode in RESTORE_MODES else None,
            residency=residency, pool_tokens=float(blocks * block),
            scratch_tokens=float(scratch * block),
            restore_fraction=min(1.0, 2 / int(t["num_layers"])) if mode in RESTORE_MODES
            else 0.0,
        )
        steps: list[tuple[str, list[float]]] = []
        for seed in range(SEEDS):
            replay(setup, steps, seed)
        only = [[v / SEEDS for v in row] for kind, row in steps if kind == "prefill-only"]
        cost = StepCost.fit(rounds, (only, float(m.get("prefill_only_time_s") or 0.0)))
        out[mode] = replace(setup, cost=cost, notes={
            "steps_decode": sum(k == "decode" for k, _ in steps) / SEEDS,
            "steps_prefill_only": len(only) / SEEDS,
            "steps_mixed": sum(k == "decode" and r[4] > 0 for k, r in steps) / SEEDS})
    return out


def replay_mean(s: ReplaySetup, seeds: int | None = None) -> ModeResult:
    """The replay averaged over ``seeds`` acceptance draws: throughput from the mean makespan;
    TTFT and TPOT (medians per run, as the bench reports p50) and link utilisation averaged."""
    runs = [replay(s, seed=k) for k in range(seeds or SEEDS)]
    span = float(np.mean([r.makespan_s for r in runs]))
    tokens = runs[0].throughput * runs[0].makespan_s
    return replace(runs[0], throughput=tokens / span, makespan_s=span,
                   ttft_s=float(np.mean([r.ttft_s for r in runs])),
                   tpot_s=float(np.mean([r.tpot_s for r in runs])),
                   link_utilisation=float(np.mean([r.link_utilisation for r in runs])))
