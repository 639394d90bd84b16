"""Step-level replay: the engine's own scheduler, a fake worker, and a step cost model.

A ``specstream bench`` run on one CPU thread is not in the round pipeline's steady state (every
request arrives at t=0, prompts are prefilled in chunks that share steps with other requests'
decode rounds, requests finish at different steps). The replay reproduces it by running the
engine's ``Scheduler`` itself (``engine_model.build``: the engine's ``RuntimeLayout``,
``KVManager`` and ``Scheduler``, configured by the bench's own ``BenchSettings``), so
admission, reservations, chunked prefill, the ping-pong groups, the ``fill`` residency, the
round-shape policy (``speculative_policy = "auto"``, through the scheduler's ``RoundShaper``)
and token trees are the engine's code. Each step:

    plan = scheduler.schedule(feedback.estimates())  # the engine's decision
    output = worker.run(plan)                        # fake_worker.py: acceptances drawn
    update = scheduler.update(plan, output)          # the engine's bookkeeping
    clock += cost.seconds(features(plan, output))    # step_cost.py: compute + link wait
    feedback.observe(plan, output, measures)         # the engine's RoundFeedback

and, as ``LLMEngine.step`` does, prefill write-backs are completed; the feedback (the link
rate, a prefill step's compute, the round-shape policy's models) is the engine's own object.
Times are the simulated clock's: TTFT and TPOT per request, throughput over the makespan;
``replay_mean`` averages over acceptance draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from specstream.config import EngineConfig
from specstream.engine.contract import StepMeasures, is_decode_step
from specstream.engine.policy.feedback import RoundFeedback
from specstream.engine.request import Request
from specstream.sampling_params import SamplingParams
from specstream.sim.engine_model import Geometry, build, engine_config
from specstream.sim.fake_worker import TOKEN, FakeWorker
from specstream.sim.host_replay import HostModel
from specstream.sim.serving import ModeResult
from specstream.sim.step_cost import StepCost, StepFeatures, fit_modes
from specstream.sim.workload import AcceptanceModel

SEEDS = 16  # acceptance draws the replay averages over
MAX_STEPS = 1_000_000
# Ablations the engine has no mode for: (engine mode, how its history moves instead)
ABLATIONS = {"offload-spec-restore-all": ("offload-spec", "restore-all")}
PREFIX_TOKEN = TOKEN - 1  # the shared prefix's token (no request's own tokens are this one)


@dataclass(frozen=True)
class ReplaySetup:
    """One mode (or ablation) of one workload."""

    mode: str  # the engine mode, or an ABLATIONS key
    config: EngineConfig
    geometry: Geometry
    prompts: tuple[int, ...]  # prompt lengths, all arriving at t=0 in this order
    output_len: int
    acceptance: AcceptanceModel
    cost: StepCost
    link_bw: float  # host-to-device bytes/s
    # leading prompt tokens every request has in common (one document, one system prompt:
    # the same token ids, so the engine's prefix cache and prefix sharing see them); 0: none
    shared_prefix: int = 0
    # the host's attention costs when the run attended cold history on the host (the config
    # then has host attention on); None: everything cold crosses the link
    host: HostModel | None = None
    # a request run before the measured ones, as the bench's warm-up: (its prompt tokens, the
    # first prompt's leading ones; its output tokens); None: none
    warmup: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.shared_prefix > min(self.prompts, default=0):
            raise ValueError(f"a {self.shared_prefix}-token shared prefix is longer than the "
                             f"shortest prompt ({min(self.prompts)})")
        if (self.host is not None) != self.config.host_attends:
            raise ValueError("give a HostModel exactly when the config attends on the host")

    def prompt_ids(self) -> list[list[int]]:
        """Each request's prompt: the shared prefix, then tokens of its own (distinct prompts,
        as the bench's: no request shares more than the prefix with another)."""
        d = self.shared_prefix
        return [[PREFIX_TOKEN] * d + [TOKEN + 1 + i] * (n - d) for i, n in enumerate(self.prompts)]

    @property
    def history(self) -> str:
        """How the mode's history reaches attention ("none", "restore", "stream", or the
        ablation's "restore-all")."""
        return ABLATIONS[self.mode][1] if self.mode in ABLATIONS else self.config.mode_spec.history


