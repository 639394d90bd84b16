"""The workload matrix (issue 30, item 6): cells none of the presets used, each configuration
of a cell run side by side in one process, so a slow spell of a shared machine hits them alike.

    PYTHONPATH=<checkout> python bench/matrix.py [--quick] [--cells c01,c09] [--results DIR]

Factors: context 1K / 3K / 6K tokens, 2 / 6 / 12 requests, a device KV budget of 0.1 / 0.3 / 0.6
of the workload's KV bytes, an emulated link of 0.1 / 0.5 / 2 GB/s (the cpu backend's
``link_gbps``), prompts of real text (``examples/long_prompt.txt``) or of seeded random token
ids. ``DESIGN`` is a reduced design of 12 cells: every level of the three-level factors four
times, each kind of prompt six times and twice with each level of every other factor. Seven
of the nine context x requests pairs: not 1K x 2 (its whole KV, 2K tokens, is under what one
request and the staging ring need at the default 512-token tail) and not 6K x 12 (~90 s a run on
two shared cores, ~16 min a cell: over this matrix's time budget alone). The 0.1 budget only
where it holds one request's minimum (a 1K or two-request workload's tenth does not), the
0.1 GB/s link only where a q = 0 run streams its overflow in under ~15 s. In each cell,
greedy decoding of ``OUTPUT_LEN`` tokens a request:

- ``resident`` once (the whole workload on the device): the outputs every run must equal, and
  the compute model of the floors (``specstream.bench.floors``);
- ``default``: ``specstream`` built from the code's defaults, only the workload's facts given
  (device, budget, link, prompts, output length; ``LLM`` adds the embedded draft), so it
  measures whatever the defaults are when it runs (the JSON keeps the resolved config);
- ``GRID``: fixed configurations of ``specstream``, every policy knob spelled out;
- ``offload-spec-q4``: the restore baseline, a fixed q = 4 chain.

The other engine knobs (chunks, staging, tails) are the code's defaults in every run. The order
of the runs rotates from cell to cell. Per cell (``matrix_report.py``): the default over the best
fixed point (target >= 0.97), the fixed q = 4 fill run's link bytes per round over the floor
(target <= 1.10), and the step replay's error (``specstream.sim.replay``) predicting the
default's and offload-spec's throughput and TPOT with step costs fitted on OTHER cells' runs
(``--calibration pair``, the default: the next cell of the selection and the first after it
whose prompts are of another length; ``next``: the next cell alone; targets 15% / 25%;
``bench/matrix_sim.py``): the cell's own link rate, prompt lengths
and per-token acceptance (from its q = 4 chain) are the inputs. One run of each configuration
a cell by default; ``--repeats N`` runs them N times, interleaved, and keeps the median run: the
best of eight single runs is biased up by the machine's noise (on a loaded two-core machine one
configuration's runs differed by up to ~50%), which a 3% target cannot absorb.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LONG_PROMPT = HERE.parent / "examples" / "long_prompt.txt"
OUTPUT_LEN, QUICK_OUTPUT_LEN = 32, 16


@dataclass(frozen=True)
class Cell:
    name: str
    context: int  # prompt tokens of every request
    requests: int
    budget: float  # device KV bytes over the workload's KV bytes (prompts and outputs)
    link_gbps: float  # the cpu backend's emulated link
    prompts: str  # "text" (examples/long_prompt.txt) or "random" (seeded token ids)


FACTORS: dict[str, tuple[Any, ...]] = {
    "context": (1024, 3072, 6144), "requests": (2, 6, 12), "budget": (0.1, 0.3, 0.6),
    "link_gbps": (0.1, 0.5, 2.0), "prompts": ("text", "random")}

DESIGN = (
    Cell("c01", 1024, 12, 0.6, 0.1, "text"),
    Cell("c02", 6144, 2, 0.6, 0.1, "text"),
    Cell("c03", 1024, 6, 0.3, 0.1, "random"),
    Cell("c04", 3072, 2, 0.3, 0.1, "random"),
    Cell("c05", 3072, 12, 0.1, 2.0, "text"),
    Cell("c06", 6144, 6, 0.1, 0.5, "random"),
    Cell("c07", 3072, 12, 0.1, 2.0, "random"),  # c05 with random prompts
    Cell("c08", 3072, 6, 0.1, 0.5, "text"),
    Cell("c09", 6144, 2, 0.6, 2.0, "random"),
    Cell("c10", 6144, 2, 0.3, 0.5, "text"),
    Cell("c11", 1024, 6, 0.3, 2.0, "text"),
    Cell("c12", 1024, 12, 0.6, 0.5, "random"),
)

# The fixed points: EngineConfig fields over FIXED (q = 4 chain, fixed, host attention off,
# residency fill, groups merging where the link hides nothing), not the defaults'.
FIXED: dict[str, Any] = dict(speculative_policy="fixed", num_speculative_tokens=4,
                             host_attention="off", residency="fill", merge_groups=True)
GRID: dict[str, dict[str, Any]] = {
    # specstream refuses q = 0 (a proposer that never drafts): `stream` is its history path
    # (chunks attended as they land) without speculation
    "q0": dict(mode="stream", proposer=None, num_speculative_tokens=None),
    "q2": dict(num_speculative_tokens=2),
    "q4": {},
    "q8": dict(num_speculative_tokens=8),
    "tree": dict(speculative_topk=4, speculative_num_draft_tokens=16),
    "q4-host-auto": dict(host_attention="auto"),
    # the paper's residency; past 512 tokens, not the default 2048 (whole requests up to 2048
    # tokens on the device do not fit most of these budgets)
    "q4-tail": dict(residency="tail", offload_after_tokens=512),
    "q4-two-groups": dict(merge_groups=False),  # always two groups
    "q4-sequential": dict(drafting="sequential"),  # one group, no gap drafting
}
DEFAULT_GRID = ("q0", "q2", "q4", "q8", "tree", "q4-host-auto", "q4-tail", "q4-two-groups")
BASELINE = "offload-spec-q4"
# per-run values kept in the JSON (the step records stay in memory for the replay)
KEEP = ("output_tokens_per_s", "decode_only_tokens_per_s", "tpot_s", "ttft_s", "wall_s",
        "mean_accepted_len", "decode_only_link_utilization", "decode_only_round_time_over_floor",
        "link_bytes_per_round", "link_bytes_floor_per_round", "device_kv_utilization",
        "host_attention_bytes", "merged_group_steps", "decode_steps", "max_concurrency",
        "speculative_depth_chosen", "speculative_nodes_chosen", "mean_tree_nodes_per_round",
        "link_busy_s", "link_bytes_h2d", "link_bytes_d2h", "prefill_only_time_s",
        "outputs_match_reference", "output_tokens_per_s_runs")


def beside(name: str) -> Any:
    """``bench/<name>.py``, imported by its path (as bench/regress.py does)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


