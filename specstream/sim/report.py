"""Plain-text tables and the plain-English verdict for a simulated scenario."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from specstream.sim.api import Scenario, by_mode
from specstream.sim.memory import kv_bytes_total, link_bytes_per_round, max_concurrency, plan
from specstream.sim.policy import OFFLOAD_MODES
from specstream.sim.serving import ModeResult

GB = 1e9


def _fmt(x: float, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def results_table(results: Sequence[ModeResult]) -> str:
    """One markdown row per mode."""
    head = ("| mode | GPUs | q | max conc. | in flight | tok/s | tok/s/GPU | TTFT s | TPOT ms "
            "| link util. | link GB/round | round ms | floor ms | verify waits ms/round |")
    lines = [head, "|" + " --- |" * 14]
    for r in results:
        rnd = r.round
        if not r.feasible:
            lines.append(f"| {r.mode} | {r.gpus} | - | 0 | 0 | does not fit |" + " - |" * 8)
            continue
        lines.append(
            f"| {r.mode} | {r.gpus} | {r.q} | {r.max_concurrency} | {r.admitted} "
            f"| {r.throughput:.1f} | {r.throughput_per_gpu:.1f} | {_fmt(r.ttft_s, '.2f')} "
            f"| {_fmt(r.tpot_s * 1e3, '.1f')} | {r.link_utilisation:.0%} "
            f"| {_fmt(rnd.link_bytes / GB if rnd else math.nan, '.1f')} "
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
    lines += _residency_lines(scenario, [r for r in results if r.feasible], peak, n)
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


def _residency_lines(scenario: Scenario, results: Sequence[ModeResult], peak: int,
                     n: int) -> list[str]:
    """How much of the batch's history the ``fill`` residency keeps on the device, and the link
    bytes per round against the fixed tail (memory plan only: no extra simulation)."""
    c, p = scenario.costs, scenario.policy
    offloading = [r for r in results if r.mode in OFFLOAD_MODES]
    if p.residency != "fill" or not offloading:
        return []
    mode = next((r.mode for r in offloading if r.mode == "specstream"), offloading[0].mode)
    batch = [float(peak)] * min(n, by_mode(offloading)[mode].admitted)
    fill = link_bytes_per_round(mode, c, p, batch)
    tail = link_bytes_per_round(mode, c, replace(p, residency="tail"), batch)
    history = sum(batch) * c.kv_bytes("target")
    share = plan(mode, c, p, batch).share
    fewer = f"{tail / fill:.1f}x fewer" if fill else "nothing streams"
    return [f"Residency fill ({mode}, {len(batch)} requests at {peak:,} tokens): the device "
            f"keeps {(history - fill) / GB:.1f} GB of their {history / GB:.1f} GB of history "
            f"(the newest {min(share, peak):,.0f} tokens of each); {fill / GB:.1f} GB cross the "
            f"link per round instead of {tail / GB:.1f} GB with the fixed tail ({fewer})."]


def residency_table(tail: Sequence[ModeResult], fill: Sequence[ModeResult]) -> str:
    """The same scenario under both residencies, per mode (``--compare-residency``)."""
    lines = ["| mode | max conc. tail / fill | link GB/round tail | link GB/round fill "
             "| bytes tail / fill | tok/s tail | tok/s fill | fill / tail |",
             "|" + " --- |" * 8]
    for t, f in zip(tail, fill, strict=True):
        if not (t.feasible and f.feasible and t.round and f.round):
            lines.append(f"| {t.mode} | {t.max_concurrency} / {f.max_concurrency} |"
                         + " - |" * 6)
            continue
        tb, fb = t.round.link_bytes, f.round.link_bytes
        lines.append(
            f"| {t.mode} | {t.max_concurrency} / {f.max_concurrency} | {tb / GB:.1f} "
            f"| {fb / GB:.1f} | {f'{tb / fb:.2f}x' if fb else 'all resident'} "
            f"| {t.throughput:.1f} | {f.throughput:.1f} | {f.throughput / t.throughput:.2f}x |")
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
    place = (f"residency fill (tail {p.resident_tail} at least)" if p.residency == "fill"
             else f"residency tail {p.resident_tail}, offload past {p.offload_threshold}")
    parts.append(f"  acceptance: {acc}; q={'auto ' + str(p.q_choices) if p.q is None else p.q}"
                 f"; chunk {p.chunk_tokens}, {place}, draft window {p.draft_window}")
    levers = []
    kv_dtype = getattr(scenario.costs, "kv_dtype_bytes", None)
    if kv_dtype is not None:
        levers.append(f"KV cache at {kv_dtype:g} B/element (target "
                      f"{scenario.costs.kv_bytes('target') / 1024:.0f} KiB/token)")
    if scenario.costs.link_copy_s:
        levers.append(f"{scenario.costs.link_copy_s * 1e6:g} us per copy on the link")
    if p.host_attention != "off" and scenario.hardware is not None:
        levers.append(f"host attention {p.host_attention} "
                      f"({scenario.hardware.describe_host()}, assumed)")
    if levers:
        parts.append("  levers: " + "; ".join(levers))
    return "\n".join(parts)