@dataclass
class ReplayRun:
    """One replay: what the bench would have measured, and how the steps went."""

    result: ModeResult
    steps: dict[str, int] = field(default_factory=dict)  # decode, prefill-only, mixed
    shapes: dict[int, int] = field(default_factory=dict)  # auto policy: depth -> rounds
    records: list[StepFeatures] = field(default_factory=list)  # every step (``record``)
    # history over the link per verification round (the bench's ``link_bytes_per_round``)
    link_bytes_per_round: float = 0.0


def replay(s: ReplaySetup, seed: int = 0, record: bool = False) -> ReplayRun:
    """Run the workload through the engine's scheduler on the simulated clock; ``record``
    keeps every step's features (``ReplayRun.records``). Where ``s.warmup`` is set, its
    request runs first, as the bench's warm-up does: the scheduler and the feedback (the
    round-shape policy's models) keep what it taught them, nothing of it is measured."""
    eng = build(s.config, s.geometry)
    feedback = RoundFeedback(s.config, eng.scheduler.shaper, link_bps=s.link_bw)
    worker = FakeWorker(s.acceptance, np.random.default_rng(seed))
    params = SamplingParams(temperature=0.0, max_tokens=s.output_len, ignore_eos=True)
    prompts = s.prompt_ids()
    if s.warmup is not None:
        tokens, out_len = s.warmup
        eng.scheduler.add(Request("warmup", prompts[0][:tokens], replace(
            params, max_tokens=out_len)))
        _Clock(s, eng, feedback, worker).run()
    shaper = eng.scheduler.shaper
    before = dict(shaper.chosen) if shaper is not None else {}  # the warm-up's decisions
    for i, ids in enumerate(prompts):
        eng.scheduler.add(Request(str(i), ids, params))
    clock = _Clock(s, eng, feedback, worker, record)
    clock.run()
    done = [rid for rid in clock.finish if rid in clock.first]
    tpots = [(clock.finish[r] - clock.first[r]) / max(1, s.output_len - 1) for r in done]
    tokens = s.output_len * len(done)
    cfg, now = s.config, clock.now
    spec = cfg.speculative
    result = ModeResult(
        mode=s.mode, feasible=True, gpus=cfg.mode_spec.devices, q=cfg.q if spec else 0,
        max_concurrency=clock.admitted, admitted=clock.admitted,
        throughput=tokens / now if now else 0.0,
        ttft_s=float(np.percentile([clock.first[r] for r in done], 50)),
        tpot_s=float(np.percentile(tpots, 50)), makespan_s=now,
        link_utilisation=clock.link_busy / clock.decode_time if clock.decode_time else 0.0,
        round=None)
    after = dict(shaper.chosen) if shaper is not None else {}
    shapes = {d: n - before.get(d, 0) for d, n in after.items() if n > before.get(d, 0)}
    return ReplayRun(result, clock.steps, shapes, clock.records,
                     clock.verify_bytes / clock.verify_rounds if clock.verify_rounds else 0.0)


