"""The ablation ladder in the roofline round pipeline, and the levers of issue 19: a KV dtype
apart from the weights' and a fixed cost per copy on the link."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from specstream.engine.policy.round_shape import AcceptanceEstimate, Shape, expected_tokens
from specstream.engine.policy.shaping import RoundShaper
from specstream.sim.api import Scenario
from specstream.sim.cli import main
from specstream.sim.hardware import get_hardware
from specstream.sim.ladder import LADDER, ladder, round_costs
from specstream.sim.pipeline import Batch
from specstream.sim.policy import SimPolicy
from specstream.sim.rounds import simulate_round

LADDER_JSON = Path(__file__).parents[1] / "bench" / "results" / "ladder-link-bound.json"


def _h200(concurrency: int = 32, **policy: object) -> Scenario:
    return Scenario.from_names("H200", "Qwen3-8B", "Qwen3-0.6B", (32768,), concurrency, 0.75,
                               pcie_gen=5, policy=SimPolicy(**policy))  # type: ignore[arg-type]


def test_the_ladder_uses_the_engines_shapes_and_acceptance() -> None:
    sc = _h200()
    rows = ladder(sc, 0.75, 32)
    assert [r.step for r in rows] == list(LADDER)
    assert [r.shape for r in rows[:3]] == [Shape(4)] * 3
    for row in rows:
        shaper = RoundShaper(row.step.max_depth, row.step.drafting, max_topk=row.step.topk,
                             max_nodes=row.step.max_nodes, prior_acceptance=0.75)
        assert row.shape in shaper.candidates
        assert row.result.tokens_per_round == pytest.approx(
            expected_tokens(row.shape, shaper.acceptance))
    # link-bound (32 x 32K of Qwen3-8B over PCIe 5): verification of more positions is free
    # next to the link, so the auto policy takes long chains, then trees, and each pays
    assert rows[3].shape.depth > 4 and rows[4].shape.topk == 4
    rates = [r.tokens_per_s for r in rows]
    assert rates[4] > rates[3] > rates[2] >= rates[1] > rates[0]
    # streaming moves no more history than the layer-wise restore (no restore room)
    assert rows[1].result.link_bytes <= rows[0].result.link_bytes


def test_a_tree_costs_verification_per_node_and_drafting_per_level() -> None:
    sc = _h200(residency="tail")
    b = Batch(sc.costs, sc.policy, (32768.0,) * 8, 0, "specstream")
    tree = replace(b, shape=Shape(4, topk=4, nodes=32))
    chain = replace(b, q=4)
    assert tree.positions == 33 and chain.positions == 5
    ctx = b.contexts
    assert tree.verify_s(ctx) > chain.verify_s(ctx)
    assert tree.levels == chain.levels == 4  # four draft forwards each ...
    assert tree.level_tokens == 8 and chain.level_tokens == 1  # ... of 8 tokens, not 1
    # 8 requests x 8 tokens cost what 8 x 1 do (memory-bound: weights and KV read once); at 64
    # requests the matrix work shows
    assert tree.draft_step_s(ctx) >= chain.draft_step_s(ctx)
    many = (32768.0,) * 64
    assert tree.draft_step_s(many) > chain.draft_step_s(many)
    costs = round_costs(sc, "specstream", ctx, 2)
    assert costs.verify_per_position_s > 0 and costs.link_s > costs.verify_base_s


def test_a_tree_shape_needs_acceptance_by_rank() -> None:
    sc = _h200(residency="tail")
    with pytest.raises(ValueError, match="by rank"):
        simulate_round("specstream", sc.costs, sc.policy, [32768.0] * 4, 0, sc.acceptance,
                       shape=Shape(4, topk=4, nodes=16))


def _solve(f: Callable[[float], float], lo: float, hi: float) -> float:
    """The root of an increasing ``f`` in [lo, hi], by bisection."""
    assert f(lo) < 0 < f(hi)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def test_accepted_tokens_against_the_cpu_ladder() -> None:
    """The CPU ladder's (bench/results/ladder-link-bound.json) q = 4 chain pins the per-token
    acceptance; the engine's expected_tokens then predicts what the 16-deep chains accepted
    (measured 2.51 per round, over depths 8 and 16) within 5%."""
    steps = {s["step"]: s for s in json.loads(LADDER_JSON.read_text())["ladder"]}
    q4 = steps["offload-spec, q = 4 chain"]["mean_accepted_len"]
    alpha = _solve(lambda a: expected_tokens(Shape(4), AcceptanceEstimate(prior=(a,))) - q4,
                   0.01, 0.99)
    chosen = steps["+ adaptive chain (auto, q <= 16)"]["speculative_depth_chosen"]
    est = AcceptanceEstimate(prior=(alpha,))
    predicted = sum(n * expected_tokens(Shape(int(d)), est) for d, n in chosen.items()) / sum(
        chosen.values())
    measured = steps["+ adaptive chain (auto, q <= 16)"]["mean_accepted_len"]
    assert predicted == pytest.approx(measured, rel=0.05)


def test_fp8_kv_halves_kv_bytes_and_link_bytes() -> None:
    sc = _h200(residency="tail")
    fp8 = replace(sc.costs, kv_dtype_bytes=1)
    assert fp8.kv_bytes("target") == sc.costs.kv_bytes("target") / 2 == 72 * 1024
    ctx = [32768.0] * 8
    a = simulate_round("specstream", sc.costs, sc.policy, ctx, 4, sc.acceptance)
    b = simulate_round("specstream", fp8, sc.policy, ctx, 4, sc.acceptance)
    assert b.link_bytes == pytest.approx(a.link_bytes / 2)
    assert b.link_s == pytest.approx(a.link_s / 2, rel=0.01)
    assert fp8.attention_s("target", 1, 1e6) == pytest.approx(
        sc.costs.attention_s("target", 1, 1e6) / 2)
    with pytest.raises(ValueError):
        replace(sc.costs, kv_dtype_bytes=0)


def test_a_copy_costs_per_layer_when_restoring_and_per_chunk_when_streaming() -> None:
    sc = _h200(residency="tail")
    copy = 20e-6
    slow = replace(sc.costs, hardware=get_hardware("H200", 5, link_copy_s=copy))
    ctx = [32768.0] * 4
    layers = sc.costs.layers("target")
    b0 = Batch(sc.costs, sc.policy, tuple(ctx), 4, "offload-spec")
    b1 = replace(b0, costs=slow)
    assert b1.link_s(ctx) - b0.link_s(ctx) == pytest.approx(4 * layers * copy)
    base = simulate_round("specstream", sc.costs, sc.policy, ctx, 4, sc.acceptance)
    more = simulate_round("specstream", slow, sc.policy, ctx, 4, sc.acceptance)
    chunks = -(-(32768 - 512) // sc.policy.chunk_tokens)  # per request per layer
    per_round = 4 * chunks * layers * copy
    assert more.link_s - base.link_s == pytest.approx(per_round, rel=0.01)
    with pytest.raises(ValueError):
        get_hardware("H200", 5, link_copy_s=-1.0)


def test_cli_ladder_and_levers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--hardware", "A100-80GB", "--concurrency", "16", "--ladder"]) == 0
    out = capsys.readouterr().out
    assert "+ trees (auto, top-4, <= 32 nodes, depth <= 8)" in out and "untested" in out
    assert main(["--concurrency", "8", "--modes", "offload-spec", "--kv-dtype", "fp8",
                 "--link-copy-us", "5", "--residency", "tail"]) == 0
    out = capsys.readouterr().out
    assert "72 KiB/token" in out and "5 us per copy" in out
