"""Plain-text tables and the plain-English verdict for a simulated scenario."""

from __future__ import annotations

import math
from collections.abc import Sequence

from specstream.sim.api import Scenario, by_mode
from specstream.sim.memory import kv_bytes_total, max_concurrency
from specstream.sim.serving import ModeResult

GB = 1e9


def _fmt(x: float, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def results_table(results: Sequence[ModeResult]) -> str:
    """One markdown row per mode."""
    head = ("| mode | GPUs | q | max conc. | in flight | tok/s | tok/s/GPU | TTFT s | TPOT ms "
            "| link util. | round ms | floor ms | verify waits ms/round |")
    lines = [head, "|" + " --- |" * 13]
    for r in results:
        rnd = r.round
        if not r.feasible:
            lines.append(f"| {r.mode} | {r.gpus} | - | 0 | 0 | does not fit |" + " - |" * 7)
            continue
        lines.append(
            f"| {r.mode} | {r.gpus} | {r.q} | {r.max_concurrency} | {r.admitted} "
            f"| {r.throughput:.1f} | {r.throughput_per_gpu:.1f} | {_fmt(r.ttft_s, '.2f')} "
            f"| {_fmt(r.tpot_s * 1e3, '.1f')} | {r.link_utilisation:.0%} "
            f"| {_fmt(rnd.period_s * 1e3 if rnd else math.nan, '.1f')} "
            f"| {_fmt(rnd.floor_s * 1e3 if rnd else math.nan, '.1f')} "
            f"| {_fmt(rnd.verify_wait_s * 1e3 if rnd else math.nan, '.1f')} |")
    return "\n".join(lines)


def verdict(scenario: Scenario, results: Sequence[ModeResult]) -> str:
    """Answers: does the KV exceed device memory, does verification wait on restoration,
    which mode gives the most throughput per GPU."""
    c, p, w = scenario.costs, scenario.policy, scenario.workload
    peak = w.max_context + w.output_len
    n = w.concurrency or max(r.admitted for r in results)
    kv = kv_bytes_total(c, p, [peak] * n)
    free = c.device_budget_bytes - c.weight_bytes("target") - c.weight_bytes("draft")
    fit = max_concurrency("resident", c, p, peak)
    exceeds = kv > free
    lines = [
        f"KV cache: {n} requests x {peak:,} tokens need {kv / GB:.1f} GB of target+draft KV; "
        f"{max(free, 0) / GB:.1f} GB of device memory is left after the weights -> "
        + (f"EXCEEDS device memory: all-resident serving admits at most {fit} at once."
           if exceeds else f"fits (all-resident serving admits up to {fit})."),
    ]
    res = by_mode(results)
    for mode in ("offload-spec", "specstream"):
        r = res.get(mode)
        if r is None or r.round is None:
            continue
        rnd = r.round
        wait = rnd.verify_wait_s / rnd.period_s if rnd.period_s else 0.0
        lines.append(
            f"{mode}: verification {'WAITS' if rnd.waits_on_restore else 'does not wait'} on "
            f"restoration ({rnd.verify_wait_s * 1e3:.1f} ms of a {rnd.period_s * 1e3:.1f} ms "
            f"round, {wait:.0%}); link busy {rnd.link_utilisation:.0%} of the round, "
            f"round/floor {rnd.period_s / rnd.floor_s if rnd.floor_s else math.nan:.2f}.")
    feasible = [r for r in results if r.feasible]
    if feasible:
        best = max(feasible, key=lambda r: r.throughput_per_gpu)
        line = (f"Most throughput per GPU: {best.mode} ({best.throughput_per_gpu:.1f} tok/s/GPU"
                f" on {best.gpus} GPU{'s' if best.gpus > 1 else ''}, {best.admitted} in flight)")
        if "specstream" in res and best.mode != "specstream" and res["specstream"].feasible:
            gain = best.throughput_per_gpu / res["specstream"].throughput_per_gpu
            line += f"; {gain:.2f}x specstream's"
        lines.append(line + ".")
    for r in results:
        if not r.feasible:
            lines.append(f"{r.mode}: not even one request of {peak:,} tokens fits.")
        elif w.concurrency and r.admitted < w.concurrency:
            lines.append(f"{r.mode}: memory limits it to {r.admitted} of the {w.concurrency} "
                         "requests asked for in flight (the rest queue: see TTFT).")
    return "\n".join(lines)


def describe(scenario: Scenario) -> str:
    """What was simulated, one line per ingredient."""
    w, a, p = scenario.workload, scenario.acceptance, scenario.policy
    parts = [f"scenario: {scenario.label}"]
    for obj in (scenario.hardware, scenario.target, scenario.draft):
        if obj is not None:
            parts.append("  " + obj.describe())
    load = (f"{w.concurrency} in flight" if w.arrival_rate is None
            else f"{w.arrival_rate} req/s (cap {w.concurrency})")
    parts.append(f"  workload: contexts {list(w.context_lengths)}, output {w.output_len}, "
                 f"{w.total_requests} requests, {load}")
    acc = (f"alpha={a.alpha}" if a.alpha is not None
           else f"measured histogram at q={a.measured_q} (alpha~{a.effective_alpha:.3f})")
    parts.append(f"  acceptance: {acc}; q={'auto ' + str(p.q_choices) if p.q is None else p.q}"
                 f"; chunk {p.chunk_tokens}, tail {p.resident_tail}, offload past "
                 f"{p.offload_threshold}, draft window {p.draft_window}")
    return "\n".join(parts)