report = beside("matrix_report")
sim = beside("matrix_sim")


def workload_of(cell: Cell, output_len: int) -> Any:
    """The cell's requests, ``output_len`` tokens each (--quick shortens only the outputs:
    fewer requests or shorter prompts would shrink the budgets below what one request needs)."""
    from specstream.bench.workload import Workload

    return Workload((cell.context,) * cell.requests, output_len)


def make_prompts(cell: Cell, workload: Any, tokenizer: Any, vocab: int,
                 seed: int = 0) -> list[list[int]]:
    """Text: each request's prompt starts at its own offset of long_prompt.txt (repeated to
    twice the context); random: seeded uniform token ids (``build_prompts`` without text)."""
    from specstream.bench.workload import build_prompts

    if cell.prompts == "random":
        return build_prompts(workload, None, vocab, seed=seed)
    ids = tokenizer.encode(LONG_PROMPT.read_text(), add_special_tokens=False)
    while len(ids) < 2 * cell.context:
        ids = ids + ids
    stride = (len(ids) - cell.context) // workload.num_requests
    return [ids[i * stride : i * stride + cell.context] for i in range(workload.num_requests)]


def cell_inputs(cell: Cell, output_len: int) -> tuple[Any, int, int, list[list[int]]]:
    """A cell's workload, its KV bytes, its device budget (``cell.budget`` of them) and its
    prompts (tokenized with the target's tokenizer)."""
    from specstream.bench.runner import BenchSettings, workload_kv_bytes
    from specstream.llm import LLM

    work = workload_of(cell, output_len)
    kv = workload_kv_bytes(work, BenchSettings())
    probe = LLM(mode="resident", device="cpu")  # the tokenizer and vocabulary of the target
    prompts = make_prompts(cell, work, probe.tokenizer, probe.engine.model_config.vocab_size)
    probe.close()
    return work, kv, int(cell.budget * kv), prompts


