"""The step replay on the engine's own scheduler: schedule, fake worker, step costs, and the
out-of-sample check of issue 19 (costs fitted on one bench run predict another)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import specstream.sim.replay as replay_module
from specstream.engine.contract import DraftWork, SeqWork, StepPlan
from specstream.engine.sched.scheduler import Scheduler
from specstream.sampling_params import SamplingParams
from specstream.sim.calibrate import nnls, predict, relative_errors, validation_table
from specstream.sim.engine_model import build, engine_config
from specstream.sim.fake_worker import FakeWorker
from specstream.sim.replay import replay, replay_mean, setups
from specstream.sim.step_cost import StepCost, StepFeatures, compute_ratio, fit_modes, scaled
from specstream.sim.workload import AcceptanceModel

RESULTS = Path(__file__).parents[1] / "bench" / "results"
# `specstream bench --quick --link-gbps 1.0` (6 x 2048 tokens, 48 out) and `specstream bench
# --context-len 3072 --num-requests 6 --output-len 48 --link-gbps 0.5`, both residency fill
BENCH_A, BENCH_B = RESULTS / "sim-calib-A.json", RESULTS / "sim-calib-B.json"
THROUGHPUT_BOUND = 0.15  # the bound, met by every mode in both directions
TPOT_BOUND = 0.25  # the TPOT bound (measured out of sample: at most 17%, parallel-spec)
# specstream's out-of-sample TPOT (measured +4.8% B from A, +3.9% A from B; +21.7% A from B
# before the step costs were fitted on relative errors)
SPECSTREAM_TPOT_BOUND = 0.10
SETTINGS = json.loads(BENCH_A.read_text())["settings"]


def test_the_replay_drives_the_engines_scheduler() -> None:
    s = setups(json.loads(BENCH_A.read_text()))["specstream"]
    eng = build(s.config, s.geometry)
    assert type(eng.scheduler) is Scheduler  # the engine's class, not a copy
    assert s.config.mode == "specstream" and s.config.residency == "fill"
    # the engine's layout: the 64 MiB budget less the staging ring, in 128-token blocks
    ring = 2 * 2 * 2048 * (6144 // 6)
    assert eng.kv.device.num_blocks == (64 * 2**20 - ring) // (128 * 6144)


def test_replay_schedules_as_the_engine_did() -> None:
    """Against the measured steps: as many requests at once, every prompt token prefilled
    once, a specstream decode step verifying one of the two groups."""
    data = json.loads(BENCH_A.read_text())
    prompts = sum(data["calibration"]["workload"]["context_lengths"])
    for mode, s in setups(data).items():
        run = replay(s, record=True)
        measured = data["modes"][mode]["rounds"]
        assert run.result.admitted == max(r["num_seqs"] for r in measured), mode
        assert sum(f.prefill_tokens for f in run.records) == prompts, mode
        if mode == "specstream":
            decode = [f.num_seqs for f in run.records if not f.prefill_tokens]
            assert max(decode) == 3  # 6 requests, two groups
        # as many decode steps as measured, within the acceptance draws' spread
        steps = run.steps["decode"] + run.steps["mixed"]
        assert steps == pytest.approx(len(measured), rel=0.3), mode


def test_fake_worker_accepts_by_position() -> None:
    """A histogram's acceptance falls with position; drawn chains reproduce it."""
    acc = AcceptanceModel(accepted_counts=(40, 20, 20, 10, 10), measured_q=4)
    worker = FakeWorker(acc, np.random.default_rng(1))
    seq = SeqWork("r", (3,) * 5, 100, 4, prefill=False, sample=True, host_tokens=0,
                  device_blocks=(), restore_chunks=())
    counts = np.zeros(5)
    for _ in range(4000):
        counts[len(worker.run(StepPlan((seq,))).new_tokens["r"]) - 1] += 1
    assert counts / counts.sum() == pytest.approx([0.4, 0.2, 0.2, 0.1, 0.1], abs=0.03)
    assert acc.position_rates(4) == pytest.approx([0.6, 40 / 60, 0.5, 0.5])
    # i.i.d. alpha: a chain stops at its first rejection; from_mean inverts the closed form
    alpha = AcceptanceModel.from_mean(2.5, 4).alpha
    assert AcceptanceModel.closed_form(alpha, 4) == pytest.approx(2.5)


