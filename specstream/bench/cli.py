"""``specstream bench``: every mode side by side on one long-context workload."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

from specstream.bench.residency import FRACTIONS, SWEEP_WORKLOAD
from specstream.bench.runner import (
    ALL_MODES,
    BenchSettings,
    resident_fit_bytes,
    run_all,
    workload_kv_bytes,
)
from specstream.bench.shared import COLUMNS as SHARED_COLUMNS
from specstream.bench.shared import add_shared_args, resolve_shared, run_shared_bench
from specstream.bench.workload import Workload
from specstream.config import detect_device

# Default emulated link: 1 GB/s. At the default workload (8 requests x 4K tokens of a 6 KiB/token
# target) a round restores ~100-200 MB, which at 1 GB/s takes about as long as the round's
# verification + drafting compute on one CPU thread: the balanced regime in which overlapping
# the link with compute decides the round time. The sweep covers 4x either side, from
# compute-bound to link-bound; `specstream simulate` answers for real GPUs and PCIe links.
DEFAULT_LINK_GBPS = 1.0
# Workloads (prompt tokens, requests, output tokens): the bench's, --quick's (about 2 minutes).
WORKLOAD, QUICK_WORKLOAD = (4096, 8, 128), (2048, 6, 48)
# --workload multiturn (context tokens, conversations, output tokens per turn), default and
# --quick; with 4 turns of 96-token messages a default conversation ends at 4,224 tokens (its
# last prompt 4,160), 99 MiB of KV for the four against the default 64 MiB device budget.
MULTITURN_WORKLOAD, MULTITURN_QUICK = (3584, 4, 64), (1536, 4, 32)
TURNS, MESSAGE_LEN = 4, 96

# Presets (`--preset`): `balanced` is the defaults above. `link-bound` makes a decode round
# link-bound the way an H200 with an 8B target over PCIe 5 is (25-50x): residency tail (every
# token past a request's 256-token tail streams, the paper's configuration) over a 0.1 GB/s
# link: a specstream round of four 4K-token requests streams 4 x 3,840 tokens x 6 KiB = 94 MB,
# 0.94 s, against 35-45 ms of verification on one CPU thread (21-27x). 64 output tokens keep
# a run of every step near a minute. Four staging slots (of two-request waves): a step that
# carries a prefill chunk computes a layer for about as long as that layer's history takes to
# stream, and with two slots only half of the next layer's waves could land meanwhile (the
# ladder's tree step: 1.30x end to end with two, 1.40x with four); four slots of one layer are
# still under a third of the two layers of history the restore modes hold.
PRESETS: dict[str, dict[str, Any]] = {
    "balanced": {},
    "link-bound": {"link_gbps": 0.1, "residency": "tail", "output_len": 64,
                   "staging_buffers": 4},
}
# The flags a preset sets, by their values without one (a flag on the command line wins:
# ``apply_preset``; --output-len's None is the workload's own length)
PRESET_DEFAULTS: dict[str, Any] = {"link_gbps": DEFAULT_LINK_GBPS, "residency": "fill",
                                   "staging_buffers": BenchSettings.staging_buffers}

COLUMNS = [
    ("mode", "{}"), ("output_tokens_per_s", "{:.1f}"),
    ("output_tokens_per_s_per_device", "{:.1f}"), ("decode_tokens_per_s", "{:.1f}"),
    ("devices", "{}"), ("mean_accepted_len", "{:.2f}"), ("link_utilization", "{:.2f}"),
    ("floor_s", "{:.1f}"), ("round_time_over_floor", "{:.2f}"),
    ("decode_only_round_time_over_floor", "{:.2f}"), ("device_kv_peak_bytes", "{:.3g}"),
    ("link_bytes_per_round", "{:.3g}"), ("device_kv_utilization", "{:.2f}"),
    ("max_concurrency", "{}"), ("ttft_ms_p50", "{:.0f}"), ("ttft_ms_p99", "{:.0f}"),
    ("tpot_ms_p50", "{:.1f}"), ("tpot_ms_p99", "{:.1f}"), ("outputs_match_reference", "{}"),
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="run every mode side by side on a long-context workload",
        description="Runs one workload (prompts cut from held-out standard library modules) "
                    "through every mode in one process with the same seeds, and prints a table.",
    )
    p.add_argument("--model", default=None, help="target folder (default: embedded target)")
    p.add_argument("--draft-model", default=None, help="draft folder (default: embedded draft)")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when this torch sees a CUDA device, else cpu), cpu, or "
                        "cuda[:N]")
    p.add_argument("--dtype", default="auto",
                   help="weights and KV dtype (auto: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--modes", default=",".join(ALL_MODES), help="comma-separated modes")
    p.add_argument("--workload", choices=["single", "multiturn", "shared-doc", "shared-system"],
                   default="single",
                   help="single: one long prompt per request; multiturn: conversations that "
                        "re-send their whole history plus a new message every turn, run with "
                        "the prefix cache on and off in every mode; shared-doc / "
                        "shared-system: requests that share a long document / system prompt, "
                        "every offloading mode with prefix sharing on and off (bench/shared.py)")
    p.add_argument("--context-len", type=int, default=None,
                   help=f"prompt tokens per request (default {WORKLOAD[0]}; "
                        f"{SWEEP_WORKLOAD[0]} with --sweep-residency; multiturn: the context "
                        f"opening every conversation, default {MULTITURN_WORKLOAD[0]})")
    p.add_argument("--num-requests", type=int, default=None,
                   help=f"requests in the workload (default {WORKLOAD[1]}; "
                        f"{SWEEP_WORKLOAD[1]} with --sweep-residency; multiturn: "
                        f"conversations, default {MULTITURN_WORKLOAD[1]})")
    p.add_argument("--output-len", type=int, default=None,
                   help=f"greedy output tokens per request (default {WORKLOAD[2]}; "
                        f"{SWEEP_WORKLOAD[2]} with --sweep-residency; multiturn: per turn, "
                        f"default {MULTITURN_WORKLOAD[2]})")
    add_shared_args(p)
    p.add_argument("--turns", type=int, default=TURNS,
                   help="multiturn: turns per conversation")
    p.add_argument("--message-len", type=int, default=MESSAGE_LEN,
                   help="multiturn: tokens of each turn's user message")
    p.add_argument("--host-attention", choices=["off", "auto"], default=None,
                   help="offloading modes: attend part of each request's cold history on the "
                        "host CPU beside the link (auto), or not (default: the engine's, auto "
                        "where the host has cores the engine's threads leave)")
    p.add_argument("--no-merge-groups", action="store_true",
                   help="specstream: two groups even where verification hides the link")
    p.add_argument("--host-attention-gbps", type=float, default=None,
                   help="emulated host attention rate of the cpu backend, GB/s of KV attended "
                        "(default: none, as fast as this machine's host computes)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="turn automatic prefix caching off in every run (multiturn: run only "
                        "without the cache; by default it runs every mode with and without)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="emulated link bandwidth of the cpu backend, GB/s (ignored on cuda; "
                        f"default: {DEFAULT_LINK_GBPS}, or the preset's)")
    p.add_argument("--device-kv-bytes", type=float, default=64 << 20,
                   help="device KV budget of every mode, bytes")
    p.add_argument("--device-kv-fraction", type=float, default=None, metavar="F",
                   help="device KV budget of every mode = F x the workload's KV (every "
                        "request's prompt and output); overrides --device-kv-bytes. The "
                        "resident reference then runs on a budget that holds the whole workload")
    p.add_argument("--residency", choices=["fill", "tail"], default=None,
                   help="what the offloading modes keep on the device: fill (free device "
                        "blocks hold the newest history; only the overflow streams) or tail "
                        "(a fixed resident tail per request; default: fill, or the preset's)")
    p.add_argument("-q", "--num-speculative-tokens", type=int, default=None,
                   help="draft tokens per round in the speculative modes (a tree's depth; "
                        "default: the engine's, up to 8 under auto, 4 under fixed)")
    p.add_argument("--speculative-topk", type=int, default=None,
                   help="token trees: children per expanded node (1: chains of -q drafts; "
                        "default: the engine's, trees of up to 4 under auto)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="token trees: nodes per request and round, the last accepted token not "
                        "counted (default: -q)")
    p.add_argument("--speculative-policy", choices=["auto", "fixed"], default=None,
                   help="speculative modes: 'auto' chooses each round's shape (depth up to -q, "
                        "trees with --speculative-topk > 1) from what the engine measures, "
                        "'fixed' drafts -q every round (default: the engine's, auto)")
    p.add_argument("--chunk-tokens", type=int, default=BenchSettings.chunk_tokens,
                   help="tokens per streamed restore chunk (default: the engine's)")
    p.add_argument("--staging-buffers", type=int, default=None,
                   help="chunk-wave slots in the staging ring of specstream (default: "
                        f"{BenchSettings.staging_buffers}, or the preset's)")
    p.add_argument("--wave-requests", type=int, default=BenchSettings.wave_requests,
                   help="requests per chunk wave (a staging slot holds one chunk of each)")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                   help="attention kernels of every mode (auto: Triton on CUDA, else torch)")
    p.add_argument("--block-size", type=int, default=128, help="tokens per KV block")
    p.add_argument("--resident-tail-tokens", type=int, default=256,
                   help="newest tokens of a request kept on the device")
    p.add_argument("--offload-after-tokens", type=int, default=512,
                   help="history moves to the host past this many tokens")
    p.add_argument("--quick", action="store_true", help="a smaller run (about 2 minutes)")
    p.add_argument("--sweep", action="store_true",
                   help="sweep link bandwidth and context length; writes a PNG")
    p.add_argument("--sweep-residency", action="store_true",
                   help="sweep the device KV budget (F of the workload's KV) for fill and tail "
                        "residency in every offloading mode; writes a PNG (about 20 minutes on "
                        "2 cores at --link-gbps 0.25, the link-bound setting)")
    p.add_argument("--fractions", default=",".join(map(str, FRACTIONS)),
                   help="comma-separated F values of --sweep-residency")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="balanced: the defaults; link-bound: residency tail over a 0.1 GB/s link "
                        "and 64 output tokens, a round's link time 21-27x its verification, "
                        "as on an H200 with an 8B target, four staging slots (sets --link-gbps, "
                        "--residency, --output-len and --staging-buffers where the command "
                        "line does not; default: none)")
    p.add_argument("--ladder", action="store_true",
                   help="the ablation ladder: offload-spec (q = 4) -> + streaming -> + drafting "
                        "in the gaps -> + adaptive chain -> + trees, one run each")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="run every mode with the target sharded over this many ranks (one "
                        "process each); the link bytes and times reported are one rank's "
                        "(on cpu the ranks share the cores: no wall-time gain to expect)")
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.add_argument("--trace", default=None,
                   help="Chrome trace JSON of the specstream run (and a .png timeline)")
    p.set_defaults(func=run)


def apply_preset(args: argparse.Namespace) -> None:
    """The preset's values for the flags the command line left unset, then the defaults."""
    for k, v in [*PRESETS.get(args.preset or "", {}).items(), *PRESET_DEFAULTS.items()]:
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def settings_from(args: argparse.Namespace) -> BenchSettings:
    apply_preset(args)
    # resolved here, so the settings (and the results JSON) name the device the run used
    device = detect_device() if args.device == "auto" else args.device
    return BenchSettings(
        model=args.model, draft_model=args.draft_model, device=device, dtype=args.dtype,
        device_kv_bytes=int(args.device_kv_bytes),
        # the emulated link's rate; a real device's link sets its own pace (and the floors
        # then use the rate the engine measures)
        link_gbps=None if device.startswith("cuda") else args.link_gbps,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_topk=args.speculative_topk,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        speculative_policy=args.speculative_policy, chunk_tokens=args.chunk_tokens,
        staging_buffers=args.staging_buffers, wave_requests=args.wave_requests,
        block_size=args.block_size,
        resident_tail_tokens=args.resident_tail_tokens,
        offload_after_tokens=args.offload_after_tokens, residency=args.residency,
        enable_prefix_caching=not args.no_prefix_caching, host_attention=args.host_attention,
        merge_groups=not args.no_merge_groups,
        extra={"attention_backend": args.attention_backend,
               "tensor_parallel_size": args.tensor_parallel_size,
               **({"host_attention_gbps": args.host_attention_gbps}
                  if args.host_attention_gbps else {})},
    )


