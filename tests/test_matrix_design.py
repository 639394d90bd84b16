"""bench/matrix.py: its reduced design covers every level of every factor, roughly balanced,
and its fixed grid spells out every policy knob; bench/matrix_report.py computes the cell
figures (ratios, floors, targets) from a hand-built record (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[1]


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


matrix = _load("matrix")
report = matrix.report


def test_design_covers_every_level_of_every_factor() -> None:
    assert len(matrix.DESIGN) == 12
    assert len({c.name for c in matrix.DESIGN}) == 12
    for factor, levels in matrix.FACTORS.items():
        seen = Counter(getattr(c, factor) for c in matrix.DESIGN)
        assert set(seen) == set(levels), factor
        # balanced: every level equally often (12 cells over 3 or 2 levels)
        assert set(seen.values()) == {12 // len(levels)}, (factor, seen)
    # each kind of prompt meets every level of the other factors
    for factor in ("context", "requests", "budget", "link_gbps"):
        pairs = Counter((getattr(c, factor), c.prompts) for c in matrix.DESIGN)
        assert len(pairs) == 3 * 2, factor


def test_fixed_points_do_not_follow_the_defaults() -> None:
    """Every fixed point names the policy, the host attention, the residency and the groups
    (the defaults may change under it); the default run names only the workload's facts."""
    runs = matrix.configs(10 << 20, 0.5, tuple(matrix.GRID))
    facts = {"mode", "device", "device_kv_bytes", "link_gbps"}
    assert set(runs["default"]) == facts
    for name in (*matrix.GRID, matrix.BASELINE):
        kw = runs[name]
        assert {"host_attention", "residency", "merge_groups", "speculative_policy"} <= set(kw)
        assert kw["speculative_policy"] == "fixed"
    assert runs["q0"]["mode"] == "stream" and runs["q0"]["proposer"] is None
    assert runs["q8"]["num_speculative_tokens"] == 8
    assert runs[matrix.BASELINE]["mode"] == "offload-spec"
    assert runs[matrix.BASELINE]["num_speculative_tokens"] == 4


def _run(tok_s: float, match: bool = True, per_round: float = 0.0,
         floor: float = 0.0) -> dict[str, Any]:
    return {"output_tokens_per_s": tok_s, "mean_accepted_len": 2.0, "tpot_s": 0.1,
            "outputs_match_reference": match, "link_bytes_per_round": per_round,
            "link_bytes_floor_per_round": floor}


def _record(**sim: Any) -> dict[str, Any]:
    return {
        "cell": {"name": "cx", "context": 1024, "budget": 0.3, "link_gbps": 0.5,
                 "prompts": "text"},
        "context_lengths": [1024] * 4, "output_len": 32,
        "workload_kv_bytes": 4 * (1024 + 32) * 6144,
        "runs": {"resident": _run(30.0), "default": _run(19.0, per_round=9e6, floor=6e6),
                 "q2": _run(18.0), "q4": _run(20.0, per_round=6.3e6, floor=6e6),
                 "tree": _run(17.0, match=False), "q4-tail": {"error": "ValueError: refused"},
                 "offload-spec-q4": _run(10.0)},
        "run_seconds": {"resident": 10.0, "default": 10.0, "q4": 10.0},
        "sim": sim,
    }


def test_report_ratios_from_a_hand_built_record() -> None:
    a = report.analyse(_record(default={"throughput_error": -0.20, "tpot_error": 0.10}))
    assert a["best_fixed"] == "q4" and a["best_fixed_tok_s"] == 20.0  # resident is no fixed point
    assert a["default_over_best_fixed"] == pytest.approx(0.95)
    assert a["default_over_offload_spec"] == pytest.approx(1.9)
    assert a["fill_bytes_over_floor"] == pytest.approx(1.05)  # the q = 4 fill run's
    assert a["default_bytes_over_floor"] == pytest.approx(1.5)
    assert a["failed"] == ["q4-tail"] and a["outputs_differ"] == ["tree"]
    assert a["meets"] == {"default_vs_best_fixed": False,
                          "default_vs_best_fixed_confirmed": None, "fill_vs_floor": True,
                          "sim_throughput": False, "sim_tpot": True, "outputs_match": False}


