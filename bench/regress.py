"""The regression guard (issue 29): the figures the project stands on, in one process.

    python bench/regress.py --out bench/results/regress-LABEL.json [--repeats N] [--quick]
    python bench/regress.py --compare A.json B.json
    python bench/regress.py --interleave CHECKOUT_A CHECKOUT_B --labels before,after

It measures the checkout it sits in: the `specstream` package must be imported from the folder
above this one (``PYTHONPATH=<checkout>`` where another copy is installed), and
``host_overhead.py`` and ``regress_report.py`` (the workloads, the figures, the comparison) are
loaded from beside it, so the same files measure older revisions too (copy this file and
``regress_report.py`` into their ``bench/``). It uses only the bench runner, not the engine.

Each repeat measures every figure once, the figures in turn, so a slow spell of a shared
machine spreads over all of them; the JSON keeps every repeat's value and its min, median and
max. The figures, on the embedded pair (workloads shrunk from the README's to fit about ten
minutes on two cores; ``--quick`` shrinks them further, for a smoke run):

- ``host_over_link``: `bench/host_overhead.py`'s host time of a GPU round over its link time.
- ``link_bound.*``: the link-bound preset (residency tail, four staging slots, a slow link),
  `specstream` over `offload-spec` with a fixed q = 4 chain, end to end and decode-only: with
  chains (auto, up to q = 4) and with token trees (auto, top-4, up to 32 nodes, depth up to
  8), and the trees' mean accepted tokens per round over the q = 4 chain's.
- ``host_attention.*``: the same workload, `specstream` with chains and
  ``host_attention="auto"`` over the chains' run without, the host's attention rate emulated
  at eight times the link (as `bench/host_attention.py`: 0.8 GB/s against the preset's 0.1).
- ``residency.fill_bytes_over_floor``: `specstream` with residency fill on a device budget of
  half the workload's KV (the balanced workload over a slower link), history bytes per round
  over the least any residency could move on that budget (lower is better).
- ``balanced.*``: the default bench's regime (fill on a budget that holds part of the history,
  a link about as slow as a round's compute), fixed q = 4: decode-only throughput of
  `specstream` over `offload-spec` and over `offload` (not `parallel-spec`: per device that
  ratio is twice the one-clock one; a slower baseline would flatter `specstream`).
- ``sharing.*``: one shared document under fill, `specstream` with prefix sharing on over off,
  end to end and history bytes a round (lower is better); the two runs' outputs agree.
- ``outputs_match_reference``: every run's greedy outputs equal `resident`'s.

Each run's regime is kept (decode-only link utilisation, round time over floor, mean accepted
tokens, prefill share, wall time), and a warning is printed when a
link-bound run's link idles more than a fifth of its decode-only rounds, or the balanced
`specstream` run's more than half (compute-bound: a busy machine's slower compute does that).
``--compare A.json B.json``: B's figures against A's (``regress_report.py``); exit 1 when a
figure is worse or an output differs.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from types import ModuleType
from typing import Any

CHECKOUT = Path(__file__).resolve().parents[1]

# host attention's emulated rate over the link's (bench/host_attention.py: 0.8 against 0.1)
HOST_OVER_LINK_RATE = 8.0
RESIDENCY_FRACTION = 0.5
# a link-bound run whose link idles more than this share of its decode-only rounds has left
# its regime (the preset's runs: 0.98); a balanced one that idles more than half of them is
# compute-bound (the README bench's decode-only rounds: 0.74-0.90)
LINK_BOUND_UTILIZATION = 0.8
BALANCED_UTILIZATION = 0.5

# per-run values kept beside the figures: the regime each run was in
RUN_KEYS = ("output_tokens_per_s", "decode_only_tokens_per_s", "mean_accepted_len",
            "decode_only_link_utilization", "decode_only_round_time_over_floor",
            "link_bytes_per_round", "link_bytes_floor_per_round", "prefill_share_of_wall",
            "max_concurrency", "host_attention_bytes_per_s", "wall_s")


def check_package() -> Path:
    """The folder specstream is imported from; it must be this checkout's."""
    spec = importlib.util.find_spec("specstream")  # found, not imported yet
    if spec is None or spec.origin is None:
        raise SystemExit(f"specstream is not importable: run with PYTHONPATH={CHECKOUT}")
    pkg = Path(spec.origin).resolve().parent
    if pkg.parent != CHECKOUT:
        raise SystemExit(f"specstream is imported from {pkg}, not from this checkout "
                         f"({CHECKOUT}): run with PYTHONPATH={CHECKOUT}")
    return pkg


