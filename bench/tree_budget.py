"""Tokens per round against the tree's node budget, fixed shapes, one mode, side by side.

    python bench/tree_budget.py --json bench/results/tree-budget.json

The embedded pair in `specstream`, 4 requests x 2048-token prompts, 48 greedy tokens each,
residency tail over a 0.1 GB/s link (link-bound, as `--preset link-bound`); a q = 4 chain,
then top-4 trees 4 deep with 8, 16, 32 and 64 nodes. Prints and plots (the PNG next to the
JSON) the mean accepted tokens per round and decode-only tokens/s against the node budget.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from specstream.bench.runner import BenchSettings, run_compared, run_reference
from specstream.bench.workload import Workload

SHAPES = [(4, 1, None), (4, 4, 8), (4, 4, 16), (4, 4, 32), (4, 4, 64)]  # depth, topk, nodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="tree-budget.json")
    args = ap.parse_args()
    w = Workload((2048,) * 4, 48)
    base = BenchSettings(link_gbps=0.1, residency="tail")
    _, ref = run_reference(w, base)
    rows: list[dict[str, Any]] = []
    for depth, topk, nodes in SHAPES:
        s = BenchSettings(link_gbps=0.1, residency="tail", num_speculative_tokens=depth,
                          speculative_topk=topk, speculative_num_draft_tokens=nodes)
        r = run_compared("specstream", w, s, ref)
        row = {"depth": depth, "topk": topk, "nodes": nodes or depth,
               "mean_accepted_len": r["mean_accepted_len"],
               "decode_only_tokens_per_s": r["decode_only_tokens_per_s"],
               "output_tokens_per_s": r["output_tokens_per_s"],
               "outputs_match_reference": r["outputs_match_reference"]}
        rows.append(row)
        print(f"nodes {row['nodes']:3d} (top-{topk}, depth {depth}): mean accepted "
              f"{row['mean_accepted_len']:.2f} tokens/round, decode-only "
              f"{row['decode_only_tokens_per_s']:.1f} tok/s, end to end "
              f"{row['output_tokens_per_s']:.1f}, exact {row['outputs_match_reference']}",
              flush=True)
    out = Path(args.json)
    out.write_text(json.dumps({"rows": rows}, indent=1))
    _plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["nodes"] for r in rows]
    ax.plot(x, [r["mean_accepted_len"] for r in rows], marker="o", label="accepted tokens/round")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft nodes per request and round (4: the q = 4 chain; top-4 trees after)")
    ax.set_ylabel("mean accepted tokens per round")
    ax2 = ax.twinx()
    ax2.plot(x, [r["decode_only_tokens_per_s"] for r in rows], marker="s", color="tab:orange",
             label="decode-only tokens/s")
    ax2.set_ylabel("decode-only tokens/s (link-bound)")
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88))
    ax.set_title("specstream, link-bound: tokens per round against the node budget")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
