"""bench/matrix.py's figures: per cell the ratios the issue sets targets for, a summary over
the cells, the markdown table, and the time a matrix would take (pure Python: the tests feed it
hand-built records)."""

from __future__ import annotations

from statistics import median
from typing import Any

# the targets
DEFAULT_OVER_BEST = 0.97  # the default at least this fraction of the best fixed point
FILL_OVER_FLOOR = 1.10  # fill's link bytes per round at most this over the floor
SIM_THROUGHPUT, SIM_TPOT = 0.15, 0.25  # the replay's relative errors, out of sample
BASELINE, REFERENCE, DEFAULT = "offload-spec-q4", "resident", "default"
FILL_RUN = "q4"  # the fixed q = 4 chain with residency fill


def rel_error(predicted: float, measured: float) -> float | None:
    return (predicted - measured) / measured if measured else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def analyse(rec: dict[str, Any]) -> dict[str, Any]:
    """A cell's figures from its record (``runs``: name -> metrics, or ``{"error": ...}``;
    ``sim``: the replay's errors, when there was another cell to fit on)."""
    runs = rec["runs"]
    ok = {n: r for n, r in runs.items() if "error" not in r}
    fixed = {n: r for n, r in ok.items() if n not in (REFERENCE, DEFAULT, BASELINE)}
    tok = {n: r["output_tokens_per_s"] for n, r in ok.items()}
    dec = {n: r.get("decode_only_tokens_per_s") for n, r in ok.items()}
    best = max(fixed, key=lambda n: tok[n]) if fixed else None
    a: dict[str, Any] = {
        "default_tok_s": tok.get(DEFAULT), "best_fixed": best,
        "best_fixed_tok_s": tok.get(best) if best else None,
        "default_over_best_fixed": _ratio(tok.get(DEFAULT), tok.get(best) if best else None),
        # decode-only rounds (no prefill chunk): where the configurations differ most
        "default_over_best_fixed_decode": _ratio(
            dec.get(DEFAULT), max((dec[n] for n in fixed if dec.get(n)), default=None)),
        "offload_spec_tok_s": tok.get(BASELINE),
        "default_over_offload_spec": _ratio(tok.get(DEFAULT), tok.get(BASELINE)),
        "fill_bytes_over_floor": _over_floor(ok.get(FILL_RUN)),
        "fill_bytes_per_round": (ok.get(FILL_RUN) or {}).get("link_bytes_per_round"),
        "fill_floor_per_round": (ok.get(FILL_RUN) or {}).get("link_bytes_floor_per_round"),
        "default_bytes_over_floor": _over_floor(ok.get(DEFAULT)),
        "max_concurrency": {n: r.get("max_concurrency") for n, r in ok.items()},
        "outputs_match": all(r.get("outputs_match_reference") for r in ok.values()),
        "outputs_differ": sorted(n for n, r in ok.items() if not r.get("outputs_match_reference")),
        "failed": sorted(n for n in runs if n not in ok),
    }
    # fresh runs of the default and of the best fixed point, made after the pick (its own
    # run is the fastest of eight noisy ones: bench/matrix.py's confirm_best)
    conf = rec.get("confirm") or {}
    if conf.get("runs"):
        got = {n: median(v) for n, v in conf["runs"].items() if v}
        a["confirmed_best_fixed"] = conf["best_fixed"]
        a["default_over_best_fixed_confirmed"] = _ratio(got.get(DEFAULT),
                                                        got.get(conf["best_fixed"]))
        a["outputs_match"] = a["outputs_match"] and conf["outputs_match_reference"]
        if not conf["outputs_match_reference"]:
            a["outputs_differ"].append("confirm")
    else:
        a["confirmed_best_fixed"] = a["default_over_best_fixed_confirmed"] = None
    sim = rec.get("sim") or {}
    for name, key in ((DEFAULT, "sim_default"), (BASELINE, "sim_offload_spec")):
        a[f"{key}_throughput_error"] = (sim.get(name) or {}).get("throughput_error")
        a[f"{key}_tpot_error"] = (sim.get(name) or {}).get("tpot_error")
        # the replay at the cell's own compute speed: a diagnostic (no target reads it)
        for field in ("compute_ratio", "throughput_error_own_speed", "tpot_error_own_speed"):
            a[f"{key}_{field}"] = (sim.get(name) or {}).get(field)
    a["meets"] = {
        "default_vs_best_fixed": _at_least(a["default_over_best_fixed"], DEFAULT_OVER_BEST),
        "default_vs_best_fixed_confirmed": _at_least(a["default_over_best_fixed_confirmed"],
                                                     DEFAULT_OVER_BEST),
        "fill_vs_floor": _fill_meets(a),
        "sim_throughput": _at_most(_abs(a["sim_default_throughput_error"]), SIM_THROUGHPUT),
        "sim_tpot": _at_most(_abs(a["sim_default_tpot_error"]), SIM_TPOT),
        "outputs_match": a["outputs_match"],
    }
    return a


