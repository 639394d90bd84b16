"""Simulator: the ``fill`` residency (water-filled device shares, only the overflow streams)
against the fixed ``tail``, in the datacenter model, the CLI and the bench replay."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from specstream.sim import AcceptanceModel, Scenario, SimPolicy
from specstream.sim.calibrate import load_bench, residency_of
from specstream.sim.cli import add_parser
from specstream.sim.costs import FittedCosts, LinearFit, PrefillFit
from specstream.sim.memory import link_bytes_per_round, max_concurrency, plan
from specstream.sim.replay import replay, setups
from specstream.sim.residency import fill_level, fill_targets
from specstream.sim.rounds import simulate_round

BENCH_STEPS = Path(__file__).parent / "data" / "bench_cpu_steps.json"  # a tail run (0.5 GB/s)
# a fill run of the current engine: 6 x 2048-token prompts, 48 output tokens, 1 GB/s
BENCH_A = Path(__file__).parents[1] / "bench" / "results" / "sim-calib-A.json"
ALPHA = AcceptanceModel(alpha=0.5)
KV = 1000.0  # target KV bytes per token of the toy costs
WEIGHTS = 1e6 + 1e5  # target + draft


def toy_costs(budget: float, host: float = 1e15) -> FittedCosts:
    """4 target layers, KV 1 kB/token (draft 0.5 kB), constant-time forwards."""
    return FittedCosts(link_bw=1e9, device_budget_bytes=budget, host_budget_bytes=host,
                       num_layers=(4, 2), kv_per_token=(KV, 500.0), weights=(1e6, 1e5),
                       forward=(LinearFit(const_s=0.01), LinearFit(const_s=0.002)),
                       prefill=(PrefillFit(const_s=0.001), PrefillFit()))


# a one-token draft window keeps the draft's KV out of the arithmetic (500 B per request)
FILL = SimPolicy(q=2, resident_tail=100, offload_threshold=0, chunk_tokens=1000,
                 draft_window=1, rounds=4)
TAIL = replace(FILL, residency="tail")
# specstream, two requests of one per group: weights, two draft tokens, 2 staging slots of
# a 1000-token chunk of one request in one layer (250 B/token)
FIXED = WEIGHTS + 2 * 500 + 2 * 1000 * 250


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["simulate", *argv])
    return int(args.func(args))


def test_policy_validates_residency() -> None:
    assert SimPolicy().residency == "fill"
    with pytest.raises(ValueError, match="residency"):
        SimPolicy(residency="most")


def test_fill_targets_are_the_engines_shares() -> None:
    """Short requests keep everything, the others split the rest; a floor above the level
    holds; the restore room of what does not stay counts against the capacity."""
    needs = [100.0, 1000.0, 1000.0]
    targets = fill_targets(1100.0, needs, [0.0] * 3)
    assert targets == [100, 500, 500] and fill_level(targets, needs) == 500.0
    needs4, floors = [100.0, 1000.0, 1000.0, 1000.0], [0.0, 600.0, 0.0, 0.0]
    assert fill_targets(1700.0, needs4, floors) == [100, 600, 500, 500]
    assert fill_targets(5000.0, needs, [0.0] * 3) == [100, 1000, 1000]  # everything fits
    assert fill_level([100, 1000, 1000], needs) == 1000.0
    assert fill_targets(100.0, needs4, floors) == [0, 600, 0, 0]  # not even the floors
    # restore modes: kept + f x (total - kept) <= free, as much as fits
    kept = sum(fill_targets(700.0, [500.0, 500.0], [0.0, 0.0], restore_fraction=0.5))
    assert kept + 0.5 * (1000 - kept) <= 700 < kept + 2 + 0.5 * (1000 - kept - 2)


def test_fill_targets_fill_the_capacity_fairly() -> None:
    rng = np.random.default_rng(0)
    for _ in range(100):
        needs = [float(x) for x in rng.integers(1, 1000, size=int(rng.integers(1, 12)))]
        floors = [float(min(n, f)) for n, f in zip(needs, rng.integers(0, 300, len(needs)),
                                                    strict=True)]
        capacity = float(rng.integers(int(sum(floors)), int(sum(needs)) + 1))
        kept = fill_targets(capacity, needs, floors)
        assert sum(kept) <= capacity and sum(kept) > capacity - len(needs)
        assert all(f <= k <= n for k, f, n in zip(kept, floors, needs, strict=True))
        level = fill_level(kept, needs, floors)
        for k, f, n in zip(kept, floors, needs, strict=True):  # between floor and need:
            if f < k < n:  # at the common level
                assert k == level


def test_fill_streams_only_what_its_share_does_not_hold() -> None:
    """Two 10k-token requests, room for 12k tokens of history: each keeps 6k, streams 4k;
    the fixed tail keeps 100 and streams 9,900."""
    costs, ctx = toy_costs(FIXED + 12_000 * KV), [10_000.0, 10_000.0]
    assert plan("specstream", costs, FILL, ctx).share == pytest.approx(6000.0)
    fill = simulate_round("specstream", costs, FILL, ctx, 2, ALPHA)
    tail = simulate_round("specstream", costs, TAIL, ctx, 2, ALPHA)
    assert fill.link_bytes == pytest.approx(2 * 4000 * KV)
    assert tail.link_bytes == pytest.approx(2 * 9900 * KV)
    assert fill.link_s == pytest.approx(fill.link_bytes / costs.link_bw, rel=1e-6)
    assert fill.period_s < tail.period_s  # link-bound: fewer bytes, shorter round


def test_fill_short_request_keeps_everything_and_the_rest_split() -> None:
    costs = toy_costs(WEIGHTS + 3 * 500 + 2 * 1000 * 2 * 250 + 12_000 * KV)  # groups of 2, 1
    ctx = [2000.0, 10_000.0, 10_000.0]
    share = plan("specstream", costs, FILL, ctx).share
    assert share == pytest.approx(5000.0)
    assert [FILL.cold_tokens("specstream", c, share) for c in ctx] == \
        pytest.approx([0.0, 5000.0, 5000.0])
    assert link_bytes_per_round("specstream", costs, FILL, ctx) == pytest.approx(10_000 * KV)


def test_fill_without_room_beyond_the_tails_is_the_tail() -> None:
    costs, ctx = toy_costs(FIXED + 2 * 100 * KV), [10_000.0, 10_000.0]
    assert plan("specstream", costs, FILL, ctx).fits
    assert not plan("specstream", toy_costs(FIXED + 2 * 100 * KV - 1), FILL, ctx).fits
    fill = simulate_round("specstream", costs, FILL, ctx, 2, ALPHA)
    tail = simulate_round("specstream", costs, TAIL, ctx, 2, ALPHA)
    assert fill.link_bytes == pytest.approx(tail.link_bytes) and tail.link_bytes > 0
    assert fill.period_s == pytest.approx(tail.period_s)


@pytest.mark.parametrize("mode", ["offload", "offload-spec", "specstream", "parallel-spec"])
def test_fill_with_room_for_all_the_kv_streams_nothing(mode: str) -> None:
    costs, ctx = toy_costs(1e12), [10_000.0, 30_000.0]
    q = 0 if mode == "offload" else 2
    fill = simulate_round(mode, costs, FILL, ctx, q, ALPHA)
    assert (fill.link_bytes, fill.link_s) == (0.0, 0.0)
    assert not any(t.kind == "link" for t in fill.tasks)
    assert simulate_round(mode, costs, TAIL, ctx, q, ALPHA).link_bytes == \
        pytest.approx((9900 + 29_900) * KV)


def test_fill_restore_modes_keep_two_layers_of_what_moves() -> None:
    """offload-spec: the residency and the restore room (2 of 4 layers of the history that is
    not resident) share the free memory; the batch restores in one piece."""
    ctx = [10_000.0, 10_000.0]
    free = 15_000 * KV
    costs = toy_costs(WEIGHTS + 2 * 500 + free)
    p = plan("offload-spec", costs, FILL, ctx)
    kept = sum(min(c, max(100.0, p.share)) for c in ctx)
    assert kept + 0.5 * (sum(ctx) - kept) == pytest.approx(15_000)  # all the free memory
    assert p.device_bytes == pytest.approx(costs.device_budget_bytes)
    assert p.sub_batch == 2 and p.host_bytes == sum(ctx) * KV  # write-through: all of it


def test_fill_admits_on_host_room_not_whole_histories() -> None:
    """The device holds 10 whole requests (resident admits 10); fill admits past that, until
    the host, which holds every request's full history, is full."""
    costs = toy_costs(WEIGHTS + 10 * (1000 * KV + 500), host=30 * 1000 * KV)
    fill = replace(FILL, chunk_tokens=100)  # a small staging ring: 25 tokens' room a request
    assert max_concurrency("resident", costs, fill, 1000) == 10
    assert max_concurrency("specstream", costs, fill, 1000) == 30  # 30 full histories
    tail = replace(fill, residency="tail")
    assert max_concurrency("specstream", costs, tail, 1000) == 33  # 33 x 900 cold tokens
    # with room on the host, the device's minimum decides: tails, draft KV, staging
    roomy = toy_costs(costs.device_budget_bytes)
    n = max_concurrency("specstream", roomy, fill, 1000)
    assert n == (costs.device_budget_bytes - WEIGHTS) // ((100 + 25) * KV + 500)


