"""specstream bench end to end on the tiny pair: every field, every mode equal, a trace."""

from __future__ import annotations

import json

import pytest

from specstream.cli import main

FIELDS = ("output_tokens_per_s", "decode_tokens_per_s", "output_tokens_per_s_per_device",
          "devices", "mean_accepted_len", "link_utilization", "round_time_over_floor",
          "device_kv_peak_bytes", "link_bytes_per_round", "link_bytes_floor_per_round",
          "device_kv_utilization", "link_bytes_per_token", "max_concurrency",
          "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "outputs_match_reference")


def test_bench_runs_every_mode_and_writes_json_and_trace(tiny_target, tiny_draft, tmp_path):
    out, trace = tmp_path / "bench.json", tmp_path / "trace.json"
    rc = main(["bench", "--model", str(tiny_target), "--draft-model", str(tiny_draft),
               "--context-len", "400", "--num-requests", "4", "--output-len", "8",
               "--device-kv-bytes", "1600000", "--chunk-tokens", "128", "--block-size", "16",
               "--resident-tail-tokens", "128", "--offload-after-tokens", "128",
               "--link-gbps", "2", "--json", str(out), "--trace", str(trace),
               # the same drafts in every mode (auto's depths follow measured times), so the
               # floors below compare the same work
               "--speculative-policy", "fixed"])
    assert rc == 0
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert set(modes) == {"resident", "offload", "offload-spec", "specstream", "parallel-spec"}
    for name, m in modes.items():
        for f in FIELDS:
            assert f in m, (name, f)
        assert m["outputs_match_reference"] is True, name
        assert m["output_tokens_per_s"] > 0
    assert modes["parallel-spec"]["devices"] == 2
    assert modes["offload"]["link_utilization"] > 0
    assert modes["resident"]["link_utilization"] == 0
    # the offloading modes stream history (the default residency, fill, on a budget below the
    # workload's KV); resident moves none
    assert report["settings"]["residency"] == "fill"
    # automatic prefix caching is on unless --no-prefix-caching (the engine's default)
    assert report["settings"]["enable_prefix_caching"] is True
    assert report["workload"]["workload"] == "single"
    assert modes["offload"]["link_bytes_per_round"] > 0
    assert modes["resident"]["link_bytes_per_round"] == 0
    # at one device budget the offloading modes hold more requests than resident does
    assert modes["specstream"]["max_concurrency"] > modes["resident"]["max_concurrency"]
    assert "specstream_over_offload-spec" in report["ratios"]
    # the floor is the work's, not the schedule's: one-device modes that generate the same
    # tokens over the same history get about the same floor (resident's compute model, every
    # step counted); drafting on a second device overlaps in the floor, so it can only be lower
    spec, stream = modes["offload-spec"]["floor_s"], modes["specstream"]["floor_s"]
    assert abs(spec - stream) < 0.15 * spec, (spec, stream)
    assert modes["parallel-spec"]["floor_s"] < 1.05 * spec
    assert modes["resident"]["compute_model"]["fit_error"] < 0.5
    assert report["calibration"]["verify_time"]["samples"]
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"link h2d", "verify", "draft"} <= lanes
    spans = [e for e in events if e["ph"] == "X"]
    assert any(e["name"].startswith("draft") for e in spans)
    assert trace.with_suffix(".png").stat().st_size > 1000


def test_host_overhead_bench_writes_its_figures(tmp_path):
    """bench/host_overhead.py at a toy size: it runs the engine's round and writes the four
    figures it promises (no timing is asserted: speeds belong to the bench, not to tests)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    out = tmp_path / "host.json"
    subprocess.run([sys.executable, str(root / "bench" / "host_overhead.py"), "--layers", "2",
                    "--draft-layers", "1", "--requests", "2", "--chunks", "3", "--rounds", "2",
                    "--json", str(out)], check=True, capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    assert r["chunk_waves_per_round"] == 2 * 3 and r["rounds"] == 2
    assert r["host_ms_per_round"] > 0
    assert r["host_over_link"] == pytest.approx(
        r["host_ms_per_round"] / r["h200_link_ms_per_round"], rel=0.02)
    # the yardstick: 2 layers x 2 requests x 32K tokens of Qwen3-8B KV (8 heads x 128 x bf16)
    assert r["h200_link_ms_per_round"] == pytest.approx(
        2 * 2 * 32768 * 2 * 8 * 128 * 2 / 50e9 * 1e3, rel=0.01)


def test_ladder_runs_every_step_exactly_and_the_preset_sets_the_link(tiny_target, tmp_path):
    out = tmp_path / "ladder.json"
    rc = main(["bench", "--model", str(tiny_target), "--draft-model", str(tiny_target),
               "--preset", "link-bound", "--ladder", "--context-len", "300",
               "--num-requests", "4", "--device-kv-bytes", "1600000", "--chunk-tokens", "128",
               "--block-size", "16", "--resident-tail-tokens", "64",
               "--offload-after-tokens", "128", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    rows = report["ladder"]
    assert [r["mode"] for r in rows] == ["offload-spec"] + ["specstream"] * 5 + ["offload-spec"]
    assert all(r["outputs_match_reference"] for r in rows)
    # the preset: tail residency over a 0.1 GB/s link, 64 output tokens
    assert report["settings"]["link_gbps"] == 0.1 and report["settings"]["residency"] == "tail"
    assert report["settings"]["staging_buffers"] == 4
    assert report["workload"]["output_len"] == 64
    # the auto steps chose shapes (which ones depends on measured times; with the target
    # drafting for itself only first candidates are accepted, so once the policy has learnt
    # that, chains beat trees), and the self-drafting target accepts the whole chosen depth
    # of every round but the last of each request (cut short by the output length)
    assert rows[3]["speculative_depth_chosen"] and rows[4]["speculative_nodes_chosen"]
    chosen = {int(d): n for d, n in rows[4]["speculative_depth_chosen"].items()}
    mean_depth = sum(d * n for d, n in chosen.items()) / sum(chosen.values())
    assert 0.75 * (1 + mean_depth) < rows[4]["mean_accepted_len"] <= 1 + max(chosen)
    ratios = report["ratios"]
    assert ratios["default_over_first"] == pytest.approx(
        rows[5]["output_tokens_per_s"] / rows[0]["output_tokens_per_s"])
    assert ratios["accepted_default_over_control"] == pytest.approx(
        rows[5]["mean_accepted_len"] / rows[6]["mean_accepted_len"])
    assert "--ladder" in report["command"]
