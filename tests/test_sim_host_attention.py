"""Host attention in the roofline (issue 22, item 5): the split, the host's rate and what
shares it, and that ``off`` leaves the simulator's results as they were."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specstream.engine.policy.round_shape import Shape
from specstream.engine.policy.shaping import RoundShaper
from specstream.sim.api import Scenario
from specstream.sim.cli import main
from specstream.sim.hardware import get_hardware
from specstream.sim.host import flop_per_byte, host_split
from specstream.sim.policy import SimPolicy
from specstream.sim.rounds import simulate_round

TREE = Shape(8, topk=4, nodes=32)


def _sc(gpus: int = 1, isa: str = "avx512", **policy: object) -> Scenario:
    hw = get_hardware("H200", 5, gpus_per_host=gpus, host_isa=isa)
    return Scenario.from_names(hw, "Qwen3-8B", "Qwen3-0.6B", (32768,), 8, 0.75,
                               policy=SimPolicy(residency="tail", **policy))  # type: ignore[arg-type]


def _round(sc: Scenario, shape: Shape | None = None, q: int = 4):
    est = None
    if shape is not None:
        est = RoundShaper(8, "gaps", max_topk=4, max_nodes=32, prior_acceptance=0.75).acceptance
    return simulate_round("specstream", sc.costs, sc.policy, [32768.0] * 8, q, sc.acceptance,
                          shape=shape, estimate=est)


def test_flop_per_byte_is_the_gqa_ratio() -> None:
    sc = _sc()
    assert flop_per_byte(sc.costs) == pytest.approx(32 / 8)  # Qwen3-8B: 32 heads, 8 KV heads


def test_split_makes_link_and_host_finish_together() -> None:
    split = host_split(_sc().costs, positions=5)
    cold = 38.7e9
    link_s = cold * (1 - split.share) / split.link_rate
    host_s = cold * split.share / split.host_rate
    assert link_s == pytest.approx(host_s)
    assert split.cold_s(cold) == pytest.approx(link_s)
    # in the round pipeline: the link and the host are busy equally long per round
    r = _round(_sc(host_attention="auto"))
    assert r.host_share == pytest.approx(split.share)
    assert r.host_s == pytest.approx(r.link_s, rel=1e-6)
    assert r.host_bytes / r.host_rate == pytest.approx(r.host_s, rel=1e-6)


def test_host_attention_beats_streaming_when_link_bound() -> None:
    off, on = _round(_sc()), _round(_sc(host_attention="auto"))
    assert on.period_s < off.period_s / 3  # 50 GB/s link + ~380 GB/s host
    assert on.link_bytes + on.host_bytes == pytest.approx(off.link_bytes)


def test_more_gpus_per_host_lower_the_host_rate() -> None:
    rates = [host_split(_sc(g).costs, positions=5).host_rate for g in (1, 2, 4, 8)]
    assert all(a > b > 0 for a, b in zip(rates, rates[1:], strict=False))
    # 8 GPUs: 430 / 8 GB/s each, less the link's own 50 GB/s of DMA reads
    assert rates[-1] == pytest.approx(430e9 / 8 - 50e9)
    periods = [_round(_sc(g, host_attention="auto")).period_s for g in (1, 8)]
    assert periods[0] < periods[1]


def test_trees_lower_the_host_rate() -> None:
    costs = _sc().costs
    chain = host_split(costs, positions=1 + 4)
    tree = host_split(costs, positions=1 + TREE.num_nodes)
    assert tree.host_rate < chain.host_rate
    assert tree.bound == "compute"
    assert tree.host_rate == pytest.approx(8e12 / (4 * 33))
    amx = host_split(_sc(isa="amx").costs, positions=1 + TREE.num_nodes)
    assert tree.host_rate < amx.host_rate
    assert _round(_sc(host_attention="auto"), TREE).host_share < \
        _round(_sc(host_attention="auto")).host_share


def test_off_is_the_old_result() -> None:
    old = _round(_sc())
    for sc in (_sc(host_attention="off"), _sc(8, "amx", host_attention="off")):
        r = _round(sc)
        assert (r.period_s, r.link_s, r.link_bytes) == (old.period_s, old.link_s, old.link_bytes)
        assert r.host_s == r.host_share == 0.0
    assert host_split(_sc().costs, 5, on=False).share == 0.0


def test_auto_turns_off_where_it_does_not_pay() -> None:
    # a host with no bandwidth left over the link's DMA reads: nothing to split
    hw = replace(get_hardware("H200", 5), host_bytes_per_s=40e9)
    sc = Scenario.from_names(hw, "Qwen3-8B", "Qwen3-0.6B", (32768,), 8, 0.75,
                             policy=SimPolicy(residency="tail", host_attention="auto"))
    r = _round(sc)
    assert r.host_share == 0.0
    assert r.period_s == _round(_sc()).period_s


def test_host_attention_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--host-attention-table"]) == 0
    out = capsys.readouterr().out
    assert "untested" in out and "430 GB/s" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "auto" in line]
    assert len(rows) == 8  # 1, 2, 4, 8 GPUs per host x chains, trees
    gains = [float(line.rsplit("|", 2)[-2].strip().rstrip("x")) for line in rows[::2]]
    assert gains[0] > gains[-1] >= 1.0  # one GPU per host gains most, eight the least