def test_h200_qwen3_8b_32_requests_of_32k_fill_against_tail() -> None:
    """The issue's setting: 32 x 32K on an H200; fill moves well under half of tail's bytes
    per round and the link-bound round shortens with them."""
    sc = Scenario.from_names("H200", "Qwen3-8B", "Qwen3-0.6B", (32768,), concurrency=32,
                             policy=SimPolicy(q=4))
    ctx = [32768.0] * 32
    fill = simulate_round("specstream", sc.costs, sc.policy, ctx, 4, sc.acceptance)
    tail = simulate_round("specstream", sc.costs, replace(sc.policy, residency="tail"), ctx, 4,
                          sc.acceptance)
    assert tail.link_bytes == pytest.approx(32 * (32768 - 512) * 144 * 1024)
    assert tail.link_bytes / fill.link_bytes > 2.0
    assert tail.period_s / fill.period_s > 2.0
    # what stays is what the device has left: usable memory less weights, draft KV, staging
    kept = 32 * 32768 * 144 * 1024 - fill.link_bytes
    assert 80e9 < kept < sc.costs.device_budget_bytes - 16e9


def test_cli_residency_flag_and_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--hardware", "L40S", "--context", "16384", "--concurrency", "4",
             "--output-len", "8", "--q", "2"]
    assert _cli([*small, "--modes", "specstream", "--residency", "tail"]) == 0
    out = capsys.readouterr().out
    assert "residency tail 512" in out and "Residency fill" not in out
    assert _cli([*small, "--modes", "specstream"]) == 0  # fill by default
    assert "Residency fill (specstream, 4 requests" in capsys.readouterr().out
    assert _cli([*small, "--modes", "offload,specstream", "--compare-residency"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| specstream")]
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert float(cells[3]) < float(cells[2])  # link GB per round: fill under tail
    with pytest.raises(SystemExit):
        _cli([*small, "--residency", "most"])


def test_replay_runs_the_residency_of_a_bench_run() -> None:
    """The replay drives the engine's scheduler with the run's own settings: its ``fill``
    residency keeps most of the history on the device; the same run as ``tail`` streams
    much more of it (the engine's KVManager decides what each step reads from the host)."""
    data = json.loads(BENCH_A.read_text())
    assert residency_of(data) == "fill" and load_bench(BENCH_A)[0].policy.residency == "fill"
    tailed = {**data, "settings": {**data["settings"], "residency": "tail"}}
    fill_runs, tail_runs = setups(data), setups(tailed)
    for mode in ("offload-spec", "specstream"):
        assert (fill_runs[mode].config.residency, tail_runs[mode].config.residency) == (
            "fill", "tail")
        fill, tail = replay(fill_runs[mode]).result, replay(tail_runs[mode]).result
        # 6 x 2k-token requests against a 64 MiB budget that holds ~11k tokens: most of the
        # history stays under fill, so the link is much less busy
        assert fill.link_utilisation < 0.5 * tail.link_utilisation, mode
