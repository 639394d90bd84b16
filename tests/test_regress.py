"""bench/regress.py, the regression guard: its comparison flags a figure that got worse beyond
the spread of its repeats and passes one that did not, merged reports keep every repeat, and a
smoke-sized run writes figures with spreads (no timing is asserted: speeds belong to the
guard's own runs, not to tests)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "bench" / "regress.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("regress", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


regress = _load()


def _report(figures: dict[str, list[Any]], sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"sizes": sizes or {"link_bound": [2048, 4, 32]}, "repeats": 3, "wall_s": 1.0,
            "warnings": [], "runs": {"r": {"wall_s": regress.spread([1.0, 2.0, 3.0])}},
            "figures": {k: regress.summary(k, v) for k, v in figures.items()}}


A = {"link_bound.trees_over_offload_spec": [1.38, 1.40, 1.42],
     "host_over_link": [0.088, 0.090, 0.093],
     "outputs_match_reference": [True, True, True]}


def _verdicts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, str]:
    rows, _ = regress.compare(a, b)
    return {r["figure"]: r["verdict"] for r in rows}


def test_an_equal_report_passes_and_a_worse_one_is_flagged(tmp_path, capsys):
    a = _report(A)
    assert set(_verdicts(a, _report(A)).values()) == {"within"}
    # the same spread shifted by less than it: still within
    close = {**A, "link_bound.trees_over_offload_spec": [1.37, 1.39, 1.41]}
    assert _verdicts(a, _report(close))["link_bound.trees_over_offload_spec"] == "within"
    # higher is better: lower than every repeat of A is worse; lower is better for
    # host_over_link: higher than every repeat is worse; a differing output is worse
    worse = {"link_bound.trees_over_offload_spec": [1.20, 1.22, 1.25],
             "host_over_link": [0.120, 0.125, 0.130],
             "outputs_match_reference": [True, False, True]}
    assert set(_verdicts(a, _report(worse)).values()) == {"worse"}
    # and the other way round it is better, not worse
    flipped = _verdicts(_report({k: v for k, v in worse.items()
                                 if k != "outputs_match_reference"}), a)
    assert flipped["link_bound.trees_over_offload_spec"] == "better"
    assert flipped["host_over_link"] == "better"
    assert flipped["outputs_match_reference"] == "missing in A"
    # the command line: exit 1 and the figure marked when B is worse, 0 when equal
    pa, pb, pe = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "e.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(_report(worse)))
    pe.write_text(json.dumps(_report(A)))
    assert regress.main(["--compare", str(pa), str(pb)]) == 1
    assert "**WORSE**" in capsys.readouterr().out
    assert regress.main(["--compare", str(pa), str(pe)]) == 0
    assert "WORSE" not in capsys.readouterr().out


def test_one_outlier_repeat_does_not_flag_a_figure():
    """Worse beyond the spread takes both sides: B's median below every repeat of A and A's
    median above every repeat of B. One slow repeat of B (a busy machine) is within."""
    a = _report(A)
    b = _report({**A, "link_bound.trees_over_offload_spec": [1.10, 1.39, 1.41]})
    assert _verdicts(a, b)["link_bound.trees_over_offload_spec"] == "within"
    # a wide spread of A hides a small shift; it does not hide a large one
    wide = _report({**A, "link_bound.trees_over_offload_spec": [1.0, 1.4, 1.8]})
    assert _verdicts(wide, _report({**A, "link_bound.trees_over_offload_spec":
                                    [1.2, 1.3, 1.35]}))[
        "link_bound.trees_over_offload_spec"] == "within"
    assert _verdicts(wide, _report({**A, "link_bound.trees_over_offload_spec":
                                    [0.7, 0.8, 0.9]}))[
        "link_bound.trees_over_offload_spec"] == "worse"


def test_a_figure_that_is_zero_in_both_compares_as_equal():
    """Bytes a round can be 0 on both sides (nothing to move): the table says so, not a
    division by zero; from 0 to more is worse where lower is better."""
    zero = {**A, "sharing.bytes_on_over_off": [0.0, 0.0, 0.0]}
    rows, notes = regress.compare(_report(zero), _report(zero))
    table = regress.format_comparison(rows, notes)
    assert "| sharing.bytes_on_over_off | lower |" in table
    assert "equal (0)" in table and "WORSE" not in table
    rows, notes = regress.compare(_report(zero),
                                  _report({**zero, "sharing.bytes_on_over_off": [0.1, 0.1, 0.1]}))
    table = regress.format_comparison(rows, notes)
    assert "from 0" in table and "**WORSE**" in table


def test_reports_of_other_workloads_are_noted():
    _, notes = regress.compare(_report(A), _report(A, sizes={"link_bound": [1024, 4, 16]}))
    assert notes and "different workloads" in notes[0]
    _, notes = regress.compare(_report(A), _report(A))
    assert notes == []


def test_merged_reports_keep_every_repeat():
    one = _report(A)
    two = _report({**A, "host_over_link": [0.2, 0.3, 0.1]})
    m = regress.merge([one, two])
    fig = m["figures"]["host_over_link"]
    assert fig["values"] == [0.088, 0.090, 0.093, 0.2, 0.3, 0.1]
    assert (fig["min"], fig["max"]) == (0.088, 0.3)
    assert fig["median"] == (0.093 + 0.1) / 2
    assert m["repeats"] == 6 and m["merged_from"] == 2
    assert m["runs"]["r"]["wall_s"]["values"] == [1.0, 2.0, 3.0] * 2
    assert m["figures"]["outputs_match_reference"]["all"] is True
    # the inputs are left as they were
    assert one["figures"]["host_over_link"]["values"] == [0.088, 0.090, 0.093]


def test_a_smoke_run_writes_each_figure_with_its_spread(tmp_path):
    out = tmp_path / "regress.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(SCRIPT), "--size", "smoke", "--groups",
                    "host_overhead,residency,sharing", "--out", str(out)], check=True, env=env,
                   capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    assert r["size"] == "smoke" and r["repeats"] == 2
    assert set(r["figures"]) == {"host_over_link", "residency.fill_bytes_over_floor",
                                 "sharing.specstream_on_over_off", "sharing.bytes_on_over_off",
                                 "outputs_match_reference"}
    # a shared document never moves more with sharing than its copies do without
    assert r["figures"]["sharing.bytes_on_over_off"]["max"] <= 1.0 + 1e-9
    for name in ("host_over_link", "residency.fill_bytes_over_floor",
                 "sharing.specstream_on_over_off"):
        fig = r["figures"][name]
        assert len(fig["values"]) == 2 and all(math.isfinite(v) for v in fig["values"])
        assert fig["min"] <= fig["median"] <= fig["max"]
    # the floor is the least any residency could move on that budget: fill cannot beat it
    assert r["figures"]["residency.fill_bytes_over_floor"]["min"] >= 1.0 - 1e-9
    # per repeat: the residency run's, and the sharing runs' (on against off)
    assert r["figures"]["outputs_match_reference"]["values"] == [True] * 4
    run = r["runs"]["residency_fill_half"]
    assert len(run["decode_only_link_utilization"]["values"]) == 2
    assert run["link_bytes_floor_per_round"]["min"] > 0  # history did stream
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert r["revision"] == head


def test_it_refuses_to_measure_a_package_from_another_checkout(tmp_path):
    """A copy of the script outside this checkout would measure this checkout's package
    (PYTHONPATH names this one), not its own: it says so and stops."""
    (tmp_path / "bench").mkdir()
    copy = tmp_path / "bench" / "regress.py"
    copy.write_text(SCRIPT.read_text())
    beside = SCRIPT.with_name("regress_report.py")  # copied with it, as its docstring says
    (tmp_path / "bench" / beside.name).write_text(beside.read_text())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(copy), "--size", "smoke", "--groups", "residency"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "not from this checkout" in p.stderr