def format_table(results: dict[str, dict[str, Any]]) -> str:
    return format_rows(list(results.values()), COLUMNS)


def format_rows(results: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """One row per result, one column per (key, format)."""
    header = [c for c, _ in columns]
    rows = [[fmt.format(r[c]) for c, fmt in columns] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("-|-".join("-" * w for w in widths))
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The comparisons the project is judged by, measured in this run."""
    out: dict[str, float] = {}
    ss = results.get("specstream")
    if ss is None:
        return out
    for base in ("offload-spec", "offload", "parallel-spec", "resident"):
        if base in results:
            b = results[base]
            out[f"specstream_over_{base}"] = ss["output_tokens_per_s"] / b["output_tokens_per_s"]
            out[f"specstream_over_{base}_per_device"] = (
                ss["output_tokens_per_s_per_device"] / b["output_tokens_per_s_per_device"])
            if b["decode_tokens_per_s"]:
                out[f"specstream_over_{base}_decode"] = (
                    ss["decode_tokens_per_s"] / b["decode_tokens_per_s"])
            if b.get("decode_only_tokens_per_s"):
                out[f"specstream_over_{base}_decode_only"] = (
                    ss["decode_only_tokens_per_s"] / b["decode_only_tokens_per_s"])
    if "resident" in results:
        out["concurrency_specstream_over_resident"] = (
            ss["max_concurrency"] / max(1, results["resident"]["max_concurrency"]))
    return out


def resolve_workload(args: argparse.Namespace) -> Workload:
    """The workload the flags ask for (unset sizes take the run's defaults); fills them in."""
    multiturn = args.workload in ("multiturn", "shared-system")
    if args.workload == "shared-doc":
        resolve_shared(args)
    elif args.quick:
        args.context_len, args.num_requests, args.output_len = (
            MULTITURN_QUICK if multiturn else QUICK_WORKLOAD)
    defaults = (SWEEP_WORKLOAD if args.sweep_residency else
                MULTITURN_WORKLOAD if multiturn else WORKLOAD)
    for name, default in zip(("context_len", "num_requests", "output_len"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
    return Workload((args.context_len,) * args.num_requests, args.output_len)


def apply_fraction(s: BenchSettings, workload: Workload, fraction: float) -> dict[str, Any]:
    """Set every mode's device KV budget to ``fraction`` of the workload's KV, and the resident
    reference's to one that holds the whole workload; returns what to record of it."""
    if fraction <= 0:
        raise ValueError(f"--device-kv-fraction must be > 0, got {fraction}")
    total = workload_kv_bytes(workload, s)
    s.device_kv_bytes = int(fraction * total)
    s.reference_device_kv_bytes = max(s.device_kv_bytes, resident_fit_bytes(workload, s))
    print(f"[bench] device KV budget {fraction:g} x {total} bytes of workload KV = "
          f"{s.device_kv_bytes} bytes (resident reference: {s.reference_device_kv_bytes} "
          "bytes, the whole workload fits)", flush=True)
    return {"device_kv_fraction": fraction, "workload_kv_bytes": total,
            "note": "every mode ran on device_kv_bytes = device_kv_fraction x workload_kv_bytes "
                    "except resident, the exactness reference and compute model, which ran on "
                    "reference_device_kv_bytes (the whole workload fits)"}


def run(args: argparse.Namespace) -> int:
    if args.workload != "single" and (args.sweep or args.sweep_residency or args.ladder
                                         or args.trace):
        raise ValueError(f"--workload {args.workload} runs on its own: use it without --sweep, "
                         "--sweep-residency, --ladder and --trace")
    if args.sweep and (args.sweep_residency or args.device_kv_fraction is not None):
        raise ValueError("--sweep sets its own workloads: use it without --sweep-residency "
                         "and --device-kv-fraction")
    if args.sweep_residency and args.device_kv_fraction is not None:
        raise ValueError("--sweep-residency sets the fraction itself: use --fractions")
    apply_preset(args)
    workload = resolve_workload(args)
    s = settings_from(args)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if args.ladder:
        from specstream.bench.ladder import run_ladder

        report = {
            "command": "specstream bench " + " ".join(command_args(args)),
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
            "workload": {"context_len": args.context_len, "num_requests": args.num_requests,
                         "output_len": args.output_len},
            "settings": {**{k: v for k, v in vars(s).items() if k != "extra"}, **s.extra},
            **run_ladder(s, workload),
        }
    elif args.workload == "multiturn":
        from specstream.bench.multiturn import run_multiturn_bench

        report = run_multiturn_bench(args, s, modes)
    elif args.workload.startswith("shared"):
        report = {"command": "specstream bench " + " ".join(command_args(args)),
                  **run_shared_bench(args, s, modes)}
        print(format_rows([r for m in report["modes"].values() for r in m.values()],
                          SHARED_COLUMNS))
    elif args.sweep:
        from specstream.bench.sweep import run_sweep

        report = run_sweep(s, args, modes)
    elif args.sweep_residency:
        from specstream.bench.residency import run_residency_sweep

        fractions = tuple(float(f) for f in args.fractions.split(",") if f.strip())
        png = Path(args.json).with_suffix(".png") if args.json else Path("bench-residency.png")
        report = {
            "command": "specstream bench " + " ".join(command_args(args)),
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
            **run_residency_sweep(s, workload, modes, fractions, png),
        }
    else:
        budget = ({} if args.device_kv_fraction is None
                  else apply_fraction(s, workload, args.device_kv_fraction))
        results = run_all(workload, s, modes, trace=args.trace)
        print(format_table(results))
        r = ratios(results)
        for k, v in r.items():
            print(f"{k}: {v:.2f}")
        from specstream.bench.calibration import calibration_from

        report = {
            "command": "specstream bench " + " ".join(command_args(args)),
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
            "workload": {"workload": "single", "context_len": args.context_len,
                         "num_requests": args.num_requests, "output_len": args.output_len},
            "settings": {**{k: v for k, v in vars(s).items() if k != "extra"}, **s.extra,
                         **budget},
            "modes": results,
            "ratios": r,
            "calibration": calibration_from(results, s, workload),
        }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"[bench] wrote {args.json}")
    return 0


def command_args(args: argparse.Namespace) -> list[str]:
    out = [] if args.modes == ",".join(ALL_MODES) else ["--modes", args.modes]
    if args.workload != "single":
        out += ["--workload", args.workload] + (
            ["--own-len", str(args.own_len)] if args.workload == "shared-doc" else
            ["--turns", str(args.turns), "--message-len", str(args.message_len)])
    for k in ("context_len", "num_requests", "output_len", "link_gbps", "device_kv_bytes",
              "chunk_tokens", "staging_buffers", "wave_requests", "residency"):
        if args.sweep_residency and k in ("device_kv_bytes", "residency") or not getattr(args, k):
            continue  # the sweep sets both per point; None: the engine's
        if k == "device_kv_bytes" and args.device_kv_fraction is not None:
            k = "device_kv_fraction"  # the budget it resolves to is in the settings
        out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    for k in ("num_speculative_tokens", "speculative_topk", "speculative_num_draft_tokens",
              "host_attention"):
        if getattr(args, k) is not None:
            out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if args.host_attention_gbps:
        out += ["--host-attention-gbps", str(args.host_attention_gbps)]
    if args.speculative_policy is not None:
        out += ["--speculative-policy", args.speculative_policy]
    if args.sweep_residency:
        out += ["--sweep-residency", "--fractions", args.fractions]
    if args.preset:
        out += ["--preset", args.preset]
    if args.ladder:
        out.append("--ladder")
    if args.quick:
        out.append("--quick")
    out += [f for f, on in (("--no-prefix-caching", args.no_prefix_caching),
                            ("--no-merge-groups", args.no_merge_groups)) if on]
    return out