def test_fake_worker_trees_yield_more_than_a_chain_of_their_depth() -> None:
    worker = FakeWorker(AcceptanceModel(alpha=0.6), np.random.default_rng(2))
    parents = worker.tree(3, 2, 8)
    assert len(parents) == 8 and parents[0] == -1
    assert all(p < i for i, p in enumerate(parents))  # parents before children
    tree = SeqWork("t", (3,) * 9, 100, 8, False, True, 0, (), (), parents=tuple(parents))
    chain = SeqWork("c", (3,) * 4, 100, 3, False, True, 0, (), ())
    got = {"t": 0, "c": 0}
    for _ in range(3000):
        out = worker.run(StepPlan((tree, chain)))
        for rid in got:
            got[rid] += len(out.new_tokens[rid])
    assert got["t"] > 1.1 * got["c"]
    draft = DraftWork("x", (3,) * 10, 3, 100, SamplingParams(), False, topk=2, max_nodes=8)
    out = worker.run(StepPlan((), (draft,)))
    assert len(out.drafts["x"]) == 8 and len(out.draft_parents["x"]) == 8


def test_link_wait_per_unit() -> None:
    """One piece (restore-all): the whole link; many pieces under more compute: the first."""
    assert StepCost.wait_s(0.1, 1.0, 1) == pytest.approx(0.1)
    assert StepCost.wait_s(0.1, 1.0, 10) == pytest.approx(0.01)
    assert StepCost.wait_s(1.0, 0.5, 10) == pytest.approx(0.1 + 9 * 0.05)
    assert StepCost.wait_s(1.0, 0.5, 0) == 0.0


def test_a_draft_on_its_own_thread_hides_behind_the_wait_only() -> None:
    """parallel drafting (CPU backend): the draft thread shares the interpreter with the
    target's forward, so the step pays the part of the draft the link wait does not cover."""
    f = StepFeatures(query_tokens=10, attention_pairs=0, context_tokens=0, num_seqs=1,
                     draft_tokens=4, draft_seqs=1, history_bytes=0.0, units=0)
    coef = (0.0, 1e-3, 0.0, 0.0, 0.0, 5e-3, 0.0, 0.0, 0.0)  # target 10 ms, draft 20 ms
    serial, overlapped = StepCost(coef), StepCost(coef, concurrent_draft=True)
    assert serial.seconds(f, 1e9)[0] == pytest.approx(0.030)
    assert overlapped.seconds(f, 1e9)[0] == pytest.approx(0.030)  # no wait: nothing hidden
    waits = replace(f, history_bytes=15e6, units=1)  # 15 ms on the link, one piece
    assert serial.seconds(waits, 1e9)[0] == pytest.approx(0.045)
    assert overlapped.seconds(waits, 1e9)[0] == pytest.approx(0.010 + 0.015 + 0.005)


def test_parallel_drafting_is_fitted_on_the_measured_draft_time() -> None:
    """A parallel mode's draft columns come from RoundStats.draft_s, and only what the wait
    left exposed is taken off its compute: 2 ms a draft token, recovered exactly (one and two
    requests drafting, so a token and a draft forward are told apart)."""
    def step(q: int, dt: int, seqs: int, wait: float) -> dict[str, float]:
        draft, target = 2e-3 * dt, 1e-3 * q
        return {"query_tokens": q, "context_tokens": 0, "attention_pairs": 0, "num_seqs": 1,
                "draft_tokens": dt, "draft_seqs": seqs if dt else 0, "draft_s": draft,
                "draft_levels": dt // seqs, "wait_s": wait,
                "compute_s": target + max(0.0, draft - wait)}
    rounds = [step(q, dt, s, w) for q in (2, 5, 9) for dt in (0, 4, 8) for s in (1, 2)
              for w in (0.0, 0.01)]
    costs = fit_modes({"parallel-spec": {"rounds": rounds, "drafting": "parallel"}}, 1e9)
    c = costs["parallel-spec"]
    assert c.concurrent_draft
    assert c.coef[1] == pytest.approx(1e-3, rel=1e-6)
    assert c.coef[5] == pytest.approx(2e-3, rel=1e-6)