def test_the_confirmed_ratio_is_the_fresh_runs_medians() -> None:
    """The best fixed point is picked on its own (selected-for) run; the confirmed ratio is
    the default's fresh runs over that point's fresh runs, and their outputs count too."""
    rec = _record()
    rec["confirm"] = {"best_fixed": "q4", "runs": {"default": [19.0, 20.0, 21.5],
                                                    "q4": [19.5, 20.5, 40.0]},
                      "outputs_match_reference": False}
    a = report.analyse(rec)
    assert a["default_over_best_fixed"] == pytest.approx(0.95)
    assert a["default_over_best_fixed_confirmed"] == pytest.approx(20.0 / 20.5)
    assert a["meets"]["default_vs_best_fixed_confirmed"] is True
    assert "confirm" in a["outputs_differ"] and a["meets"]["outputs_match"] is False
    rec["analysis"] = a
    s = report.summary([rec])
    assert s["default_vs_best_fixed_confirmed"] == {"met": 1, "of": 1}
    out = {"quick": True, "grid": ["q2", "q4", "tree", "q4-tail"], "cells": [rec],
           "summary": s, "wall_s": 60.0, "estimated_full_run_s": {"32": 600.0}}
    assert "0.976 (q4; 19.0, 20.0, 21.5 / 19.5, 20.5, 40.0)" in report.markdown(out)


def test_the_replay_at_the_cells_own_speed_is_reported_apart_from_the_target() -> None:
    """The replay at the cell's compute speed is shown and counted, never as the target."""
    rec = _record(default={"throughput_error": -0.20, "tpot_error": 0.10,
                           "compute_ratio": 0.8, "throughput_error_own_speed": 0.04,
                           "tpot_error_own_speed": -0.30})
    a = report.analyse(rec)
    assert a["sim_default_compute_ratio"] == 0.8
    assert a["meets"]["sim_throughput"] is False  # the target reads the other cells' speed
    rec["analysis"] = a
    s = report.summary([rec, {**_record(), "analysis": report.analyse(_record())}])
    assert s["own_speed"] == {"throughput": {"within": 1, "of": 1},
                              "tpot": {"within": 0, "of": 1}}
    assert s["sim_throughput"] == {"met": 0, "of": 1}
    out = {"quick": True, "grid": ["q2", "q4", "tree", "q4-tail"], "cells": [rec],
           "summary": s, "wall_s": 60.0, "estimated_full_run_s": {"32": 600.0}}
    md = report.markdown(out)
    assert "+4% / -30% (x0.80)" in md
    assert "within 15% throughput in 1/1, within 25% TPOT in 0/1" in md
    assert "own_speed" not in md.split("Targets met")[1].split("\n")[0]


def test_report_on_a_zero_floor_and_without_a_replay() -> None:
    """A floor of 0 is met only by moving nothing; no replay leaves its targets undefined."""
    rec = _record()
    rec["runs"]["q4"]["link_bytes_floor_per_round"] = 0.0  # nothing had to stream
    a = report.analyse(rec)
    assert a["fill_bytes_over_floor"] is None and a["meets"]["fill_vs_floor"] is False
    assert a["meets"]["sim_throughput"] is None
    rec["runs"]["q4"]["link_bytes_per_round"] = 0.0
    assert report.analyse(rec)["meets"]["fill_vs_floor"] is True
    del rec["runs"]["q4"]
    a = report.analyse(rec)
    assert a["meets"]["fill_vs_floor"] is None and a["best_fixed"] == "q2"
    rec["analysis"] = a
    s = report.summary([rec])
    assert s["fill_vs_floor"] == {"met": 0, "of": 0}
    assert s["default_vs_best_fixed"] == {"met": 1, "of": 1}  # 19 over q2's 18
    assert s["failed_runs"] == {"cx": ["q4-tail"]}
    out = {"quick": True, "grid": ["q2", "q4", "tree", "q4-tail"], "cells": [rec],
           "summary": s, "wall_s": 60.0, "estimated_full_run_s": {"32": 600.0}}
    md = report.markdown(out)
    assert "| cx |" in md and "refused" in md and "NO: tree" in md


def test_estimate_scales_with_the_measured_time() -> None:
    rec = _record()
    cell = matrix.DESIGN[0]
    one = report.estimate_seconds([rec], [cell], ("q4",), 32)
    rec["run_seconds"] = {k: 2 * v for k, v in rec["run_seconds"].items()}
    assert report.estimate_seconds([rec], [cell], ("q4",), 32) == pytest.approx(2 * one)
    assert report.rel_error(11.0, 10.0) == pytest.approx(0.1)


