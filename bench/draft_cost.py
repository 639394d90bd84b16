"""A drafting round's time against its depth, on a cell of the workload matrix: what the
round-shape policy's draft model must predict for depths it has not run.

    PYTHONPATH=. python bench/draft_cost.py [--cell c11] [--depths 2,4,8] [--output-len 64] \
        [--out bench/results/draft-round/draft-cost.json]

Each depth is one run of the cell's fixed chain (``bench/matrix.py``'s grid point, ``q`` set
to the depth). Per run: the median draft time of its decode rounds that drafted and carried no
prefill chunk. Then the two readings of those medians the policy can make: a line in the
depth (a part once a round and a part per forward: ``RoundShaper.draft_coef`` where rounds of
two depths were seen) and all of it per forward, fitted at one depth (where only one was
seen), each predicting every depth from the others (leave one out)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _matrix():
    spec = importlib.util.spec_from_file_location("matrix", HERE / "matrix.py")
    assert spec is not None and spec.loader is not None
    m = importlib.util.module_from_spec(spec)
    sys.modules["matrix"] = m
    spec.loader.exec_module(m)
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cell", default="c11")
    ap.add_argument("--depths", default="2,4,8")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    m = _matrix()
    from specstream.bench.runner import BenchSettings, workload_kv_bytes
    from specstream.llm import LLM

    cell = {c.name: c for c in m.DESIGN}[args.cell]
    work = m.workload_of(cell, args.output_len)
    budget = int(cell.budget * workload_kv_bytes(work, BenchSettings()))
    probe = LLM(mode="resident", device="cpu")
    prompts = m.make_prompts(cell, work, probe.tokenizer, probe.engine.model_config.vocab_size)
    probe.close()
    base = m.configs(budget, cell.link_gbps, ("q4",))["q4"]
    depths = [int(d) for d in args.depths.split(",")]
    medians = {}
    for d in depths:
        res, _, _ = m.run_one({**base, "num_speculative_tokens": d}, work, prompts,
                              cell.link_gbps)
        rounds = [r for r in res["rounds"] if r["draft_tokens"] and not r["prefill_tokens"]
                  and r["draft_fed_tokens"] <= 4 * r["draft_tokens"]]
        medians[d] = statistics.median(r["draft_s"] for r in rounds)
        per_seq = statistics.median(r["draft_seqs"] for r in rounds)
        print(f"[draft-cost] depth {d}: {len(rounds)} rounds, {per_seq} requests drafting, "
              f"draft {medians[d] * 1e3:.2f} ms a round", flush=True)
    rows = []
    for d in depths:
        others = [x for x in depths if x != d]
        per_forward = statistics.mean(medians[x] / x for x in others)  # all per forward
        if len(others) >= 2:  # a line through the others: once a round + per forward
            xs, ys = others, [medians[x] for x in others]
            mx, my = statistics.mean(xs), statistics.mean(ys)
            slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
                     / sum((x - mx) ** 2 for x in xs))
            line = my + slope * (d - mx)
        else:
            line = float("nan")
        rows.append(dict(depth=d, measured_s=medians[d], line_s=line,
                         per_forward_s=per_forward * d,
                         line_error=line / medians[d] - 1,
                         per_forward_error=per_forward * d / medians[d] - 1))
        print(f"[draft-cost] depth {d}: measured {medians[d] * 1e3:.2f} ms; from the other "
              f"depths, a line {line * 1e3:.2f} ms ({rows[-1]['line_error']:+.0%}), all per "
              f"forward {per_forward * d * 1e3:.2f} ms ({rows[-1]['per_forward_error']:+.0%})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(
            bench="bench/draft_cost.py", cell=args.cell, output_len=args.output_len,
            rows=rows), indent=1) + "\n")
        print(f"[draft-cost] wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