def test_compute_ratio_reads_how_much_slower_the_steps_ran_than_the_fit() -> None:
    """Steps measured 1.25x what a cost predicts give 1.25, and the cost scaled by it predicts
    them; a second worker's draft counts only where the wait left it exposed."""
    def step(q: int, scale: float, wait: float = 0.0, dt: int = 0) -> dict[str, float]:
        draft = 2e-3 * dt
        return {"query_tokens": q, "context_tokens": 0, "attention_pairs": 0, "num_seqs": 1,
                "draft_tokens": dt, "draft_seqs": 1 if dt else 0, "draft_s": draft,
                "wait_s": wait, "compute_s": (1e-3 + 1e-3 * q) * scale + max(0.0, draft - wait)}
    cost = StepCost((1e-3, 1e-3, 0.0, 0.0, 0.0, 2e-3, 0.0, 0.0, 0.0))
    slow = [step(q, 1.25) for q in (1, 5, 40)]
    assert compute_ratio(cost, slow, 1e9) == pytest.approx(1.25)
    again = scaled(cost, 1.25)
    assert sum(again.compute_s(StepFeatures.of_record(r))[0] for r in slow) == pytest.approx(
        sum(r["compute_s"] for r in slow))
    assert compute_ratio(cost, [], 1e9) is None
    parallel = replace(cost, concurrent_draft=True)  # drafts of 8 ms, waits of 0 and 10 ms
    rows = [step(q, 0.8, w, 4) for q in (2, 9) for w in (0.0, 0.01)]
    assert compute_ratio(parallel, rows, 1e9) == pytest.approx(0.8)


def test_step_costs_are_fitted_on_relative_errors() -> None:
    """Decode rounds of 10-20 ms beside prefill-carrying steps of ~1 s: a 1-2% error on the
    latter (a loaded machine) is the whole of a decode round's per-request cost to an absolute
    fit; the relative fit (weights 1 / fitted time) keeps the decode rounds right."""
    def step(q: int, seqs: int, noise: float = 0.0) -> dict[str, float]:
        return {"query_tokens": q, "context_tokens": 0, "attention_pairs": 0,
                "num_seqs": seqs, "wait_s": 0.0,
                "compute_s": (2e-3 + 1e-3 * q + 3e-3 * seqs) * (1 + noise)}
    rounds = ([step(5, 3, n) for n in (0.03, -0.03)] * 5
              + [step(4, 2, n) for n in (0.03, -0.03)] * 5
              + [step(1024, 1, -0.01), step(1029, 3, 0.02)] * 3)
    decode = StepFeatures.of_record(step(5, 3))  # 16 ms
    c = fit_modes({"resident": {"rounds": rounds}}, 1e9)["resident"]
    assert c.compute_s(decode)[0] == pytest.approx(16e-3, rel=0.02)
    x = np.array([StepFeatures.of_record(r).row() for r in rounds])
    absolute = nnls(x, np.array([r["compute_s"] for r in rounds]))
    assert float(absolute @ decode.row()) > 1.1 * 16e-3  # what the absolute fit made of it


def test_decode_rounds_out_of_sample() -> None:
    """On the committed pair, specstream's decode rounds (no prefill chunk: what TPOT is made
    of), costed at their measured features by the other run's fit: within 10% (measured -1%
    A from B, +4% B from A; the absolute fit made them +50% and +5%)."""
    runs = {f: json.loads(f.read_text()) for f in (BENCH_A, BENCH_B)}
    for run, other in ((BENCH_A, BENCH_B), (BENCH_B, BENCH_A)):
        src = runs[other]
        cost = fit_modes(src["modes"], float(src["calibration"]["link_bytes_per_s"]))
        rounds = [r for r in runs[run]["modes"]["specstream"]["rounds"]
                  if not r["prefill_tokens"]]
        pred = sum(cost["specstream"].compute_s(StepFeatures.of_record(r))[0] for r in rounds)
        meas = sum(r["compute_s"] for r in rounds)
        assert abs(pred / meas - 1) < 0.10, (run.name, pred / meas)


def test_auto_policy_and_trees_run_through_the_scheduler() -> None:
    """speculative_policy auto: the scheduler's own RoundShaper chooses depths from what the
    replay tells it; trees: the scheduler hands the worker tree-shaped drafts."""
    base = setups(json.loads(BENCH_A.read_text()))["specstream"]
    auto = replace(base, config=engine_config(SETTINGS, "specstream",
                                              speculative_policy="auto"))
    run = replay(auto)
    assert sum(run.shapes.values()) > 0 and run.result.throughput > 0
    tree = replace(base, config=engine_config(SETTINGS, "specstream", speculative_topk=2,
                                              speculative_num_draft_tokens=8))
    run = replay(tree, record=True)
    # a decode step verifies 3 requests x (1 + 8 nodes) query positions
    assert max(f.query_tokens for f in run.records if not f.prefill_tokens) == 27