@dataclass
class _Clock:
    """The requests the scheduler holds, run to the end on the simulated clock, and what the
    bench would have measured of them."""

    s: ReplaySetup
    eng: Any
    feedback: RoundFeedback
    worker: FakeWorker
    record: bool = False
    now: float = 0.0
    link_busy: float = 0.0
    decode_time: float = 0.0
    admitted: int = 0
    verify_rounds: int = 0
    verify_bytes: float = 0.0
    first: dict[str, float] = field(default_factory=dict)
    finish: dict[str, float] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=lambda: {"decode": 0, "prefill-only": 0,
                                                            "mixed": 0})
    records: list[StepFeatures] = field(default_factory=list)

    def run(self) -> None:
        s, eng, feedback = self.s, self.eng, self.feedback
        sched = eng.scheduler
        block_bytes, layers = eng.layout.block_bytes, s.geometry.num_layers
        idle = 0
        for _ in range(MAX_STEPS):
            if not sched.has_work():
                return
            plan = sched.schedule(feedback.estimates())
            self.admitted = max(self.admitted, len(sched.running))
            link_bytes = eng.link_bytes(plan)  # before the step changes what lives where
            out = self.worker.run(plan)
            f = StepFeatures.of_step(plan, out, link_bytes, layers, s.history,
                                     eng.layout.wave_requests)  # as the ring was built
            update = sched.update(plan, out)
            if update.writebacks:  # a prefill chunk's blocks, copied right after the step
                f = replace(f, writeback_bytes=sum(len(p) for p in update.writebacks.values())
                            * eng.layout.block_bytes)
                sched.complete_writebacks(update.writebacks, {})
            wall, compute, link = s.cost.seconds(f, s.link_bw)
            draft = s.cost.compute_s(f)[1]
            jobs = s.host.jobs(plan, block_bytes, layers) if s.host is not None else ()
            host_s = sum(t for _, t, _ in jobs)
            host_wait = 0.0
            if s.host is not None:  # the host's partials, side by side with the link's waves
                link_wait = wall - compute - f.writeback_bytes / s.link_bw
                host_wait = max(0.0, s.host.wait_s(host_s, compute - draft) - link_wait)
                wall += host_wait
            self.now += wall
            if self.record:
                self.records.append(f)
            decode = is_decode_step(plan, out)
            feedback.observe(plan, out, StepMeasures(
                wall_s=wall, wait_s=wall - compute - host_wait, draft_s=draft,
                link_busy_s=link, link_bytes=int(f.history_bytes + f.writeback_bytes),
                history_bytes=int(f.history_bytes), prefill_tokens=int(f.prefill_tokens),
                decode=decode, host_attends=s.host is not None,
                host_bytes=sum(n for _, _, n in jobs), host_busy_s=host_s,
                host_wait_s=host_wait,
                host_serial_s=(s.host.serial_share * (compute - draft) if s.host else 0.0),
                host_jobs=jobs))
            if not decode and not f.prefill_tokens:
                idle += 1
                if idle > 1000:
                    raise RuntimeError(f"{s.mode}: the scheduler makes no progress")
                continue
            idle = 0
            if decode:
                self.steps["mixed" if f.prefill_tokens else "decode"] += 1
                self.verify_rounds += bool(plan.seqs)
                self.verify_bytes += f.history_bytes if plan.seqs else 0.0
                self.link_busy += min(link, wall)
                self.decode_time += wall
            else:
                self.steps["prefill-only"] += 1
            for req in update.touched:
                rid = req.request_id
                if req.first_token_time is not None and rid not in self.first:
                    self.first[rid] = self.now
                if req.finished:
                    self.finish[rid] = self.now
        raise RuntimeError(f"{s.mode}: no end after {MAX_STEPS} steps")


def replay_mean(s: ReplaySetup, seeds: int | None = None) -> ReplayRun:
    """The replay averaged over ``seeds`` acceptance draws: throughput from the mean makespan;
    TTFT and TPOT (medians per run, as the bench reports p50) and link utilisation averaged."""
    runs = [replay(s, seed=k) for k in range(seeds or SEEDS)]
    rs = [r.result for r in runs]
    span = float(np.mean([r.makespan_s for r in rs]))
    tokens = rs[0].throughput * rs[0].makespan_s
    result = replace(rs[0], throughput=tokens / span if span else 0.0, makespan_s=span,
                     ttft_s=float(np.mean([r.ttft_s for r in rs])),
                     tpot_s=float(np.mean([r.tpot_s for r in rs])),
                     link_utilisation=float(np.mean([r.link_utilisation for r in rs])))
    steps = {k: round(float(np.mean([r.steps[k] for r in runs]))) for k in runs[0].steps}
    shapes: dict[int, int] = {}
    for r in runs:
        for depth, n in r.shapes.items():
            shapes[depth] = shapes.get(depth, 0) + n
    return ReplayRun(result, steps, shapes,
                     link_bytes_per_round=float(np.mean([r.link_bytes_per_round for r in runs])))