def test_the_calibration_pair_has_two_prompt_lengths_and_never_the_cell() -> None:
    """A cell's replay fits its costs on the next cell and the first after it whose prompts
    are of another length (``--calibration pair``), or on the next alone (``next``); of
    those, the first whose default run held another number of requests at once."""
    cells = [{"cell": {"name": c.name, "context": c.context}} for c in matrix.DESIGN]
    for i, cell in enumerate(cells):
        pair = matrix.sim.sources_of(cells, i, "pair")
        assert cell not in pair and pair[0] is cells[(i + 1) % len(cells)]
        assert len(pair) == 2 and pair[0]["cell"]["context"] != pair[1]["cell"]["context"]
        assert matrix.sim.sources_of(cells, i, "next") == [pair[0]]
    one_length = [{"cell": {"name": f"x{i}", "context": 1024}} for i in range(3)]
    assert len(matrix.sim.sources_of(one_length, 0, "pair")) == 1  # no other length to pair

    def cell(name: str, context: int, at_once: int) -> dict:
        return {"cell": {"name": name, "context": context},
                "_steps": {"default": {"max_concurrency": at_once}}}

    run = [cell("a", 1024, 1), cell("b", 3072, 3), cell("c", 6144, 3), cell("d", 1024, 1),
           cell("e", 6144, 1)]
    # for a: b, then c has another length but as many at once as b; d has both
    assert [r["cell"]["name"] for r in matrix.sim.sources_of(run, 0, "pair")] == ["b", "d"]
    # for d: e, then a has another length but as many at once as e; b has both
    assert [r["cell"]["name"] for r in matrix.sim.sources_of(run, 3, "pair")] == ["e", "b"]
    # without another count, the first of another length
    same = [cell("a", 1024, 3), cell("b", 3072, 3), cell("c", 6144, 3)]
    assert [r["cell"]["name"] for r in matrix.sim.sources_of(same, 0, "pair")] == ["b", "c"]


def test_saved_steps_replay_to_the_same_figures(tmp_path: Path) -> None:
    """``--save-steps`` then ``--replay-only``: the runs' figures come back as they were (one
    cell: nothing to replay it from, so only the analysis is recomputed)."""
    rec = {"cell": {"name": "c01", "context": 1024, "budget": 0.6, "link_gbps": 0.1,
                    "prompts": "text"}, "context_lengths": [1024] * 2,
           "output_len": 32, "repeats": 1,
           "runs": {n: {"output_tokens_per_s": t, "mean_accepted_len": 1.0,
                        "outputs_match_reference": True}
                    for n, t in (("resident", 10.0), ("default", 9.8), ("q0", 10.0))},
           "_steps": {}, "_configs": {}}
    out = {"quick": False, "grid": ["q0"], "wall_s": 60.0, "repeats": 1,
           "estimated_full_run_s": {"32": 600.0}}
    path = tmp_path / "m-steps.pkl.gz"
    matrix.sim.save_steps(out, [rec], path)
    assert matrix.sim.replay_only(path, tmp_path, None) == 0
    again = json.loads((tmp_path / "m-replay.json").read_text())
    assert again["cells"][0]["runs"] == rec["runs"]
    assert again["cells"][0]["analysis"]["default_over_best_fixed"] == pytest.approx(0.98)


def test_confirm_best_runs_the_default_and_the_fastest_fixed_point_alternately() -> None:
    runs = {"resident": {"output_tokens_per_s": 99.0}, "default": {"output_tokens_per_s": 9.0},
            "q2": {"output_tokens_per_s": 10.0}, "q4": {"output_tokens_per_s": 12.0},
            "tree": {"error": "ValueError: refused"},
            matrix.BASELINE: {"output_tokens_per_s": 50.0}}
    todo = [(n, {"name": n}) for n in ("default", "q2", "q4", "tree", matrix.BASELINE)]
    order = []

    def run(kw):
        order.append(kw["name"])
        return {"output_tokens_per_s": float(len(order))}, [[1]], None

    got = matrix.confirm_best(runs, todo, 2, run, [[1]], lambda msg: None)
    assert got["best_fixed"] == "q4"  # not the baseline, the reference or a refused point
    assert order == ["default", "q4", "default", "q4"]
    assert got["runs"] == {"default": [1.0, 3.0], "q4": [2.0, 4.0]}
    assert got["outputs_match_reference"] is True
    refused = {**runs, "default": {"error": "ValueError: refused"}}
    assert matrix.confirm_best(refused, todo, 2, run, [[1]], lambda msg: None) == {}
