"""Two checkouts side by side on cells of the workload matrix: each run in a fresh process of
its checkout (``PYTHONPATH=<checkout>``, that checkout's ``bench/matrix.py`` building the cell,
its prompts and its configurations), A and B alternating, so a slow spell of a shared machine
hits both alike. For a change's before-and-after figures:

    python bench/matrix_ab.py OLD_CHECKOUT NEW_CHECKOUT --cells c11,c01 --configs default,q0 \\
        --repeats 3 --out bench/results/ab-LABEL.json

Per cell and configuration: every run's output tokens/s, the medians, B over A, and whether
B's greedy outputs equal A's (token for token)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# one run, in the checkout's own process: argv = checkout, cell, config, output_len
CHILD = r"""
import hashlib, importlib.util, json, sys
root, cell_name, config, out_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
import os, specstream
if not os.path.realpath(specstream.__file__).startswith(os.path.realpath(root) + os.sep):
    sys.exit(f"specstream imported from {specstream.__file__}, not from {root}")
spec = importlib.util.spec_from_file_location("matrix", f"{root}/bench/matrix.py")
m = importlib.util.module_from_spec(spec); sys.modules["matrix"] = m; spec.loader.exec_module(m)
from specstream.bench.runner import BenchSettings, workload_kv_bytes
from specstream.llm import LLM
cell = {c.name: c for c in m.DESIGN}[cell_name]
work = m.workload_of(cell, out_len)
budget = int(cell.budget * workload_kv_bytes(work, BenchSettings()))
probe = LLM(mode="resident", device="cpu")
prompts = m.make_prompts(cell, work, probe.tokenizer, probe.engine.model_config.vocab_size)
probe.close()
kw = m.configs(budget, cell.link_gbps, tuple(m.GRID))[config]
res, tokens, _ = m.run_one(kw, work, prompts, cell.link_gbps)
keep = ("output_tokens_per_s", "decode_only_tokens_per_s", "mean_accepted_len", "wall_s",
        "speculative_depth_chosen", "max_concurrency", "link_bytes_per_round")
out = {k: res.get(k) for k in keep}
out["outputs_sha"] = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
print("RESULT " + json.dumps(out))
"""


def run(checkout: Path, cell: str, config: str, out_len: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    # in the checkout's own folder: ``python -c`` puts the working folder ahead of PYTHONPATH,
    # so run from another checkout it would import that checkout's package (the child checks)
    p = subprocess.run([sys.executable, "-c", CHILD, str(checkout), cell, config, str(out_len)],
                       env=env, cwd=checkout, capture_output=True, text=True, check=False)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    raise RuntimeError(f"{checkout} {cell} {config} failed:\n{p.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--cells", required=True)
    ap.add_argument("--configs", default="default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--labels", default="A,B")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.out:  # made before the runs: a missing folder must not lose them at the end
        args.out.parent.mkdir(parents=True, exist_ok=True)
    la, lb = args.labels.split(",")
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for cell in args.cells.split(","):
        for config in args.configs.split(","):
            runs: dict[str, list[dict[str, Any]]] = {la: [], lb: []}
            for rep in range(args.repeats):
                order = [(la, args.a), (lb, args.b)]
                for label, root in order if rep % 2 == 0 else order[::-1]:
                    r = run(root.resolve(), cell, config, args.output_len)
                    runs[label].append(r)
                    print(f"[ab {time.perf_counter() - t0:5.0f}s] {cell} {config} {label}: "
                          f"{r['output_tokens_per_s']:.2f} tok/s (decode-only "
                          f"{r['decode_only_tokens_per_s']:.1f}), accepted "
                          f"{r['mean_accepted_len']:.2f}, depths "
                          f"{r['speculative_depth_chosen']}", flush=True)
            med = {k: statistics.median(r["output_tokens_per_s"] for r in v)
                   for k, v in runs.items()}
            dec = {k: statistics.median(r["decode_only_tokens_per_s"] for r in v)
                   for k, v in runs.items()}
            shas = {r["outputs_sha"] for v in runs.values() for r in v}
            rows.append({"cell": cell, "config": config, "runs": runs, "median_tok_s": med,
                         "median_decode_only_tok_s": dec,
                         "b_over_a": med[lb] / med[la] if med[la] else None,
                         "outputs_equal": len(shas) == 1})
    lines = [f"| cell | config | {la} tok/s | {lb} tok/s | {lb} / {la} | decode-only "
             f"{la} / {lb} | outputs equal |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        m, d = r["median_tok_s"], r["median_decode_only_tok_s"]
        lines.append(f"| {r['cell']} | {r['config']} | {m[la]:.2f} | {m[lb]:.2f} | "
                     f"{r['b_over_a']:.3f} | {d[la]:.1f} / {d[lb]:.1f} | {r['outputs_equal']} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(json.dumps({"bench": "bench/matrix_ab.py", "labels": [la, lb],
                                        "checkouts": [args.a.name, args.b.name],
                                        "repeats": args.repeats, "output_len": args.output_len,
                                        "rows": rows,
                                        "wall_s": round(time.perf_counter() - t0, 1)},
                                       indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