def test_the_bench_warm_up_teaches_the_policy_and_is_not_measured(monkeypatch) -> None:
    """The bench runs a short warm-up before the measured requests, and the round-shape
    policy keeps what it learned there (its first probe ran on the warm-up). The replay runs
    the same warm-up first: the measured requests start with a policy that has seen drafts,
    and none of the warm-up's steps or decisions count in what the replay reports."""
    base = setups(json.loads(BENCH_A.read_text()))["specstream"]
    auto = replace(base, config=engine_config(SETTINGS, "specstream",
                                              speculative_policy="auto"))
    phases: list[tuple[bool, int, int]] = []  # (seen drafts, decisions before, after)
    run_phase = replay_module._Clock.run

    def spy(clock: Any) -> None:
        shaper = clock.eng.scheduler.shaper
        seen, before = shaper.seen_drafts, shaper.decisions
        run_phase(clock)
        phases.append((seen, before, shaper.decisions))

    monkeypatch.setattr(replay_module._Clock, "run", spy)
    cold = replay(auto, record=True)
    assert [p[0] for p in phases] == [False]
    phases.clear()
    warm = replay(replace(auto, warmup=(64, 4)), record=True)
    assert [p[0] for p in phases] == [False, True]  # the warm-up probed: drafts seen after it
    (_, _, warm_end), (_, measured_from, end) = phases
    assert measured_from == warm_end > 0
    assert sum(warm.shapes.values()) == end - measured_from  # its decisions alone
    # the warm-up's prompt is the first prompt's first 64 tokens: nothing else is prefilled
    # in the measured run, and the first request may reuse those cached tokens
    prompt_tokens = sum(auto.prompts)
    assert prompt_tokens - 64 <= sum(f.prefill_tokens for f in warm.records) <= prompt_tokens
    assert sum(f.prefill_tokens for f in cold.records) == prompt_tokens
    assert warm.result.throughput > 0 and cold.result.throughput > 0


def test_the_replay_counts_waves_of_the_ring_the_engine_built(monkeypatch) -> None:
    """A budget whose half cannot hold the configured ring narrows its waves
    (``staging_ring``: eight requests a wave become two); the replay's steps move history in
    the built ring's waves, not the configured ones."""
    base = setups(json.loads(BENCH_A.read_text()))["specstream"]
    config = engine_config(SETTINGS, "specstream", wave_requests=8,
                           device_kv_bytes=16 * 2**20)
    built = build(config, base.geometry).layout.wave_requests
    assert built < config.wave_requests
    seen = []
    of_step = StepFeatures.of_step

    def spy(plan, out, link_bytes, layers, history, wave_requests):
        seen.append(wave_requests)
        return of_step(plan, out, link_bytes, layers, history, wave_requests)

    monkeypatch.setattr(replay_module.StepFeatures, "of_step", spy)
    replay(replace(base, config=config))
    assert seen and set(seen) == {built}


def test_restore_all_ablation_is_slower_than_layer_prefetch() -> None:
    s = setups(json.loads(BENCH_B.read_text()))["offload-spec"]
    layered = replay_mean(s, 4).result
    full = replay_mean(replace(s, mode="offload-spec-restore-all"), 4).result
    assert full.throughput < layered.throughput


@pytest.mark.parametrize(("run", "costs"), [(BENCH_B, BENCH_A), (BENCH_A, BENCH_B)])
def test_costs_fitted_on_one_run_predict_another(run: Path, costs: Path) -> None:
    """Issue 19's pair: costs from A (2048 tokens, 1 GB/s) predict B (3072, 0.5 GB/s), and
    the other way round."""
    _, results, measured = predict(run, "replay", costs_from=costs)
    errors = relative_errors(results, measured)
    assert set(errors) == set(measured)
    assert all(abs(e) < THROUGHPUT_BOUND for e in errors.values()), errors
    tpot = relative_errors(results, measured, "tpot_s")
    assert all(abs(e) < TPOT_BOUND for e in tpot.values()), tpot
    assert abs(tpot["specstream"]) < SPECSTREAM_TPOT_BOUND, tpot


def test_the_validation_table_has_both_samples() -> None:
    # the check has teeth: B's offload is 2.4x slower than A's (half the link, longer
    # histories); a prediction that ignored the link would miss it by far more
    a, b = (json.loads(f.read_text())["modes"]["offload"]["output_tokens_per_s"]
            for f in (BENCH_A, BENCH_B))
    assert abs(a / b - 1) > 1.0
    table, worst = validation_table(BENCH_B, BENCH_A)
    assert "in sample" in table and "out of sample" in table
    assert {k.split(" ", 1)[1] for k in worst} == {"output tok/s", "TPOT", "TTFT"}