# ---- a bench JSON as replay setups ---------------------------------------------------------
def acceptance_of(data: dict[str, Any]) -> AcceptanceModel:
    """The run's acceptance by position: its measured histogram where the file has one, else
    the i.i.d. rate that gives the speculative modes' measured mean accepted lengths, each at
    the depths its rounds ran (``speculative_depth_chosen`` under ``auto``; q otherwise).
    Not the calibration's ``alpha`` (accepted / proposed drafts, which is lower: a chain stops
    at its first rejection), and not every round at q: under ``auto`` the engine chose depths
    1 and 2 for many rounds, which cap what a round can yield."""
    cal = data["calibration"]
    acc = cal["acceptance"]
    if "accepted_counts" in acc:
        return AcceptanceModel(accepted_counts=tuple(int(n) for n in acc["accepted_counts"]),
                               measured_q=int(acc["q"]))
    q = int(cal.get("q", 4))
    runs = [(float(m["mean_accepted_len"]), depths_of(m, q))
            for name, m in data.get("modes", {}).items()
            if name != "offload" and m.get("mean_accepted_len")]
    if not runs:
        return AcceptanceModel(alpha=float(acc["alpha"]))
    return AcceptanceModel.from_depth_means(runs)


def depths_of(mode: dict[str, Any], q: int) -> dict[int, int]:
    """The depths a measured mode's rounds ran at: the shaper's choices, else q throughout."""
    chosen = {int(d): int(n) for d, n in (mode.get("speculative_depth_chosen") or {}).items()}
    return chosen if sum(chosen.values()) > 0 else {q: 1}


def geometry_of(cal: dict[str, Any]) -> Geometry:
    t = cal["target"]
    return Geometry(int(t["num_layers"]), int(t["kv_bytes_per_token"]))


def prompts_of(cal: dict[str, Any]) -> tuple[int, ...]:
    w = cal["workload"]
    n = int(w.get("num_requests") or len(w["context_lengths"]))
    prompts = tuple(int(c) for c in w["context_lengths"])
    return (prompts * -(-n // len(prompts)))[:n]


def setups(data: dict[str, Any], costs_from: dict[str, Any] | None = None,
           modes: Sequence[str] | None = None) -> dict[str, ReplaySetup]:
    """One replay setup per mode the bench measured (with per-step samples): the run's own
    settings, workload, link and acceptance; step costs fitted on ``costs_from``'s measured
    steps of the same mode (another bench JSON: out of sample), else on this run's."""
    cal = data["calibration"]
    settings = dict(data.get("settings") or {})
    link_bw = float(cal["link_bytes_per_s"])
    source = costs_from if costs_from is not None else data
    costs = fit_modes(source.get("modes", {}), float(source["calibration"]["link_bytes_per_s"]))
    out = {}
    for mode, m in data.get("modes", {}).items():
        if (modes is not None and mode not in modes) or not m.get("rounds") or mode not in costs:
            continue
        config, host = engine_config(settings, mode), None
        if config.host_attends:  # the run named host attention: its host's measured costs
            host = HostModel.of_steps(list(m["rounds"]) + list(m.get("prefill_steps") or ()))
            if host is None:  # it attended nothing on the host
                config = engine_config(settings, mode, host_attention="off")
        out[mode] = ReplaySetup(
            mode=mode, config=config, geometry=geometry_of(cal),
            prompts=prompts_of(cal), output_len=int(cal["workload"]["output_len"]),
            acceptance=acceptance_of(data), cost=costs[mode], link_bw=link_bw, host=host)
    return out


def ablation(s: ReplaySetup, name: str) -> ReplaySetup:
    """``s`` (an ``offload-spec`` setup) run as the ablation ``name`` (ABLATIONS)."""
    base, _ = ABLATIONS[name]
    if s.config.mode != base:
        raise ValueError(f"{name} ablates {base}, not {s.config.mode}")
    return replace(s, mode=name)

