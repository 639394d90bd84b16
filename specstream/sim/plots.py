"""Plots: throughput per mode against context length; one simulated round as a timeline.

matplotlib is imported inside the functions (Agg backend), so importing the simulator never
needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from specstream.sim.rounds import RoundResult
from specstream.sim.serving import ModeResult

_COLOURS = {"link": "#4c72b0", "verify": "#dd8452", "draft": "#55a868", "prefill": "#8172b2"}


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(contexts: Sequence[int], sweep: dict[str, list[ModeResult]], path: str | Path,
               title: str = "", per_gpu: bool = True) -> Path:
    """Throughput (per GPU by default) of each mode at each context length."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode, results in sweep.items():
        ys = [(r.throughput_per_gpu if per_gpu else r.throughput) if r.feasible else float("nan")
              for r in results]
        ax.plot([c / 1024 for c in contexts], ys, marker="o", label=mode)
    ax.set_xlabel("context length (K tokens)")
    ax.set_ylabel("output tokens/s" + (" per GPU" if per_gpu else ""))
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(title or "simulated throughput per mode")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_timeline(rounds: Sequence[RoundResult], path: str | Path, title: str = "") -> Path:
    """One steady-state round per given result, as lanes: link, target compute, draft."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(rounds), 1, figsize=(10, 1.6 + 1.3 * len(rounds)),
                             squeeze=False)
    for ax, rnd in zip(axes[:, 0], rounds, strict=True):
        t0, t1 = rnd.window
        lanes = {("link", "link"): 2, ("compute", "verify"): 1, ("compute", "draft"): 0,
                 ("draft_gpu", "draft"): 0}
        for t in rnd.tasks:
            if t.end <= t0 or t.start >= t1 or t.duration <= 0:
                continue
            lane = lanes.get((t.resource, t.kind), 1)
            start, end = max(t.start, t0), min(t.end, t1)
            ax.broken_barh([((start - t0) * 1e3, (end - start) * 1e3)], (lane - 0.4, 0.8),
                           facecolors=_COLOURS.get(t.kind, "grey"),
                           edgecolors="white", linewidth=0.2)
        draft_lane = "draft (GPU 2)" if rnd.mode == "parallel-spec" else "draft (low prio)"
        ax.set_yticks([0, 1, 2], [draft_lane, "verify", "link"])
        ax.set_xlim(0, (t1 - t0) * 1e3)
        ax.set_title(f"{rnd.mode}: q={rnd.q}, batch {rnd.batch}, round "
                     f"{rnd.period_s * 1e3:.1f} ms, link busy {rnd.link_utilisation:.0%}",
                     fontsize=9)
    axes[-1, 0].set_xlabel("time within one steady-state round (ms)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
