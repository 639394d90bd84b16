"""The bench's residency side on the tiny pair: the device budget as a fraction of the
workload's KV, and the fill-against-tail sweep (every point, its JSON and PNG, exact outputs)."""

from __future__ import annotations

import json

import pytest

from specstream.bench.cli import apply_fraction
from specstream.bench.runner import BenchSettings, resident_fit_bytes, workload_kv_bytes
from specstream.bench.workload import Workload
from specstream.cli import main

# the tiny target (tests/conftest.py): 8 layers x 2 KV heads x 16 dims x K and V
TINY_KV_PER_TOKEN = 2 * 8 * 2 * 16
TINY = ["--context-len", "400", "--num-requests", "4", "--output-len", "8",
        "--chunk-tokens", "128", "--block-size", "16", "--resident-tail-tokens", "128",
        "--offload-after-tokens", "128", "--link-gbps", "2",
        # chains of 4: in 16-token blocks the default trees' 33 slots a request would take
        # three of a request's 26 blocks, and these tests are about residency
        "-q", "4", "--speculative-topk", "1"]


def test_device_kv_fraction_is_that_share_of_the_workloads_kv(tiny_target):
    workload = Workload((400, 300), 8)
    tokens = 408 + 308
    cpu = BenchSettings(model=str(tiny_target), block_size=16)
    assert workload_kv_bytes(workload, cpu) == tokens * TINY_KV_PER_TOKEN * 4  # float32 on cpu
    cuda = BenchSettings(model=str(tiny_target), device="cuda", block_size=16)
    assert workload_kv_bytes(workload, cuda) == tokens * TINY_KV_PER_TOKEN * 2  # bfloat16
    record = apply_fraction(cpu, workload, 0.25)
    assert cpu.device_kv_bytes == int(0.25 * tokens * TINY_KV_PER_TOKEN * 4)
    # the resident reference holds every request's blocks at once: prompt + output + one
    # round's drafts (the default policy's largest tree: 32 nodes), block-rounded, plus one
    # block, with 10% to spare
    assert cpu.resolved("specstream").verify_tokens == 33
    blocks = (-(-(408 + 33) // 16) + 1) + (-(-(308 + 33) // 16) + 1)
    assert cpu.reference_device_kv_bytes == resident_fit_bytes(workload, cpu)
    assert cpu.reference_device_kv_bytes == int(1.1 * blocks * 16 * TINY_KV_PER_TOKEN * 4)
    assert record["device_kv_fraction"] == 0.25
    assert record["workload_kv_bytes"] == tokens * TINY_KV_PER_TOKEN * 4
    with pytest.raises(ValueError):
        apply_fraction(cpu, workload, 0.0)


def test_bench_with_a_device_kv_fraction_runs_the_reference_on_a_fitting_budget(
    tiny_target, tiny_draft, tmp_path
):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", str(tiny_target), "--draft-model", str(tiny_draft), *TINY,
               "--modes", "resident,specstream", "--device-kv-fraction", "0.5",
               "--residency", "tail", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    total = 4 * 408 * TINY_KV_PER_TOKEN * 4
    settings = report["settings"]
    assert settings["residency"] == "tail"
    assert settings["device_kv_fraction"] == 0.5 and settings["workload_kv_bytes"] == total
    assert settings["device_kv_bytes"] == total // 2
    assert settings["reference_device_kv_bytes"] > total
    assert "note" in settings
    modes = report["modes"]
    assert modes["specstream"]["device_kv_budget_bytes"] == total // 2
    assert modes["resident"]["device_kv_budget_bytes"] == settings["reference_device_kv_bytes"]
    # the whole workload fits the reference: every request at once, no serialized admission
    assert modes["resident"]["max_concurrency"] == 4
    assert modes["specstream"]["outputs_match_reference"] is True
    assert modes["specstream"]["link_bytes_per_round"] > 0
    assert modes["resident"]["link_bytes_per_round"] == 0


def test_residency_sweep_writes_every_point_and_fill_streams_less(
    tiny_target, tiny_draft, tmp_path, capsys
):
    out = tmp_path / "residency.json"
    rc = main(["bench", "--model", str(tiny_target), "--draft-model", str(tiny_draft), *TINY,
               "--sweep-residency", "--fractions", "0.5,0.9", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    offloading = ("offload", "offload-spec", "specstream", "parallel-spec")
    points = {(p["fraction"], p["residency"], p["mode"]): p for p in report["points"]}
    assert set(points) == {(f, r, m) for f in (0.5, 0.9) for r in ("fill", "tail")
                           for m in offloading}
    total = report["workload_kv_bytes"]
    assert total == 4 * 408 * TINY_KV_PER_TOKEN * 4
    assert report["reference"]["mode"] == "resident"
    assert report["reference"]["device_kv_budget_bytes"] > total
    for (f, residency, mode), p in points.items():
        assert "skipped" not in p, (f, residency, mode, p.get("skipped"))
        assert p["outputs_match_reference"] is True, (f, residency, mode)
        assert p["device_kv_budget_bytes"] == int(f * total)
        assert 0 <= p["device_kv_utilization"] <= 1
        # the floor is what no residency could keep on the device: nothing streams less
        assert p["link_bytes_per_round"] >= 0.99 * p["link_bytes_floor_per_round"]
    for f in (0.5, 0.9):
        for mode in offloading:
            fill, tail = points[(f, "fill", mode)], points[(f, "tail", mode)]
            assert fill["link_bytes_per_round"] <= tail["link_bytes_per_round"], (f, mode)
            assert fill["link_bytes_per_token"] <= tail["link_bytes_per_token"], (f, mode)
            assert tail["link_bytes_per_round"] > 0, (f, mode)
            assert f"{f:g}" in report["ratios"] and mode in report["ratios"][f"{f:g}"]
    # at 0.9 of the workload on the device, fill keeps most history there
    for mode in offloading:
        assert (points[(0.9, "fill", mode)]["link_bytes_per_round"]
                < 0.5 * points[(0.9, "tail", mode)]["link_bytes_per_round"]), mode
    assert out.with_suffix(".png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "link_bytes_floor_per_round" in printed  # the per-F table
    assert "throughput fill/tail" in printed  # the per-F ratios