def configs(budget: int, link_gbps: float, grid: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Name -> LLM keywords of every run of a cell but the resident reference."""
    facts = dict(mode="specstream", device="cpu", device_kv_bytes=budget, link_gbps=link_gbps)
    out = {"default": dict(facts)}
    for name in grid:
        kw = {**facts, **FIXED, **GRID[name]}
        out[name] = {k: v for k, v in kw.items() if v is not None or k == "proposer"}
    out[BASELINE] = {**facts, **FIXED, "mode": "offload-spec"}
    return out


def run_one(kwargs: dict[str, Any], workload: Any, prompts: list[list[int]],
            link_gbps: float | None) -> tuple[dict[str, Any], list[list[int]], Any]:
    """One measured run (``specstream.bench.runner.measure``); returns (metrics with the
    step records, tokens, the engine's config). Raises what the engine raises."""
    from specstream.bench.runner import BenchSettings, measure
    from specstream.llm import LLM

    llm = LLM(**kwargs)
    try:
        res, tokens = measure(llm, str(llm.config.mode), workload,
                              BenchSettings(link_gbps=link_gbps), prompts=prompts)
        return res, tokens, llm.config
    finally:
        llm.close()


def run_cell(cell: Cell, index: int, output_len: int, grid: tuple[str, ...], log: Any,
             repeats: int = 1, confirm: int = 0) -> dict[str, Any]:
    """Every run of one cell; the record (JSON-ready but for ``_steps`` / ``_configs``).
    ``confirm``: then that many fresh runs each of the default and of the best fixed point
    (``confirm_best``)."""
    from specstream.bench.floors import ComputeModel, add_floors
    from specstream.bench.runner import BenchSettings, resident_fit_bytes

    work, kv, budget, prompts = cell_inputs(cell, output_len)
    ref_kw = dict(mode="resident", device="cpu", speculative_policy="fixed",
                  num_speculative_tokens=4,
                  device_kv_bytes=resident_fit_bytes(work, BenchSettings()))
    t0 = time.perf_counter()
    ref, ref_tokens, ref_cfg = run_one(ref_kw, work, prompts, None)
    model = ComputeModel.fit(ref["rounds"] + ref["prefill_steps"])
    ref["outputs_match_reference"] = True
    runs = {"resident": ref}
    steps = {"resident": ref}
    cfgs = {"resident": ref_cfg}
    times = {"resident": time.perf_counter() - t0}
    log(f"  resident: {ref['output_tokens_per_s']:.2f} tok/s, accepted "
        f"{ref['mean_accepted_len']:.2f} ({times['resident']:.0f} s)")
    todo = list(configs(budget, cell.link_gbps, grid).items())
    tries: dict[str, list[dict[str, Any]]] = {}
    for rep in range(repeats):
        k = (index + rep) % len(todo)
        for name, kw in todo[k:] + todo[:k]:  # the order rotates from cell to cell
            if "error" in runs.get(name, {}):
                continue
            t0 = time.perf_counter()
            try:
                res, tokens, cfg = run_one(kw, work, prompts, cell.link_gbps)
            except (ValueError, RuntimeError) as e:
                runs[name] = {"error": f"{type(e).__name__}: {e}"}
                log(f"  {name}: REFUSED/FAILED {runs[name]['error'][:160]}")
                continue
            res["outputs_match_reference"] = tokens == ref_tokens
            add_floors({name: res}, model)
            tries.setdefault(name, []).append(res)
            cfgs[name] = cfg
            times[name] = times.get(name, 0.0) + time.perf_counter() - t0
            log(f"  {name}: {res['output_tokens_per_s']:.2f} tok/s, accepted "
                f"{res['mean_accepted_len']:.2f}, link "
                f"{res['decode_only_link_utilization']:.2f}, outputs match "
                f"{res['outputs_match_reference']} ({time.perf_counter() - t0:.0f} s)")
    for name, rs in tries.items():  # the run of median throughput stands for the repeats
        res = sorted(rs, key=lambda r: r["output_tokens_per_s"])[len(rs) // 2]
        res["output_tokens_per_s_runs"] = [r["output_tokens_per_s"] for r in rs]
        res["outputs_match_reference"] = all(r["outputs_match_reference"] for r in rs)
        runs[name] = steps[name] = res
    confirmed = (confirm_best(runs, todo, confirm, lambda kw: run_one(
        kw, work, prompts, cell.link_gbps), ref_tokens, log) if confirm else None)
    record = {
        "cell": asdict(cell), "context_lengths": list(work.context_lengths),
        "output_len": work.output_len, "workload_kv_bytes": kv, "device_kv_bytes": budget,
        "configs": {n: {k: v for k, v in kw.items() if k not in ("device_kv_bytes",)}
                    for n, kw in [("resident", ref_kw), *todo]},
        "default_config": _config_dict(cfgs.get("default")),
        "runs": {n: {k: r.get(k) for k in KEEP} if "error" not in r else r
                 for n, r in runs.items()},
        "run_seconds": {n: round(t, 1) for n, t in times.items()}, "repeats": repeats,
        "confirm": confirmed, "_steps": steps, "_configs": cfgs,
    }
    return record


def confirm_best(runs: dict[str, dict[str, Any]], todo: list[tuple[str, dict[str, Any]]],
                 n: int, run: Any, ref_tokens: list[list[int]], log: Any) -> dict[str, Any]:
    """Fresh runs of the default and of the fixed point that ran fastest: ``n`` of each,
    alternating. The best of eight fixed points is picked on runs whose noise it selects for
    (on these machines +-5% a run: the fastest of eight equal points reads ~7% above their
    mean), so its own run overstates it; runs made after the pick do not."""
    fixed = {k: r["output_tokens_per_s"] for k, r in runs.items()
             if k not in (report.REFERENCE, report.DEFAULT, BASELINE) and "error" not in r}
    if not fixed or "error" in runs.get(report.DEFAULT, {"error": ""}):
        return {}
    best = max(fixed, key=fixed.__getitem__)
    kws = dict(todo)
    out: dict[str, Any] = {"best_fixed": best, "runs": {report.DEFAULT: [], best: []},
                           "outputs_match_reference": True}
    for i in range(2 * n):
        name = (report.DEFAULT, best)[i % 2]
        res, tokens, _ = run(kws[name])
        out["runs"][name].append(res["output_tokens_per_s"])
        out["outputs_match_reference"] &= tokens == ref_tokens
        log(f"  confirm {name}: {res['output_tokens_per_s']:.2f} tok/s")
    return out


def _config_dict(cfg: Any) -> dict[str, Any] | None:
    """The resolved config, JSON-ready (option types as strings, paths in this checkout
    relative to it)."""
    if cfg is None:
        return None
    root = str(HERE.parent) + os.sep
    return {k: v.removeprefix(root) if isinstance(v, str) else str(v) if hasattr(v, "value")
            else v for k, v in asdict(cfg).items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: {QUICK_OUTPUT_LEN} output tokens a request")
    ap.add_argument("--output-len", type=int, default=None,
                    help=f"tokens a request ({OUTPUT_LEN}; {QUICK_OUTPUT_LEN} with --quick)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each configuration per cell, interleaved (the median stands)")
    ap.add_argument("--confirm", type=int, default=2,
                    help="then per cell this many fresh runs each of the default and of the "
                         "fixed point that ran fastest, alternating (their medians give the "
                         "confirmed ratio; 0: none)")
    ap.add_argument("--cells", default=None, help="comma-separated cell names (default: all)")
    ap.add_argument("--grid", default=",".join(DEFAULT_GRID),
                    help=f"fixed points to run (of {','.join(GRID)})")
    ap.add_argument("--results", type=Path, default=HERE / "results")
    ap.add_argument("--name", default=None,
                    help="file stem of the JSON and markdown (default: matrix, or matrix-smoke)")
    ap.add_argument("--save-steps", action="store_true",
                    help="also write every run's step records and resolved configs to "
                         "<results>/<name>-steps.pkl.gz, so --replay-only can refit the "
                         "simulator without running the cells again")
    ap.add_argument("--replay-only", type=Path, default=None, metavar="STEPS",
                    help="skip the runs: load a --save-steps file and recompute the replay "
                         "and the figures (written under --name, default <its stem>-replay)")
    ap.add_argument("--calibration", choices=("pair", "next"), default="pair",
                    help="the cells a cell's replay fits its step costs on: the next cell and "
                         "the first after it of another prompt length (pair), or the next "
                         "cell alone (next)")
    args = ap.parse_args(argv)
    if args.replay_only is not None:
        return sim.replay_only(args.replay_only, args.results, args.name, args.calibration)
    by_name = {c.name: c for c in DESIGN}
    names = args.cells.split(",") if args.cells else list(by_name)
    unknown = [n for n in names if n not in by_name] + [
        g for g in args.grid.split(",") if g not in GRID]
    if unknown:
        raise SystemExit(f"unknown cells or grid points: {unknown}")
    cells, grid = [by_name[n] for n in names], tuple(args.grid.split(","))
    stem = args.name or ("matrix-smoke" if args.quick else "matrix")
    args.results.mkdir(parents=True, exist_ok=True)
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    out_len = args.output_len or (QUICK_OUTPUT_LEN if args.quick else OUTPUT_LEN)
    records: list[dict[str, Any]] = []

    def log(msg: str) -> None:
        print(f"[matrix {time.perf_counter() - t_start:6.0f}s] {msg}", flush=True)

    for i, cell in enumerate(cells):
        log(f"cell {i + 1}/{len(cells)} {cell.name}: {cell.context} tokens x {cell.requests}, "
            f"budget {cell.budget}, link {cell.link_gbps} GB/s, {cell.prompts} prompts")
        records.append(run_cell(cell, DESIGN.index(cell), out_len, grid, log, args.repeats,
                                args.confirm))
        left = report.estimate_seconds(records, cells[i + 1:], grid, out_len, args.repeats)
        log(f"cell {cell.name} done; about {left / 60:.0f} min left")
    sim.add_replay(records, args.calibration)
    full = {n: report.estimate_seconds(records, list(DESIGN), DEFAULT_GRID, n, 1)
            for n in (OUTPUT_LEN, 24)}
    out = {
        "bench": "bench/matrix.py", "quick": args.quick, "output_len": out_len,
        "repeats": args.repeats, "confirm": args.confirm, "calibration": args.calibration,
        "grid": list(grid),
        "fixed_base": FIXED, "grid_points": {g: GRID[g] for g in grid},
        "factors": FACTORS, "design": [asdict(c) for c in DESIGN],
        "wall_s": round(time.perf_counter() - t_start, 1),
        # the full design and grid, by output tokens a request (matrix_report.estimate_seconds)
        "estimated_full_run_s": {str(n): round(t) for n, t in full.items()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_average_1min": [load0, os.getloadavg()[0]]},
        "cells": [{k: v for k, v in r.items() if not k.startswith("_")} for r in records],
    }
    out["summary"] = report.summary(out["cells"])
    if args.save_steps:
        sim.save_steps(out, records, args.results / f"{stem}-steps.pkl.gz")
    (args.results / f"{stem}.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    md = report.markdown(out)
    (args.results / f"{stem}.md").write_text(md)
    print(md)
    log(f"wrote {args.results / stem}.json and .md; a full matrix (12 cells, the default grid) "
        f"would take about {full[OUTPUT_LEN] / 60:.0f} min on this machine as loaded now "
        f"({full[24] / 60:.0f} min with --output-len 24)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
