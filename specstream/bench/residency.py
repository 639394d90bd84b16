"""``specstream bench --sweep-residency``: fill against tail residency over the device budget.

For each device KV budget F x the workload's KV, every offloading mode runs once with ``fill``
(free device blocks hold the newest history of the running requests; only the overflow streams)
and once with ``tail`` (a fixed resident tail per request; the rest streams every round). The
resident mode runs once, on a budget that holds the whole workload, as the exactness reference
and the floors' compute model. The PNG shows output tokens/s and history bytes per decode round
against F, one line per mode and residency, with the bytes no residency could keep on the device
(the floor). The README's figure uses ``--link-gbps 0.25``, where the link sets the round time.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from specstream.bench.runner import (
    BenchSettings,
    resident_fit_bytes,
    run_compared,
    run_reference,
    workload_kv_bytes,
)
from specstream.bench.workload import Workload

FRACTIONS = (0.1, 0.25, 0.5, 0.9)
RESIDENCIES = ("fill", "tail")
# (prompt tokens, requests, output tokens): 8 x 3168 tokens of the embedded target, ~156 MB of
# KV. At F = 0.1 the staging ring of specstream (8 MiB at the default chunk settings) leaves 9
# device blocks and the restore modes 19: one request at a time still fits every mode (6 requests
# would not). At 0.25 GB/s on 2 idle cores a tail point takes ~160-180 s for the four modes,
# fill ~60-150 s: the sweep takes ~20 minutes (--output-len 64: ~15).
SWEEP_WORKLOAD = (3072, 8, 96)

COLUMNS = [
    ("mode", "{}"), ("residency", "{}"), ("fraction", "{:g}"), ("output_tokens_per_s", "{:.1f}"),
    ("link_bytes_per_round", "{:.3g}"), ("link_bytes_floor_per_round", "{:.3g}"),
    ("device_kv_utilization", "{:.2f}"), ("link_bytes_per_token", "{:.3g}"),
    ("max_concurrency", "{}"), ("outputs_match_reference", "{}"),
]
# per-step records stay out of the sweep's JSON (33 runs of them)
_DROPPED = ("rounds", "prefill_steps")


def run_residency_sweep(
    s: BenchSettings, workload: Workload, modes: tuple[str, ...],
    fractions: tuple[float, ...] = FRACTIONS, png: Path = Path("bench-residency.png"),
) -> dict[str, Any]:
    """Every offloading mode of ``modes`` x residency x F; returns the report (JSON-ready)."""
    from specstream.bench.cli import format_rows  # the bench's table (cli imports this module)

    total = workload_kv_bytes(workload, s)
    offloading = tuple(m for m in modes if m != "resident")
    reference_budget = resident_fit_bytes(workload, s)
    print(f"[residency] workload {workload.num_requests} x {workload.context_lengths[0]} + "
          f"{workload.output_len} tokens: {total} bytes of KV; resident reference on "
          f"{reference_budget} bytes (the whole workload fits) ...", flush=True)
    reference, ref = run_reference(
        workload, replace(s, device_kv_bytes=reference_budget, reference_device_kv_bytes=None))
    print(f"[residency] resident: {reference['output_tokens_per_s']:.1f} tok/s", flush=True)
    points: list[dict[str, Any]] = []
    for f in fractions:
        budget = int(f * total)
        for residency in RESIDENCIES:
            run = replace(s, device_kv_bytes=budget, reference_device_kv_bytes=None,
                          residency=residency)
            for mode in offloading:
                print(f"[residency] F {f:g} ({budget} bytes), {residency}, {mode} ...",
                      flush=True)
                point = {"fraction": f, "residency": residency, "mode": mode,
                         "device_kv_bytes": budget}
                try:
                    r = run_compared(mode, workload, run, ref)
                except ValueError as exc:
                    # the budget cannot hold the mode's working room (staging ring, restored
                    # layers) and one request's tail: the engine refuses, the point is missing
                    print(f"[residency]   does not fit: {exc}", flush=True)
                    points.append({**point, "skipped": str(exc)})
                    continue
                points.append({**point, **{k: v for k, v in r.items() if k not in _DROPPED}})
                print(f"[residency]   {r['output_tokens_per_s']:.1f} tok/s, "
                      f"{r['link_bytes_per_round']:.3g} bytes/round (floor "
                      f"{r['link_bytes_floor_per_round']:.3g}), device KV utilization "
                      f"{r['device_kv_utilization']:.2f}", flush=True)
        ran = [p for p in points if p["fraction"] == f and "skipped" not in p]
        if ran:
            print(format_rows(ran, COLUMNS))
        for line in ratio_lines(f, residency_ratios(points, f)):
            print(line)
    plot_residency(points, reference, png)
    print(f"[residency] wrote {png}")
    return {
        "workload": {"context_lengths": list(workload.context_lengths),
                     "output_len": workload.output_len, "num_requests": workload.num_requests},
        "settings": {k: v for k, v in vars(s).items()
                     if k not in ("extra", "residency", "device_kv_bytes",
                                  "reference_device_kv_bytes")} | s.extra,
        "workload_kv_bytes": total,
        "fractions": list(fractions),
        "residencies": list(RESIDENCIES),
        "reference": {**{k: v for k, v in reference.items() if k not in _DROPPED},
                      "device_kv_bytes": reference_budget},
        "points": points,
        "ratios": {f"{f:g}": residency_ratios(points, f) for f in fractions},
    }


def residency_ratios(points: list[dict[str, Any]], f: float) -> dict[str, dict[str, float]]:
    """At F, per mode: tail over fill link bytes per round, fill link bytes over the floor, and
    fill over tail output tokens/s (end to end, and over decode steps only)."""
    at = {(p["mode"], p["residency"]): p for p in points
          if p["fraction"] == f and "skipped" not in p}
    out: dict[str, dict[str, float]] = {}
    for mode in dict.fromkeys(m for m, _ in at):
        fill, tail = at.get((mode, "fill")), at.get((mode, "tail"))
        r = out.setdefault(mode, {})
        if fill and fill["link_bytes_floor_per_round"]:
            r["fill_bytes_over_floor"] = (
                fill["link_bytes_per_round"] / fill["link_bytes_floor_per_round"])
        if not (fill and tail):
            continue
        if fill["link_bytes_per_round"]:
            r["tail_over_fill_bytes"] = tail["link_bytes_per_round"] / fill["link_bytes_per_round"]
        r["fill_over_tail_throughput"] = fill["output_tokens_per_s"] / tail["output_tokens_per_s"]
        if tail["decode_tokens_per_s"]:
            r["fill_over_tail_decode"] = fill["decode_tokens_per_s"] / tail["decode_tokens_per_s"]
    return out


_RATIO_WORDS = (("tail_over_fill_bytes", "link bytes/round tail/fill {:.2f}"),
                ("fill_bytes_over_floor", "fill/floor {:.2f}"),
                ("fill_over_tail_throughput", "throughput fill/tail {:.2f}"),
                ("fill_over_tail_decode", "(decode steps {:.2f})"))


def ratio_lines(f: float, ratios: dict[str, dict[str, float]]) -> list[str]:
    """The ratios the issue judges residency by, one line per mode."""
    return [f"[residency] F {f:g} {mode}: "
            + ", ".join(words.format(r[k]) for k, words in _RATIO_WORDS if k in r)
            for mode, r in ratios.items() if r]


def plot_residency(points: list[dict[str, Any]], reference: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    ran = [p for p in points if "skipped" not in p]
    fig, (tps, link) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    modes = list(dict.fromkeys(p["mode"] for p in ran))
    for i, mode in enumerate(modes):
        color = colors[i % len(colors)]
        for residency, style in (("fill", "-"), ("tail", "--")):
            pts = sorted((p["fraction"], p["output_tokens_per_s"], p["link_bytes_per_round"],
                          p["link_bytes_floor_per_round"]) for p in ran
                         if p["mode"] == mode and p["residency"] == residency)
            if not pts:
                continue
            x = [q[0] for q in pts]
            tps.plot(x, [q[1] for q in pts], style, color=color, marker="o")
            link.plot(x, [q[2] / 1e6 for q in pts], style, color=color, marker="o")
            if residency == "fill":
                link.plot(x, [q[3] / 1e6 for q in pts], ":", color=color, linewidth=1.5)
    tps.axhline(reference["output_tokens_per_s"], color="gray", linewidth=1)
    tps.set_ylabel("output tokens/s")
    tps.set_title("throughput (gray: resident, the whole workload on the device)")
    link.set_ylabel("history MB over the link per decode round")
    link.set_title("link bytes per round")
    for ax in (tps, link):
        ax.set_xlabel("device KV budget, fraction of the workload's KV")
        ax.set_xlim(0, 1)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    # one colour per mode, one line style per residency (dotted: the floor)
    handles = [Line2D([], [], color=colors[i % len(colors)], label=m)
               for i, m in enumerate(modes)]
    handles += [Line2D([], [], color="black", linestyle=s, label=w)
                for s, w in (("-", "fill"), ("--", "tail"), (":", "floor (no residency "
                                                                  "streams less)"))]
    link.legend(handles=handles, fontsize=8)
    tps.legend(handles=handles[:-1], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
