"""Tensor parallelism in the simulator: one rank holds 1/tp of the target's weights and KV
heads (a head replicated past their count), streams its shard over its own link, pays two
all-reduces per layer; a replica occupies tp GPUs (one more for parallel-spec's draft)."""

from __future__ import annotations

import pytest

from specstream.sim import Scenario, simulate
from specstream.sim.api import by_mode
from specstream.sim.cli import main
from specstream.sim.costs import RooflineCosts
from specstream.sim.hardware import get_hardware
from specstream.sim.model_profile import get_model
from specstream.sim.tensor_parallel import TP_SETTINGS, TensorParallelCosts, tp_table


def _costs(hw: str = "H200", target: str = "Qwen3-32B") -> RooflineCosts:
    return RooflineCosts(get_hardware(hw), get_model(target), get_model("Qwen3-0.6B"))


def test_a_rank_holds_its_share():
    base = _costs()
    for tp, kv_share in ((2, 1 / 2), (4, 1 / 4), (8, 1 / 8), (16, 1 / 8)):  # 8 KV heads
        rank = TensorParallelCosts(base, tp)
        assert rank.kv_bytes("target") == pytest.approx(base.kv_bytes("target") * kv_share)
        assert rank.weight_bytes("target") == pytest.approx(base.weight_bytes("target") / tp)
        assert rank.kv_bytes("draft") == base.kv_bytes("draft")  # the draft is replicated
        assert rank.link_bw == base.link_bw and rank.gpus == tp
    sharded = TensorParallelCosts(base, 2, shard_draft=True)
    assert sharded.weight_bytes("draft") == pytest.approx(base.weight_bytes("draft") / 2)


def test_all_reduce_is_priced():
    base = _costs()
    nvlink, pcie = TensorParallelCosts(base, 2), TensorParallelCosts(base, 2, 20e9)
    assert TensorParallelCosts(base, 2).allreduce_time("draft", 64) == 0.0
    for n in (1, 64, 4096):
        assert base.linear_s("target", n) / 2 < nvlink.linear_s("target", n) \
            < base.linear_s("target", n) + nvlink.allreduce_time("target", n)
        assert nvlink.allreduce_time("target", n) < pcie.allreduce_time("target", n)
    assert nvlink.allreduce_time("target", 4096) > nvlink.allreduce_time("target", 1)
    # a large batch's all-reduce is bandwidth-bound: 2 (tp - 1) / tp of each message per call
    big = 1 << 16
    message = big * 5120 * 2
    assert pcie.allreduce_time("target", big) == pytest.approx(
        2 * 64 * (8e-6 + message / 20e9), rel=1e-9)  # the H200 latency, bandwidth given


def test_bad_sizes():
    with pytest.raises(ValueError, match="heads"):
        TensorParallelCosts(_costs(), 3)
    with pytest.raises(ValueError, match=">= 1"):
        TensorParallelCosts(_costs(), 0)


def test_tp_fits_more_and_moves_half_per_rank():
    def run(tp: int):
        sc = Scenario.from_names("A800-80GB-PCIe", "Qwen3-32B", "Qwen3-0.6B", (32768,), 32,
                                 0.75, 256, pcie_gen=4, tensor_parallel_size=tp)
        return by_mode(simulate(sc, ("offload-spec", "specstream", "parallel-spec")))

    one, two = run(1), run(2)
    assert two["specstream"].gpus == 2 and two["parallel-spec"].gpus == 3
    assert one["specstream"].gpus == 1 and one["parallel-spec"].gpus == 2
    assert two["specstream"].max_concurrency > one["specstream"].max_concurrency
    r1, r2 = one["specstream"].round, two["specstream"].round
    assert r1 is not None and r2 is not None
    # per request, a rank's link bytes per round are under 60% of TP 1's (its KV heads' half;
    # more of each request stays resident with the room the sharded weights leave)
    assert r2.link_bytes / r2.batch < 0.6 * r1.link_bytes / r1.batch
    assert two["specstream"].throughput > one["specstream"].throughput


def test_tp_table_and_cli(capsys):
    table = tp_table(TP_SETTINGS[2:3], sizes=(1, 2), concurrency=8, output_len=128)
    rows = table.splitlines()[2:]
    assert len(rows) == 2 and "reference" in rows[1]
    assert [r.split(" | ")[2] for r in rows] == ["1", "2"]
    assert main(["--target", "Qwen3-32B", "-tp", "2", "--concurrency", "4", "--context",
                 "16384", "--output-len", "64", "--modes", "offload-spec,specstream"]) == 0
    out = capsys.readouterr().out
    assert "TP2" in out