def beside(name: str) -> ModuleType:
    """``bench/<name>.py`` of this checkout, imported by its path (the tests load this script by
    its path, where ``bench/`` is not on the import path; the module's own imports resolve
    beside it when this runs as a script)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


# the workloads, the figures and how two reports compare (bench/regress_report.py)
_report = beside("regress_report")
Sizes, SIZES = _report.Sizes, _report.SIZES
HIGHER, LOWER, TRUE, FIGURES = _report.HIGHER, _report.LOWER, _report.TRUE, _report.FIGURES
summary, spread, merge = _report.summary, _report.spread, _report.merge
verdict, compare, format_comparison = _report.verdict, _report.compare, _report.format_comparison


class Guard:
    """One revision's measurements: the references once, then every figure per repeat."""

    def __init__(self, sizes: Sizes) -> None:
        from specstream.bench.runner import BenchSettings
        from specstream.bench.workload import Workload

        self.sizes = sizes
        self.values: dict[str, list[Any]] = {}
        self.runs: dict[str, dict[str, list[Any]]] = {}
        self.warnings: list[str] = []
        self.lb_work = Workload((sizes.link_bound[0],) * sizes.link_bound[1],
                                sizes.link_bound[2])
        # the link-bound preset at this tier's link; speculation pinned to the defaults before
        # issue 30 (auto, chains up to 4, no host attention): like with like across revisions
        pinned = dict(num_speculative_tokens=4, speculative_topk=1, host_attention="off")
        self.lb = BenchSettings(link_gbps=sizes.link_bound_gbps, residency="tail",
                                staging_buffers=4, chunk_tokens=sizes.chunk_tokens, **pinned)
        self.bal_work = Workload((sizes.balanced[0],) * sizes.balanced[1], sizes.balanced[2])
        self.bal = BenchSettings(link_gbps=sizes.balanced_gbps, chunk_tokens=sizes.chunk_tokens,
                                 **pinned)
        self._refs: dict[str, Any] = {}

    def reference(self, name: str) -> Any:
        """The resident run of a workload (exact outputs, the floors' compute model), once."""
        from specstream.bench.runner import resident_fit_bytes, run_reference

        if name not in self._refs:
            s, w = (self.lb, self.lb_work) if name == "link_bound" else (self.bal, self.bal_work)
            if name == "balanced":  # the whole workload on the device, as the residency sweep
                s = replace(s, device_kv_bytes=resident_fit_bytes(w, s))
            _log(f"resident reference of the {name} workload ...")
            self._refs[name] = run_reference(w, s)[1]
        return self._refs[name]

    def run(self, name: str, mode: str, ref: str, s: Any, **fields: Any) -> dict[str, Any]:
        """One mode's run (``fields`` set on a copy of ``s``); its regime and outputs kept."""
        from specstream.bench.runner import run_compared

        s = copy.copy(s)
        extra = fields.pop("extra", {})
        for k, v in fields.items():
            setattr(s, k, v)
        s.extra = {**s.extra, **extra}
        work = self.lb_work if ref == "link_bound" else self.bal_work
        t0 = time.perf_counter()
        r = run_compared(mode, work, s, self.reference(ref))
        self.keep(name, r)
        self.values.setdefault("outputs_match_reference", []).append(
            bool(r["outputs_match_reference"]))
        _log(f"  {name}: {r['output_tokens_per_s']:.2f} tok/s, decode-only "
             f"{r['decode_only_tokens_per_s']:.2f}, link {r['decode_only_link_utilization']:.2f}"
             f", accepted {r['mean_accepted_len']:.2f}, outputs match "
             f"{r['outputs_match_reference']} ({time.perf_counter() - t0:.0f} s)")
        if not r["outputs_match_reference"]:
            self.warnings.append(f"{name}: outputs differ from resident's")
        return r

    def keep(self, name: str, r: dict[str, Any]) -> None:
        for k in RUN_KEYS:
            self.runs.setdefault(name, {}).setdefault(k, []).append(r.get(k, 0.0))

    def figure(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def host_overhead(self) -> None:
        r = beside("host_overhead").main(list(self.sizes.host_overhead_argv))
        self.figure("host_over_link", r["host_over_link"])
        self.runs.setdefault("host_overhead", {}).setdefault(
            "host_ms_per_round", []).append(r["host_ms_per_round"])

    def link_bound(self) -> None:
        """offload-spec's q = 4 chain against specstream with chains, with trees, and with
        host attention; one run each."""
        s = self.lb
        base = self.run("lb_offload_spec_q4", "offload-spec", "link_bound", s,
                        speculative_policy="fixed", num_speculative_tokens=4)
        chain = self.run("lb_specstream_chain", "specstream", "link_bound", s,
                         speculative_policy="auto", num_speculative_tokens=4)
        trees = self.run("lb_specstream_trees", "specstream", "link_bound", s,
                         speculative_policy="auto", num_speculative_tokens=8,
                         speculative_topk=4, speculative_num_draft_tokens=32)
        host = self.run("lb_specstream_host_attention", "specstream", "link_bound", s,
                        speculative_policy="auto", num_speculative_tokens=4,
                        host_attention="auto",
                        extra={"host_attention_gbps": HOST_OVER_LINK_RATE * s.link_gbps})
        for name, r in (("chain", chain), ("trees", trees)):
            self.ratio(f"link_bound.{name}_over_offload_spec", r, base, "output_tokens_per_s")
            self.ratio(f"link_bound.{name}_over_offload_spec_decode_only", r, base,
                       "decode_only_tokens_per_s")
        self.ratio("link_bound.trees_accepted_over_offload_spec", trees, base,
                   "mean_accepted_len")
        self.ratio("host_attention.speedup", host, chain, "output_tokens_per_s")
        self.ratio("host_attention.speedup_decode_only", host, chain,
                   "decode_only_tokens_per_s")
        for name, r in (("lb_offload_spec_q4", base), ("lb_specstream_chain", chain),
                        ("lb_specstream_trees", trees)):
            self.check_link(name, r, LINK_BOUND_UTILIZATION, "link-bound")

    def residency(self) -> None:
        from specstream.bench.runner import workload_kv_bytes

        budget = int(RESIDENCY_FRACTION * workload_kv_bytes(self.bal_work, self.bal))
        r = self.run("residency_fill_half", "specstream", "balanced", self.bal,
                     residency="fill", device_kv_bytes=budget,
                     link_gbps=self.sizes.residency_gbps)
        floor = r["link_bytes_floor_per_round"]
        if not floor:
            self.warnings.append("residency_fill_half: no history had to stream (floor 0)")
        self.figure("residency.fill_bytes_over_floor",
                    r["link_bytes_per_round"] / floor if floor else float("nan"))

    def balanced(self) -> None:
        """A fixed q = 4 in the speculative modes: under auto a busy machine's slower compute
        turns speculation off here (mean accepted 1.01 in a loaded run), and the ratios then
        follow the machine's load instead of the engine."""
        s = replace(self.bal, device_kv_bytes=self.sizes.balanced_device_kv_bytes,
                    speculative_policy="fixed", num_speculative_tokens=4)
        ss = self.run("bal_specstream", "specstream", "balanced", s)
        self.check_link("bal_specstream", ss, BALANCED_UTILIZATION, "balanced")
        for key, mode in (("offload_spec", "offload-spec"), ("offload", "offload")):
            b = self.run(f"bal_{key}", mode, "balanced", s)
            self.ratio(f"balanced.specstream_over_{key}_decode_only", ss, b,
                       "decode_only_tokens_per_s")

    def sharing(self) -> None:
        """specstream under fill over one shared document, prefix sharing on and off: end to
        end and the history bytes a round; the two runs' outputs must agree."""
        runs = _report.run_shared_doc(self.sizes, self.bal, _log)
        for on, (r, _) in runs.items():
            self.keep(f"shared_doc_{'on' if on else 'off'}", r)
        (on_r, on_t), (off_r, off_t) = runs[True], runs[False]
        self.values.setdefault("outputs_match_reference", []).append(on_t == off_t)
        self.ratio("sharing.specstream_on_over_off", on_r, off_r, "output_tokens_per_s")
        self.ratio("sharing.bytes_on_over_off", on_r, off_r, "link_bytes_per_round")

    def ratio(self, name: str, r: dict[str, Any], base: dict[str, Any], key: str) -> None:
        self.figure(name, r[key] / base[key] if base[key] else float("nan"))

    def check_link(self, name: str, r: dict[str, Any], least: float, regime: str) -> None:
        u = r["decode_only_link_utilization"]
        if u < least:
            self.warnings.append(f"{name}: decode-only link utilisation {u:.2f} < {least}: "
                                 f"not {regime} in this repeat")


GROUPS: dict[str, Callable[[Guard], None]] = {
    "host_overhead": Guard.host_overhead, "link_bound": Guard.link_bound,
    "residency": Guard.residency, "balanced": Guard.balanced, "sharing": Guard.sharing,
}


def measure(size: str, repeats: int | None = None,
            groups: tuple[str, ...] = tuple(GROUPS)) -> dict[str, Any]:
    """Every figure of ``groups``, ``repeats`` times in turn; the report (JSON-ready)."""
    pkg = check_package()
    sizes = SIZES[size]
    repeats = repeats or sizes.repeats
    t0, load0 = time.perf_counter(), os.getloadavg()
    guard = Guard(sizes)
    for rep in range(repeats):
        for g in groups:
            _log(f"repeat {rep + 1}/{repeats}: {g} ...")
            GROUPS[g](guard)
    report = {
        "guard": "bench/regress.py", "revision": _git("rev-parse", "HEAD"),
        "modified_files": _git("status", "--porcelain", "--untracked-files=no").splitlines(),
        "specstream": str(pkg.relative_to(CHECKOUT)), "size": size, "sizes": asdict(sizes),
        "repeats": repeats, "groups": list(groups),
        "wall_s": round(time.perf_counter() - t0, 1),
        "load_average_1min": [load0[0], os.getloadavg()[0]],
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
        "figures": {k: summary(k, v) for k, v in guard.values.items()},
        "runs": {name: {k: spread(v) for k, v in keys.items()}
                 for name, keys in guard.runs.items()},
        "warnings": guard.warnings,
    }
    return report


# --- two checkouts, interleaved ----------------------------------------------------------

def interleave(checkouts: list[Path], labels: list[str], passes: int, size: str,
               repeats: int | None, groups: str, results: Path) -> int:
    """A, B, A, B...: each checkout's own bench/regress.py in a process of its own (its
    package on the import path), ``passes`` times each, alternating; writes each label's
    merged report to ``results/regress-LABEL.json`` and compares the last with the first."""
    parts: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    results.mkdir(parents=True, exist_ok=True)  # --results may name a new folder
    with tempfile.TemporaryDirectory() as tmp:
        for p in range(passes):
            for checkout, label in zip(checkouts, labels):
                script = checkout / "bench" / "regress.py"
                if not script.is_file():
                    raise SystemExit(f"{script} is missing: copy this file there first")
                out = Path(tmp) / f"{label}-{p}.json"
                cmd = [sys.executable, str(script), "--out", str(out), "--size", size,
                       "--groups", groups]
                if repeats:
                    cmd += ["--repeats", str(repeats)]
                _log(f"pass {p + 1}/{passes}: {label} ...")
                env = {**os.environ, "PYTHONPATH": str(checkout)}
                subprocess.run(cmd, cwd=checkout, env=env, check=True)
                parts[label].append(json.loads(out.read_text()))
    merged = {label: merge(reports) for label, reports in parts.items()}
    for label, report in merged.items():
        path = results / f"regress-{label}.json"
        path.write_text(json.dumps({**report, "label": label}, indent=1) + "\n")
        _log(f"wrote {path}")
    rows, notes = compare(merged[labels[0]], merged[labels[-1]])
    print(format_comparison(rows, notes))
    return 1 if any(r["verdict"] == "worse" for r in rows) else 0


# --- command line ------------------------------------------------------------------------
def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _log(msg: str) -> None:
    print(f"[regress] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the report to this JSON file")
    ap.add_argument("--label", default=None, help="a name for the revision, kept in the JSON")
    ap.add_argument("--repeats", type=int, default=None,
                    help="repeats of every figure (default: 3; 2 with --quick)")
    ap.add_argument("--quick", action="store_true", help="smaller workloads (--size quick)")
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--groups", default=",".join(GROUPS),
                    help=f"comma-separated figure groups (default: all: {','.join(GROUPS)})")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"),
                    help="compare two reports (B against A) instead of measuring")
    ap.add_argument("--interleave", nargs="+", type=Path, metavar="CHECKOUT",
                    help="measure these checkouts in turn, --passes times each")
    ap.add_argument("--labels", default=None,
                    help="--interleave: a label per checkout (default: a, b, ...)")
    ap.add_argument("--passes", type=int, default=2, help="--interleave: passes per checkout")
    ap.add_argument("--results", type=Path, default=Path(__file__).parent / "results",
                    help="--interleave: where the regress-LABEL.json files go")
    args = ap.parse_args(argv)
    size = "quick" if args.quick else args.size
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        rows, notes = compare(a, b)
        print(format_comparison(rows, notes))
        return 1 if any(r["verdict"] == "worse" for r in rows) else 0
    if args.interleave:
        labels = (args.labels.split(",") if args.labels
                  else [chr(ord("a") + i) for i in range(len(args.interleave))])
        if len(labels) != len(args.interleave):
            raise SystemExit("--labels needs one label per checkout")
        return interleave([p.resolve() for p in args.interleave], labels, args.passes, size,
                          args.repeats, args.groups, args.results)
    groups = tuple(g.strip() for g in args.groups.split(",") if g.strip())
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise SystemExit(f"unknown groups {sorted(unknown)}: choose from {list(GROUPS)}")
    report = measure(size, args.repeats, groups)
    if args.label:
        report["label"] = args.label
    for name, fig in report["figures"].items():
        if fig["better"] == TRUE:
            print(f"{name}: {'all True' if fig['all'] else 'SOME FALSE'} "
                  f"({len(fig['values'])} runs)")
        else:
            print(f"{name}: {fig['median']:.4g} [{fig['min']:.4g}-{fig['max']:.4g}] "
                  f"({fig['better']} is better)")
    for w in report["warnings"]:
        print(f"warning: {w}")
    print(f"[regress] {report['wall_s']:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        _log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
