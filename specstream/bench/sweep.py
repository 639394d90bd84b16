"""``specstream bench --sweep``: throughput per mode over emulated link bandwidth and context.

Each point is a full (smaller) bench run; the PNG shows output tokens/s per mode against link
bandwidth, one panel per context length, from the compute-bound end to the link-bound end.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

from specstream.bench.runner import BenchSettings, run_all
from specstream.bench.workload import Workload

LINKS_GBPS = (0.25, 1.0, 4.0)
CONTEXTS = (2048, 4096)
# each point is a smaller workload than the single bench, so the sweep fits in ~10 minutes
SWEEP_REQUESTS, SWEEP_OUTPUT = 4, 96


def run_sweep(s: BenchSettings, args: argparse.Namespace, modes: tuple[str, ...]) -> dict:
    points: list[dict[str, Any]] = []
    for ctx in CONTEXTS:
        workload = Workload((ctx,) * SWEEP_REQUESTS, SWEEP_OUTPUT)
        for gbps in LINKS_GBPS:
            run = copy.copy(s)
            run.link_gbps = gbps
            print(f"[sweep] context {ctx}, link {gbps} GB/s", flush=True)
            results = run_all(workload, run, modes, progress=False)
            for mode, r in results.items():
                points.append({"context_len": ctx, "link_gbps": gbps, "mode": mode,
                               **{k: v for k, v in r.items() if k != "rounds"}})
                print(f"  {mode:14s} {r['output_tokens_per_s']:7.2f} tok/s  link util "
                      f"{r['link_utilization']:.2f} (decode-only rounds "
                      f"{r['decode_only_link_utilization']:.2f})  round/floor "
                      f"{r['round_time_over_floor']:.2f} (decode-only "
                      f"{r['decode_only_round_time_over_floor']:.2f})", flush=True)
    png = Path(args.json).with_suffix(".png") if args.json else Path("bench-sweep.png")
    plot_sweep(points, png)
    print(f"[sweep] wrote {png}")
    return {"sweep": points, "links_gbps": LINKS_GBPS, "contexts": CONTEXTS}


def plot_sweep(points: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({p["context_len"] for p in points})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5.5 * len(contexts), 4), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        for mode in dict.fromkeys(p["mode"] for p in points):
            pts = sorted((p["link_gbps"], p["output_tokens_per_s"]) for p in points
                         if p["mode"] == mode and p["context_len"] == ctx)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("emulated link GB/s (left: link-bound, right: compute-bound)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"context {ctx} tokens")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
