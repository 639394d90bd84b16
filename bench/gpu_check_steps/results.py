"""The results file: sections merged one at a time, other tools' output attached, dead steps
marked, and the summary (a table of everything and the issue's targets)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def update(out: Path, section: str, value: Any) -> None:
    """Merge one section into the results file (read, replace the section, write atomically)."""
    data = json.loads(out.read_text()) if out.is_file() else {}
    data[section] = value
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(out)


def step_attach(args: argparse.Namespace) -> dict[str, Any]:
    """Store another tool's JSON output (e.g. `specstream bench --json`) as a section."""
    section: dict[str, Any] = {"status": "ok" if args.rc == 0 else f"failed (rc {args.rc})"}
    if args.file is not None and args.file.is_file():
        try:
            section["result"] = json.loads(args.file.read_text())
        except json.JSONDecodeError as exc:
            section["result_error"] = str(exc)
    return section


def targets(data: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets from the sections: exactness, identical modes, link use, floor."""
    out: dict[str, Any] = {
        "attention_exact": data.get("exactness", {}).get("passed"),
        "greedy_identical_across_modes": data.get("modes", {}).get("passed"),
    }
    pinned = data.get("bandwidth", {}).get("h2d_gbps", {}).get("median")
    modes = data.get("mechanics", {}).get("modes", {})
    for name, m in modes.items():
        if "step_s" not in m or not pinned:
            continue
        link_floor = m["h2d_per_step"] / (pinned * 1e9)
        # compute floor: the same work with all KV on the device (resident, with or without
        # speculation); a two-group step verifies half the batch and drafts the other half
        spec = name.split("+")[0] in ("resident", "offload-spec", "specstream", "parallel-spec")
        ref = modes.get("resident" if spec else "resident-ar", {})
        share = 0.5 if m["two_groups"] else 1.0
        compute = ref.get("step_s", 0.0) * share
        m["floor_s"] = max(link_floor, compute)
        m["over_floor"] = m["step_s"] / m["floor_s"] if m["floor_s"] else None
        m["link_frac_of_pinned"] = m["link_gbps_decode"] / pinned
    ss = modes.get("specstream", {})
    if "over_floor" in ss:
        out["specstream_link_ge_85pct"] = ss["link_frac_of_pinned"] >= 0.85
        out["specstream_round_le_1.2x_floor"] = ss["over_floor"] is not None and (
            ss["over_floor"] <= 1.2)
    if ss.get("round_time_over_floor") is not None:  # the floor of bench/floors.py
        out["specstream_round_time_over_floor"] = ss["round_time_over_floor"]
        out["specstream_link_utilization"] = ss["link_utilization"]
    base = modes.get("offload", {}).get("tok_per_s")
    if base and ss.get("tok_per_s"):
        out["specstream_over_offload"] = ss["tok_per_s"] / base
    for name, m in modes.items():  # the same mode with the other attention backend
        mode = name.split("+")[0]
        plain = modes.get(mode, {})
        if "+" in name and m.get("tok_per_s") and plain.get("tok_per_s"):
            key = f"{mode}_{plain['attention_backend']}_over_{m['attention_backend']}"
            out[key] = plain["tok_per_s"] / m["tok_per_s"]
    return out


def print_summary(out: Path) -> int:
    data = json.loads(out.read_text()) if out.is_file() else {}
    data["targets"] = targets(data)
    update(out, "targets", data["targets"])
    print(f"\n== GPU check summary ({out}) ==")
    for name, sec in data.items():
        if isinstance(sec, dict) and name not in ("targets",):
            print(f"{name:<12} {str(sec.get('status', '-')):<22} {sec.get('seconds', '-')} s")
    bw = data.get("bandwidth", {})
    if "h2d_gbps" in bw:
        print(f"pinned h2d {bw['h2d_gbps']['median']:.1f} GB/s (max {bw['h2d_gbps']['max']:.1f},"
              f" back to back {bw.get('h2d_gbps_back_to_back', float('nan')):.1f}; "
              f"{bw.get('timer', 'wall clock')}), d2h {bw['d2h_gbps']['median']:.1f}, "
              f"pageable h2d {bw['h2d_pageable_gbps']:.1f}")
        for size, r in bw.get("backend_h2d_sweep", {}).items():
            print(f"  backend.h2d {size:>8}: {r['wall_gbps']:.1f} GB/s wall, "
                  f"{r['issue_us_per_copy']:.1f} us issue/copy")
    for c in data.get("exactness", {}).get("cases", []):
        errs = ", ".join(f"{k} {v:.1e}" for k, v in c["rel_err"].items())
        print(f"  attention {c['dtype']:<8} {str(c['shape']):<34} {errs}  ok={c['ok']}")
    modes = data.get("mechanics", {}).get("modes", {})
    if modes:
        cols = ("attention_backend", "tok_per_s", "step_s", "link_gbps_decode",
                "link_gbps_busy", "link_util", "link_utilization", "over_floor",
                "round_time_over_floor", "decode_time_over_link_floor", "mean_accepted_len",
                "prefill_s")
        widths = [len(c) + 2 for c in cols]
        print(f"{'mode':<17}" + "".join(f"{c:>{w}}" for c, w in zip(cols, widths)))
        for name, m in modes.items():
            cells = "".join(f"{m[c]:>{w}.3f}" if isinstance(m.get(c), float | int) else
                            f"{str(m.get(c, '-')):>{w}}" for c, w in zip(cols, widths))
            print(f"{name:<17}{cells}  {m.get('status', '')}")
    for k, v in data["targets"].items():
        print(f"target {k:<34} {v}")
    return 0


def step_mark(args: argparse.Namespace) -> dict[str, Any]:
    """Record that a step died (timeout or crash) without writing its own section."""
    data = json.loads(args.out.read_text()) if args.out.is_file() else {}
    section = dict(data.get(args.target, {}))
    section.update(status="timeout" if args.rc in (124, 137) else "failed", rc=args.rc)
    return section

