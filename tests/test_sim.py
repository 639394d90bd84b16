"""Deployment simulator: profiles, event engine, closed-form rounds, serving, calibration, CLI."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from specstream.sim import AcceptanceModel, Scenario, SimPolicy, Workload, get_hardware, get_model
from specstream.sim.api import ratio, simulate
from specstream.sim.calibrate import load_bench, nnls, predict, relative_errors
from specstream.sim.cli import add_parser
from specstream.sim.costs import FittedCosts, LinearFit, PrefillFit
from specstream.sim.events import Graph, Task
from specstream.sim.memory import max_concurrency
from specstream.sim.model_profile import ModelProfile
from specstream.sim.report import verdict
from specstream.sim.rounds import simulate_round
from specstream.sim.serving import simulate_mode

BENCH = Path(__file__).parent / "data" / "bench_example.json"
# a CPU bench run with per-step samples from before the fill residency (6 x 2048 tokens, 48
# output tokens, 0.5 GB/s); the replay's tests are in test_sim_replay.py
BENCH_STEPS = Path(__file__).parent / "data" / "bench_cpu_steps.json"
KIB = 1024
V, D = 0.010, 0.002  # verify forward, draft step: constant times in the closed-form cases
ALPHA = AcceptanceModel(alpha=0.5)


def toy_costs(link_bw: float = 1e9, budget: float = 1e12) -> FittedCosts:
    """Verify takes V and a draft step D whatever the batch; KV 1 kB/token (target)."""
    return FittedCosts(link_bw=link_bw, device_budget_bytes=budget, host_budget_bytes=1e15,
                       num_layers=(4, 2), kv_per_token=(1000.0, 500.0), weights=(1e6, 1e5),
                       forward=(LinearFit(const_s=V), LinearFit(const_s=D)),
                       prefill=(PrefillFit(const_s=0.001), PrefillFit()))


# streams everything (no threshold, no tail, and the fixed-tail residency: the toy device's
# free memory would otherwise hold the history); rounds=4 for a clean steady state
POLICY = SimPolicy(q=2, resident_tail=0, offload_threshold=0, chunk_tokens=1000, rounds=4,
                   draft_window=None, residency="tail")


def test_builtin_profiles_match_public_shapes() -> None:
    assert get_model("Qwen3-8B").kv_bytes_per_token == 144 * KIB
    assert get_model("Qwen3-0.6B").kv_bytes_per_token == 112 * KIB
    assert get_model("InternLM2.5-7B").kv_bytes_per_token == 128 * KIB
    assert get_model("Qwen3-8B").params == pytest.approx(8.19e9, rel=0.01)
    assert get_model("Qwen3-32B").params == pytest.approx(32.8e9, rel=0.01)
    assert get_model("InternLM2.5-7B").params == pytest.approx(7.74e9, rel=0.01)
    assert get_model("Qwen3-0.6B").params == pytest.approx(0.6e9, rel=0.02)


def test_profile_from_hf_config(tmp_path: Path) -> None:
    cfg = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 100, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = get_model(str(tmp_path))
    assert (m.num_kv_heads, m.head_dim, m.dtype_bytes) == (4, 16, 4)
    assert m.kv_bytes_per_token == 2 * 2 * 4 * 16 * 4
    with pytest.raises(ValueError):
        ModelProfile.from_hf_config({**cfg, "num_experts": 8})


def test_hardware_defaults_and_overrides() -> None:
    assert get_hardware("H200").link_bw == 50e9
    assert get_hardware("A800").link_bw == 25e9
    assert get_hardware("A800", pcie_gen=5, link_bytes_per_s=None).link_bw == 50e9
    assert get_hardware("L40S", link_bytes_per_s=20e9).link_bw == 20e9
    with pytest.raises(KeyError):
        get_hardware("TPU")


def test_acceptance_closed_form_and_histogram() -> None:
    assert ALPHA.expected_tokens(2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert ALPHA.expected_tokens(0) == 1.0
    hist = AcceptanceModel(accepted_counts=(1, 1, 2), measured_q=2)
    assert hist.expected_tokens(2) == pytest.approx(1 + (0 + 1 + 4) / 4)
    implied = AcceptanceModel.closed_form(hist.effective_alpha, 2)
    assert implied == pytest.approx(hist.expected_tokens(2), rel=1e-6)


def test_event_engine_priorities_and_dependencies() -> None:
    g = Graph()
    a = g.add(Task("a", "link", 2.0, "link"))
    g.add(Task("low", "compute", 1.0, "draft", priority=1))
    g.add(Task("b", "compute", 1.0, "verify", deps=[a]))
    g.add(Task("c", "compute", 0.5, "verify"))
    t = {x.name: x for x in g.run()}
    assert (t["c"].start, t["low"].start) == (0.0, 0.5)  # priority 0 first
    assert (t["b"].start, t["b"].end) == (2.0, 3.0)  # waits for its link dependency


def test_single_request_closed_forms() -> None:
    """Restore modes restore layer by layer with the next layer prefetched (as the engine):
    a link-bound round is the link plus the last layer's verification; restore-all-then-
    verify (the ablation) pays the sum."""
    costs, ctx = toy_costs(), [50_000.0]
    link = 50_000 * 1000 / 1e9  # 50 ms over 4 layers; a layer's verification V / 4
    assert simulate_round("offload", costs, POLICY, ctx, 0, ALPHA).period_s == \
        pytest.approx(link + V / 4)
    r = simulate_round("offload-spec", costs, POLICY, ctx, 2, ALPHA)
    assert r.period_s == pytest.approx(link + V / 4 + 2 * D)
    full = simulate_round("offload-spec-restore-all", costs, POLICY, ctx, 2, ALPHA)
    assert full.period_s == pytest.approx(link + V + 2 * D)
    assert full.verify_wait_s == pytest.approx(link)  # the whole restore is a barrier
    assert r.verify_wait_s < full.verify_wait_s
    par = simulate_round("parallel-spec", costs, POLICY, ctx, 2, ALPHA)
    assert par.period_s == pytest.approx(max(link, 2 * D) + V / 4)
    res = simulate_round("resident", costs, POLICY, ctx, 2, ALPHA)
    assert (res.period_s, res.link_s) == (pytest.approx(V + 2 * D), 0.0)
    # compute-bound (a fast link): the restore of layer l + 1 hides under layer l
    fast = simulate_round("offload-spec", toy_costs(link_bw=1e12), POLICY, ctx, 2, ALPHA)
    assert fast.period_s == pytest.approx(link / 1000 / 4 + V + 2 * D)


def test_specstream_link_bound_round_is_the_link_time() -> None:
    costs, ctx = toy_costs(), [50_000.0, 50_000.0]
    link = 2 * 50_000 * 1000 / 1e9
    # enough staging slots to cover a layer boundary's compute: the link never idles
    deep = replace(POLICY, staging_buffers=16)
    r = simulate_round("specstream", costs, deep, ctx, 2, ALPHA)
    assert r.period_s >= link * (1 - 1e-9)
    assert r.period_s == pytest.approx(link, rel=0.01)  # compute and drafts hide behind it
    assert r.link_utilisation > 0.99 and r.waits_on_restore
    seq = simulate_round("offload-spec", costs, POLICY, ctx, 2, ALPHA)
    assert seq.period_s == pytest.approx(link + V / 4 + 2 * D)
    # two slots: at each of the 4 layer boundaries of each group the link stalls while the
    # layer's MLP and the next layer's projection run (2.5 ms x 1.05), minus 2 prefetched chunks
    shallow = simulate_round("specstream", costs, POLICY, ctx, 2, ALPHA)
    chunk = link / 2 / 4 / 32
    stall = 2 * 4 * (V / 4 * (1 + POLICY.corun_slowdown) - 2 * chunk)
    assert shallow.period_s == pytest.approx(link + stall, rel=0.02)


def test_specstream_compute_bound_round_is_the_compute_sum() -> None:
    costs, ctx = toy_costs(link_bw=1e15), [50_000.0, 50_000.0]
    r = simulate_round("specstream", costs, POLICY, ctx, 2, ALPHA)
    per_group = V * (1 + POLICY.corun_slowdown) + 2 * D  # two groups share the device
    assert r.period_s == pytest.approx(2 * per_group, rel=1e-4)
    assert not r.waits_on_restore


def test_serving_single_request_tpot_and_throughput() -> None:
    wl = Workload((20_000,), output_len=65, concurrency=1, num_requests=1)
    res = simulate_mode("offload-spec", toy_costs(), POLICY, wl, ALPHA)
    period = 20_000 * 1000 / 1e9 + V / 4 + 2 * D
    assert res.tpot_s == pytest.approx(period / 1.75, rel=0.05)
    assert res.ttft_s == pytest.approx(0.02)  # prefill hides behind writing 20 MB back
    assert res.throughput == pytest.approx(65 / (res.ttft_s + 64 * res.tpot_s), rel=1e-6)


def test_memory_limits_admission() -> None:
    costs = toy_costs(budget=1e6 + 1e5 + 10 * 1500 * 1000)  # weights + 10 x (1000 t + 500 d)
    assert max_concurrency("resident", costs, POLICY, 1000) == 10
    assert max_concurrency("offload", costs, POLICY, 1000) > 10  # history lives on the host
    wl = Workload((999,), output_len=1, concurrency=32)
    assert simulate_mode("resident", costs, POLICY, wl, ALPHA).admitted == 10


def test_paper_scale_verdict_and_ratios() -> None:
    sc = Scenario.from_names("A800", "Qwen3-8B", "Qwen3-0.6B", (32768,), concurrency=32,
                             output_len=256, policy=SimPolicy(q=4))
    res = simulate(sc, ("resident", "offload", "offload-spec", "specstream", "parallel-spec"))
    text = verdict(sc, res)
    assert "EXCEEDS device memory" in text and "WAITS on restoration" in text
    assert ratio(res, "specstream", "offload") > 2.0  # q+1 tokens per byte moved
    assert ratio(res, "specstream", "offload-spec") > 1.0
    assert ratio(res, "specstream", "parallel-spec", per_gpu=True) > 1.5


def test_nnls_recovers_coefficients() -> None:
    x = np.column_stack([np.ones(6), np.arange(6.0), np.arange(6.0) ** 2])
    y = x @ np.array([0.5, 0.0, 2.0])
    assert nnls(x, y) == pytest.approx([0.5, 0.0, 2.0], abs=1e-9)
    assert (nnls(x, x @ np.array([1.0, -1.0, 0.1])) >= 0).all()


def test_calibration_example_round_trip() -> None:
    scenario, measured = load_bench(BENCH)
    assert scenario.costs.link_bw == 2e9 and scenario.policy.q == 4
    counts = json.loads(BENCH.read_text())["calibration"]["acceptance"]["accepted_counts"]
    mean_accepted = sum(k * n for k, n in enumerate(counts)) / sum(counts)
    assert scenario.acceptance.expected_tokens(4) == pytest.approx(1 + mean_accepted)
    _, results, _ = predict(BENCH)
    errors = relative_errors(results, measured)
    assert set(errors) == set(measured)
    assert all(r.throughput > 0 for r in results)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["simulate", *argv])
    return int(args.func(args))


def test_cli_simulate_plots_and_calibrate(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    png, sweep, out = tmp_path / "round.png", tmp_path / "sweep.png", tmp_path / "r.json"
    assert _cli(["--hardware", "L40S", "--context", "16384", "--concurrency", "4",
                 "--output-len", "8", "--q", "2", "--modes", "offload-spec,specstream",
                 "--plot-timeline", str(png), "--json", str(out), "--plot-sweep", str(sweep),
                 "--sweep", "4096,16384"]) == 0
    assert "Most throughput per GPU" in capsys.readouterr().out
    assert png.stat().st_size > 1000 and sweep.stat().st_size > 1000
    assert [r["mode"] for r in json.loads(out.read_text())["results"]] == \
        ["offload-spec", "specstream"]
    assert _cli(["--calibrate", str(BENCH)]) == 0
    assert "rel. error" in capsys.readouterr().out
    assert _cli(["--calibrate", str(BENCH), "--max-error", "0.01"]) == 1


def test_pipeline_model_predicts_the_same_modes() -> None:
    _, replayed, _ = predict(BENCH_STEPS)
    _, pipe, _ = predict(BENCH_STEPS, model="pipeline")
    assert [r.mode for r in pipe] == [r.mode for r in replayed]
    assert all(r.round is not None for r in pipe)  # the round pipeline, not the replay