def _over_floor(r: dict[str, Any] | None) -> float | None:
    """Link bytes per round over the least any residency moves on the budget; None without a
    run, or where the floor is 0 (``_fill_meets`` tells moving nothing from moving some)."""
    if not r or not r.get("link_bytes_floor_per_round"):
        return None
    return r["link_bytes_per_round"] / r["link_bytes_floor_per_round"]


def _fill_meets(a: dict[str, Any]) -> bool | None:
    """Within FILL_OVER_FLOOR of the floor; on a floor of 0 only by moving nothing."""
    if a["fill_bytes_per_round"] is None:
        return None
    if not a["fill_floor_per_round"]:
        return not a["fill_bytes_per_round"]
    return a["fill_bytes_over_floor"] <= FILL_OVER_FLOOR


def _abs(x: float | None) -> float | None:
    return None if x is None else abs(x)


def _at_least(x: float | None, bound: float) -> bool | None:
    return None if x is None else x >= bound


def _at_most(x: float | None, bound: float) -> bool | None:
    return None if x is None else x <= bound


def summary(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per target: cells meeting it, of the cells where it is defined; the worst values."""
    out: dict[str, Any] = {}
    for target in ("default_vs_best_fixed", "default_vs_best_fixed_confirmed", "fill_vs_floor",
                   "sim_throughput", "sim_tpot", "outputs_match"):
        seen = [c["analysis"]["meets"][target] for c in cells]
        out[target] = {"met": sum(1 for v in seen if v),
                       "of": sum(1 for v in seen if v is not None)}
    worst = {"default_over_best_fixed": min, "default_over_best_fixed_confirmed": min,
             "fill_bytes_over_floor": max}
    for key, pick in worst.items():
        vals = [c["analysis"][key] for c in cells if c["analysis"][key] is not None]
        out[f"worst_{key}"] = pick(vals) if vals else None
    for key in ("sim_default_throughput_error", "sim_default_tpot_error"):
        vals = [c["analysis"][key] for c in cells if c["analysis"][key] is not None]
        out[f"worst_abs_{key}"] = max(map(abs, vals)) if vals else None
    # not a target: the replay with the cell's own compute speed (``matrix_sim.simulate``)
    out["own_speed"] = {
        part: {"within": sum(1 for v in vals if abs(v) <= bound), "of": len(vals)}
        for part, bound in (("throughput", SIM_THROUGHPUT), ("tpot", SIM_TPOT))
        for vals in [[c["analysis"][f"sim_default_{part}_error_own_speed"] for c in cells
                      if c["analysis"].get(f"sim_default_{part}_error_own_speed") is not None]]}
    out["failed_runs"] = {c["cell"]["name"]: c["analysis"]["failed"] for c in cells
                          if c["analysis"]["failed"]}
    return out


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _fill(a: dict[str, Any]) -> str:
    if a["fill_bytes_per_round"] is None:
        return "-"
    if not a["fill_floor_per_round"]:
        return f"floor 0, moved {a['fill_bytes_per_round'] / 1e6:.2f} MB/round"
    return f"{a['fill_bytes_over_floor']:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def markdown(out: dict[str, Any]) -> str:
    lines = [f"# Workload matrix ({'quick smoke run' if out['quick'] else 'full'})", "",
             f"`bench/matrix.py`: per cell {out.get('repeats', 1)} run(s) of each "
             "configuration, interleaved in one process (order rotating by cell; the median run "
             "kept). tok/s = output tokens over wall time; `default` = `specstream` "
             "as the code's defaults build it; best fixed of: " + ", ".join(out["grid"]) +
             f"; targets: default/best >= {DEFAULT_OVER_BEST}, fill bytes/floor <= "
             f"{FILL_OVER_FLOOR}, replay error (default, costs fitted on other cells) "
             f"<= {SIM_THROUGHPUT:.0%} throughput / {SIM_TPOT:.0%} TPOT.", "",
             "| cell | workload | default tok/s | best fixed | default / best (decode-only) "
             "| default / best, fresh runs | offload-spec "
             "q4 tok/s | default / offload-spec | fill bytes / floor | sim thr. err | sim TPOT "
             "err | sim err offload-spec (thr/TPOT) | sim err at the cell's own speed "
             "(thr/TPOT; its steps' compute over the fit's) | outputs = resident | requests "
             "at once (resident / default) |",
             "|" + " --- |" * 15]
    for c in out["cells"]:
        cell, a = c["cell"], c["analysis"]
        work = (f"{cell['context']} x {len(c['context_lengths'])}, budget {cell['budget']}, "
                f"{cell['link_gbps']} GB/s, {cell['prompts']}")
        best = f"{a['best_fixed']} {_f(a['best_fixed_tok_s'])}" if a["best_fixed"] else "-"
        src = (c.get("sim") or {}).get("costs_from")
        conc = a["max_concurrency"]
        lines.append(
            f"| {cell['name']} | {work} | {_f(a['default_tok_s'])} | {best} "
            f"| {_f(a['default_over_best_fixed'], '{:.3f}')} "
            f"({_f(a.get('default_over_best_fixed_decode'), '{:.2f}')}) "
            f"| {_confirmed(c)} | {_f(a['offload_spec_tok_s'])} "
            f"| {_f(a['default_over_offload_spec'])} | {_fill(a)} "
            f"| {_pct(a['sim_default_throughput_error'])}{f' ({src})' if src else ''} "
            f"| {_pct(a['sim_default_tpot_error'])} "
            f"| {_pct(a['sim_offload_spec_throughput_error'])} / "
            f"{_pct(a['sim_offload_spec_tpot_error'])} "
            f"| {_own_speed(a)} "
            f"| {'yes' if a['outputs_match'] else 'NO: ' + ', '.join(a['outputs_differ'])} "
            f"| {conc.get(REFERENCE, '-')} / {conc.get(DEFAULT, '-')} |")
    s = out["summary"]
    lines += ["", "Targets met (cells meeting / cells where defined): " + "; ".join(
        f"{k} {v['met']}/{v['of']}" for k, v in s.items() if isinstance(v, dict) and "met" in v)]
    own = s.get("own_speed")
    if own and own["throughput"]["of"]:
        lines.append(
            "Not a target: the default's replay at each cell's own compute speed (the fitted "
            "step costs scaled by that cell's measured steps' compute over their prediction) "
            f"within {SIM_THROUGHPUT:.0%} throughput in {own['throughput']['within']}/"
            f"{own['throughput']['of']}, within {SIM_TPOT:.0%} TPOT in "
            f"{own['tpot']['within']}/{own['tpot']['of']}.")
    for c in out["cells"]:
        for name in c["analysis"]["failed"]:
            lines.append(f"- {c['cell']['name']} {name}: {c['runs'][name]['error']}")
    lines += ["", "Per run tok/s (mean accepted tokens per round):", "",
              "| cell | " + " | ".join(_names(out)) + " |", "|" + " --- |" * (len(_names(out)) + 1)]
    for c in out["cells"]:
        row = []
        for n in _names(out):
            r = c["runs"].get(n)
            row.append("-" if r is None else "refused" if "error" in r else
                       f"{r['output_tokens_per_s']:.1f} ({r['mean_accepted_len']:.2f})")
        lines.append(f"| {c['cell']['name']} | " + " | ".join(row) + " |")
    est = ", ".join(f"{int(t) / 60:.0f} min at {n} tokens a request"
                    for n, t in out["estimated_full_run_s"].items())
    lines += ["", f"Wall time {out['wall_s'] / 60:.1f} min (load average "
              f"{out.get('machine', {}).get('load_average_1min', '?')} at start, end); estimated "
              f"full matrix (12 cells, the default grid) on this machine as loaded: {est}.", ""]
    return "\n".join(lines)


def _own_speed(a: dict[str, Any]) -> str:
    """"+3% / -10% (x1.28)": the default's replay errors with its steps at the cell's speed."""
    if a.get("sim_default_compute_ratio") is None:
        return "-"
    return (f"{_pct(a['sim_default_throughput_error_own_speed'])} / "
            f"{_pct(a['sim_default_tpot_error_own_speed'])} "
            f"(x{a['sim_default_compute_ratio']:.2f})")


def _confirmed(c: dict[str, Any]) -> str:
    """The fresh runs' ratio and the runs: "0.98 (q0; 40.1, 41.0 / 41.2, 40.7)"."""
    a, conf = c["analysis"], c.get("confirm") or {}
    if a.get("default_over_best_fixed_confirmed") is None:
        return "-"
    runs = conf["runs"]
    each = " / ".join(", ".join(f"{x:.1f}" for x in runs[n])
                      for n in (DEFAULT, conf["best_fixed"]))
    return f"{a['default_over_best_fixed_confirmed']:.3f} ({conf['best_fixed']}; {each})"


def _names(out: dict[str, Any]) -> list[str]:
    return [REFERENCE, DEFAULT, *out["grid"], BASELINE]


# --- how long a matrix takes ---------------------------------------------------------------
def work_seconds(context: int, requests: int, budget: float, link_gbps: float, out_len: int,
                 kv_per_token: float) -> float:
    """A rough cost of one run of a cell on the embedded pair, set by hand on this project's
    2-core machine (1K x 6 runs of 16 tokens: ~3.4 s at 2 GB/s, ~5 s at 0.1 GB/s; a 6K x 12
    run of 32 tokens at a 0.1 budget: ~90 s): per request a cost growing a little faster than
    its context (prefill attention, longer rounds, fewer requests at once on a budget), part of
    it per output token, plus the overflow streamed in each round of ~2.5 tokens."""
    compute = requests * (context / 1024) ** 1.3 * (0.25 + 0.55 * out_len / 32)
    link = (1 - budget) * requests * context * kv_per_token * out_len / 2.5 / (link_gbps * 1e9)
    return compute + link


def estimate_seconds(records: list[dict[str, Any]], cells: list[Any], grid: tuple[str, ...],
                     out_len: int, repeats: int = 1) -> float:
    """Seconds the ``cells`` (Cell objects) would take: ``work_seconds`` per run, scaled by
    what the measured ``records`` took over their own ``work_seconds``."""
    if not records:
        return 0.0
    kvpt = records[0]["workload_kv_bytes"] / sum(
        n + records[0]["output_len"] for n in records[0]["context_lengths"])
    measured = predicted = 0.0
    for r in records:
        cell = r["cell"]
        w = work_seconds(cell["context"], len(r["context_lengths"]), cell["budget"],
                         cell["link_gbps"], r["output_len"], kvpt)
        measured += sum(r["run_seconds"].values())
        predicted += w * (1 + r.get("repeats", 1) * (len(r["run_seconds"]) - 1))
    scale = measured / predicted if predicted else 1.0
    runs = 1 + repeats * (len(grid) + 2)  # resident once; default, the grid, offload-spec
    total = 0.0
    for c in cells:
        total += runs * work_seconds(c.context, c.requests, c.budget, c.link_gbps, out_len, kvpt)
    return scale * total
