"""``specstream simulate``: argparse wiring (``add_parser``) and the handler (``run``)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace

from specstream.sim.api import Scenario, simulate, sweep_contexts
from specstream.sim.costs import RooflineCosts
from specstream.sim.hardware import HARDWARE, HOST_ISAS, get_hardware
from specstream.sim.host import HOST_ATTENTION
from specstream.sim.model_profile import MODELS, get_model
from specstream.sim.policy import MODES, OFFLOAD_MODES, RESIDENCIES, SimPolicy
from specstream.sim.report import describe, residency_table, results_table, verdict
from specstream.sim.tensor_parallel import with_tp
from specstream.sim.workload import AcceptanceModel

HELP = "predict every mode's throughput, latency and memory fit at datacenter scale"
EPILOG = """examples:
  specstream simulate --hardware H200 --pcie 5 --target Qwen3-8B --draft Qwen3-0.6B \\
      --context 32768 --concurrency 16 --alpha 0.75
  specstream simulate --hardware A800 --target InternLM2.5-7B --draft InternLM2.5-1.8B \\
      --context 8192:0.5,32768:0.5 --arrival-rate 0.2 --plot-timeline round.png
  specstream simulate --calibrate bench.json        # predicted vs measured, per mode
  specstream simulate --paper-table                 # the table of docs/simulator.md
  specstream simulate --context 32768 --concurrency 32 --compare-residency   # fill vs tail
  specstream simulate --hardware A100-80GB --target Qwen3-8B --concurrency 32 --ladder
  specstream simulate --ladder-table                # the ablation ladder of docs/simulator.md
  specstream simulate --host-attention auto --gpus-per-host 4 --host-isa amx
  specstream simulate --host-attention-table        # host attention, 1-8 GPUs per host
  specstream simulate --kv-dtype fp8 --link-copy-us 5  # levers: KV dtype, per-copy link cost
"""
KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def _ints(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``simulate`` on an argparse subparsers object; sets ``func=run``."""
    p = subparsers.add_parser("simulate", help=HELP, description=HELP + ".", epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    hw = p.add_argument_group("hardware (datasheet defaults; override with measured values)")
    hw.add_argument("--hardware", default="H200",
                    help=f"one of {', '.join(h.name for h in HARDWARE.values())}")
    hw.add_argument("--pcie", type=int, choices=(3, 4, 5, 6),
                    help="PCIe generation of the x16 link")
    hw.add_argument("--link-gbps", type=float, help="effective H2D link bandwidth, GB/s")
    hw.add_argument("--device-mem-gb", type=float, help="device memory, GB")
    hw.add_argument("--hbm-tbps", type=float, help="HBM bandwidth, TB/s")
    hw.add_argument("--tflops", type=float, help="dense bf16 matrix throughput, TFLOP/s")
    hw.add_argument("--layer-overhead-us", type=float,
                    help="fixed cost per layer per forward, microseconds (default 10)")
    hw.add_argument("--link-copy-us", type=float,
                    help="fixed cost per DMA copy on the link, microseconds: per request per "
                    "layer when restoring, per request per chunk per layer when streaming "
                    "(default 0)")
    hw.add_argument("--host-gbps", type=float,
                    help="host memory bandwidth, GB/s, shared by --gpus-per-host GPUs "
                    "(default 430 on the PCIe 5 machines, 300 on the PCIe 4 ones)")
    hw.add_argument("--host-isa", choices=HOST_ISAS,
                    help="host attention kernel: avx512 (default) or amx")
    hw.add_argument("--gpus-per-host", type=int,
                    help="GPUs offloading through one host; they share its memory bandwidth "
                    "and cores (default 1)")
    hw.add_argument("--allreduce-gbps", type=float,
                    help="all-reduce bus bandwidth between a TP group's GPUs, GB/s (default: "
                    "NVLink's on SXM parts, PCIe's otherwise; sim/tensor_parallel.py)")
    m = p.add_argument_group("models (built-in name or path to an HF config.json / checkpoint)")
    m.add_argument("--target", default="Qwen3-8B", help=f"built-ins: {', '.join(MODELS)}")
    m.add_argument("--draft", default="Qwen3-0.6B", help="draft model: a built-in name or a path")
    m.add_argument("--kv-dtype", choices=tuple(KV_DTYPE_BYTES),
                   help="dtype of the KV cache, if not the weights' (fp8 halves KV bytes per "
                   "token: device memory, attention reads and link bytes)")
    w = p.add_argument_group("workload and acceptance")
    w.add_argument("--context", default="32768",
                   help="prompt lengths: 32768, a list 8192,32768, or weighted 8192:0.3,32768:0.7")
    w.add_argument("--output-len", type=int, default=512, help="output tokens per request")
    w.add_argument("--concurrency", type=int, default=16, help="max requests in flight")
    w.add_argument("--arrival-rate", type=float, help="Poisson arrivals, requests/s")
    w.add_argument("--num-requests", type=int, help="default: 2 x concurrency (64 if open loop)")
    w.add_argument("--seed", type=int, default=0, help="seed of the simulated workload")
    w.add_argument("--alpha", type=float, default=0.75, help="per-token acceptance rate")
    w.add_argument("--accepted-counts", help="measured histogram n0,n1,..,nq (rounds with k "
                                             "drafts accepted); overrides --alpha")
    e = p.add_argument_group("engine policy")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs per replica: the target's heads and KV heads split across them, "
                   "each streaming its KV shard over its own link (the draft replicated)")
    e.add_argument("--q", default="auto", help="drafts per round, or 'auto' (best of 1,2,4,6,8)")
    e.add_argument("--chunk-tokens", type=int, default=2048, help="tokens per streamed chunk")
    e.add_argument("--staging-buffers", type=int, default=2,
                   help="device staging buffers for streamed chunks")
    e.add_argument("--resident-tail", type=int, default=512,
                   help="newest tokens of a request kept on the device")
    e.add_argument("--offload-threshold", type=int, default=8192,
                   help="tail residency: history moves to the host past this many tokens")
    e.add_argument("--residency", choices=RESIDENCIES, default="fill",
                   help="offload modes: 'fill' keeps the newest history of every running "
                   "request in the device memory left over (water-filled shares, at least the "
                   "tail) and streams only the rest; 'tail' keeps only the resident tail (the "
                   "paper's configuration) (default: fill)")
    e.add_argument("--host-attention", choices=HOST_ATTENTION, default="off",
                   help="streamed modes: 'auto' has the host CPU attend the share of the cold "
                   "history that makes host and link finish together, where it pays "
                   "(default: off)")
    e.add_argument("--draft-window", default="4096", help="draft KV tokens kept, or 'all'")
    e.add_argument("--corun-slowdown", type=float, default=0.05,
                   help="fraction of a round the co-running draft may cost the target")
    o = p.add_argument_group("output")
    o.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    o.add_argument("--sweep", help="context lengths for the sweep plot, e.g. 8192,16384,32768")
    o.add_argument("--plot-sweep", metavar="PNG", help="throughput per mode vs context")
    o.add_argument("--plot-timeline", metavar="PNG", help="one simulated round per mode")
    o.add_argument("--json", metavar="PATH", help="write results as JSON")
    o.add_argument("--calibrate", metavar="BENCH_JSON",
                   help="predict the modes of a `specstream bench` JSON; print vs measured")
    o.add_argument("--calibration-model", choices=("auto", "replay", "pipeline"),
                   default="auto",
                   help="with --calibrate: replay the engine's steps (needs per-step samples; "
                   "auto = when present) or run the steady-state round pipeline")
    o.add_argument("--costs-from", metavar="BENCH_JSON",
                   help="with --calibrate (replay): cost the steps with another run's "
                   "measurements (out-of-sample check)")
    o.add_argument("--max-error", type=float,
                   help="with --calibrate: exit 1 if any |relative error| exceeds this")
    o.add_argument("--paper-table", action="store_true",
                   help="print the paper-settings table of docs/simulator.md")
    o.add_argument("--ladder", action="store_true",
                   help="the README's ablation ladder (offload-spec q=4 -> + streaming -> + gap "
                   "drafting -> + adaptive chain -> + trees) on this scenario's longest "
                   "context at --concurrency (capped by every step's memory)")
    o.add_argument("--ladder-table", action="store_true",
                   help="the ladder for H200/A100 x Qwen3-8B/32B, InternLM2.5-7B at 32K "
                   "(the table of docs/simulator.md)")
    o.add_argument("--host-attention-table", action="store_true",
                   help="H200 + Qwen3-8B at 32K with 1/2/4/8 GPUs per host, chains vs trees, "
                   "host attention off vs auto (the table of docs/simulator.md); --host-isa "
                   "applies")
    o.add_argument("--tp-table", action="store_true",
                   help="TP 1 / 2 / 4 for Qwen3-32B and Qwen3-8B on H200s and the reference's "
                   "Qwen3-32B + Qwen3-0.6B on two A800s (the table of docs/simulator.md)")
    o.add_argument("--sharing-table", action="store_true",
                   help="H200 + Qwen3-8B, 32 requests over one shared 32K document (+512 own "
                   "tokens each): every offloading mode with prefix sharing off and on (the "
                   "table of docs/simulator.md)")
    o.add_argument("--compare-residency", action="store_true",
                   help="simulate the scenario with both residencies; print link bytes per "
                   "round and throughput per mode, tail against fill")
    p.set_defaults(func=run)
    return p


def _scenario(args: argparse.Namespace) -> Scenario:
    gb, tb = 1e9, 1e12
    scale = {"link_bytes_per_s": (args.link_gbps, gb), "device_memory_bytes":
             (args.device_mem_gb, gb), "hbm_bytes_per_s": (args.hbm_tbps, tb),
             "matrix_flops": (args.tflops, tb), "layer_overhead_s": (args.layer_overhead_us,
                                                                      1e-6),
             "link_copy_s": (args.link_copy_us, 1e-6)}
    scale["host_bytes_per_s"] = (args.host_gbps, gb)
    hardware = get_hardware(args.hardware, args.pcie, host_isa=args.host_isa,
                            gpus_per_host=args.gpus_per_host,
                            **{k: v * s for k, (v, s) in scale.items() if v is not None})
    pairs = [x.split(":") for x in args.context.split(",") if x]
    contexts = tuple(int(float(x[0])) for x in pairs)
    weights = tuple(float(x[1]) for x in pairs) if all(len(x) == 2 for x in pairs) else None
    policy = SimPolicy(
        q=None if args.q == "auto" else int(args.q), chunk_tokens=args.chunk_tokens,
        staging_buffers=args.staging_buffers, resident_tail=args.resident_tail,
        offload_threshold=args.offload_threshold, corun_slowdown=args.corun_slowdown,
        residency=args.residency, host_attention=args.host_attention,
        draft_window=None if args.draft_window == "all" else int(args.draft_window))
    sc = Scenario.from_names(hardware, get_model(args.target), get_model(args.draft), contexts,
                             args.concurrency, args.alpha, args.output_len, policy=policy,
                             arrival_rate=args.arrival_rate, num_requests=args.num_requests,
                             weights=weights, seed=args.seed)
    if args.kv_dtype:
        sc = replace(sc, costs=replace(sc.costs, kv_dtype_bytes=KV_DTYPE_BYTES[args.kv_dtype]))
    if args.tensor_parallel_size != 1:
        assert isinstance(sc.costs, RooflineCosts)
        sc = replace(sc, costs=with_tp(sc.costs, args.tensor_parallel_size,
                                       (args.allreduce_gbps or 0.0) * gb),
                     label=f"{sc.label} TP{args.tensor_parallel_size}")
    if args.accepted_counts:
        counts = tuple(_ints(args.accepted_counts))
        acc = AcceptanceModel(accepted_counts=counts, measured_q=len(counts) - 1)
        sc = Scenario(sc.costs, sc.workload, acc, policy, sc.label, hardware, sc.target, sc.draft)
    return sc


def _calibrate(args: argparse.Namespace) -> int:
    from specstream.sim.calibrate import (
        comparison_table,
        predict,
        relative_errors,
        validation_table,
    )
    from specstream.sim.shared_replay import is_shared_bench

    with open(args.calibrate) as f:
        if is_shared_bench(json.load(f)):
            return _calibrate_shared(args)
    scenario, results, measured = predict(args.calibrate, args.calibration_model)
    print(describe(scenario))
    costs = scenario.costs
    print(f"  link {costs.link_bw / 1e9:.2f} GB/s, device budget "
          f"{costs.device_budget_bytes / 1e9:.2f} GB")
    if results and results[0].round is None:  # the engine replay
        _describe_replay(args.calibrate, args.costs_from)
    else:
        for name, fit in zip(("verify", "draft step"), getattr(costs, "forward", ()),
                             strict=False):
            print(f"  fitted {name} time: {fit}")
    print()
    if args.costs_from and results and results[0].round is None:
        table, worst = validation_table(args.calibrate, args.costs_from)
        print("IN SAMPLE: step costs fitted on the run predicted (checks the schedule); OUT OF "
              f"SAMPLE: step costs fitted on {args.costs_from} (checks the costs too); the "
              "workload, link rate and acceptance are always the predicted run's.\n")
        print(table)
        errors = {k: v for k, v in worst.items() if k.endswith("tok/s")}
    else:
        print(comparison_table(results, measured))
        errors = relative_errors(results, measured)
    if args.max_error is not None and any(abs(e) > args.max_error for e in errors.values()):
        print(f"\nFAIL: a throughput error exceeds {args.max_error:.0%}", file=sys.stderr)
        return 1
    return 0


def _calibrate_shared(args: argparse.Namespace) -> int:
    """A shared-doc bench (every offloading mode, sharing off and on): the step replay of each
    run (``sim/shared_replay.py``) against what it measured."""
    from specstream.sim.shared_replay import shared_predictions, shared_table

    data, predicted = shared_predictions(args.calibrate, args.costs_from)
    w = data["workload"]
    print(f"{args.calibrate}: {w['num_requests']} requests over one {w['doc_len']}-token "
          f"document, {w['own_len']} own tokens each, {w['output_len']} output tokens; the "
          "engine's Scheduler with a fake worker, step compute fitted on "
          f"{args.costs_from or args.calibrate}, host attention costs on each run's own steps\n")
    table, errors = shared_table(data, predicted)
    print(table)
    if args.max_error is not None and any(abs(e) > args.max_error for e in errors.values()):
        print(f"\nFAIL: a throughput error exceeds {args.max_error:.0%}", file=sys.stderr)
        return 1
    return 0


def _describe_replay(path: str, costs_from: str | None) -> None:
    """How the replay ran each mode: admitted, steps, the fitted step costs."""
    from specstream.sim.replay import replay_mean, setups

    with open(path) as f:
        data = json.load(f)
    own = setups(data)
    fitted = own
    if costs_from:
        with open(costs_from) as f:
            fitted = setups(data, json.load(f))
    print("  prediction: the bench workload through the engine's own Scheduler "
          "(specstream/sim/replay.py) with a fake worker; step compute fitted on "
          f"{path} (in sample)" + (f" and on {costs_from} (out of sample)" if costs_from else "")
          + "; link wait from the step's bytes (step_cost.py):")
    for mode, s in own.items():
        run = replay_mean(s, 4)
        print(f"    {mode}: {run.result.admitted} admitted, {run.steps['decode']} decode + "
              f"{run.steps['mixed']} mixed + {run.steps['prefill-only']} prefill-only steps; "
              f"acceptance {s.acceptance.position_rates(1)[0]:.3f}/token")
        print(f"      in sample: {s.cost.describe()}")
        if costs_from and mode in fitted:
            print(f"      out of sample: {fitted[mode].cost.describe()}")


def _compare_residency(sc: Scenario, modes: list[str]) -> int:
    offloading = [m for m in modes if m in OFFLOAD_MODES]
    if not offloading:
        print("--compare-residency: none of the modes offloads", file=sys.stderr)
        return 2
    tail, fill = (simulate(replace(sc, policy=replace(sc.policy, residency=r)), offloading)
                  for r in ("tail", "fill"))
    print(describe(sc), "\n")
    print(residency_table(tail, fill))
    return 0


def run(args: argparse.Namespace) -> int:
    """Handler of ``specstream simulate``; returns the exit status."""
    if args.calibrate:
        return _calibrate(args)
    if args.paper_table:
        from specstream.sim.paper import paper_table

        print(paper_table())
        return 0
    if args.ladder_table:
        from specstream.sim.ladder import ladder_grid

        print(ladder_grid())
        return 0
    if args.tp_table:
        from specstream.sim.tensor_parallel import tp_table

        print(tp_table())
        return 0
    if args.sharing_table:
        from specstream.sim.sharing_table import sharing_table

        print(sharing_table())
        return 0
    if args.host_attention_table:
        from specstream.sim.host_table import host_table

        print(host_table(args.host_isa or "avx512"))
        return 0
    sc = _scenario(args)
    modes = [x for x in args.modes.split(",") if x]
    if args.ladder:
        from specstream.sim.ladder import ladder, ladder_concurrency, ladder_table

        n = ladder_concurrency(sc, args.concurrency)
        print(describe(sc), "\n")
        print(f"ladder: {n} requests of {max(sc.workload.context_lengths)} tokens "
              f"(asked {args.concurrency}); roofline, untested on a GPU\n")
        print(ladder_table(ladder(sc, args.alpha, n)))
        return 0
    if args.compare_residency:
        return _compare_residency(sc, modes)
    results = simulate(sc, modes)
    print(describe(sc), "\n")
    print(results_table(results), "\n")
    print(verdict(sc, results))
    if args.json:
        rows = [{f.name: getattr(r, f.name) for f in fields(r) if f.name != "round"}
                | {"throughput_per_gpu": r.throughput_per_gpu,
                   "link_bytes_per_round": r.round.link_bytes if r.round else None}
                for r in results]
        with open(args.json, "w") as f:
            json.dump({"scenario": sc.label, "residency": sc.policy.residency,
                       "results": rows}, f, indent=1)
    if args.plot_timeline:
        from specstream.sim.plots import plot_timeline

        rounds = [r.round for r in results if r.round is not None]
        print("timeline:", plot_timeline(rounds, args.plot_timeline, sc.label))
    if args.plot_sweep:
        from specstream.sim.plots import plot_sweep

        ctxs = _ints(args.sweep or "8192,16384,32768,65536")
        print("sweep:", plot_sweep(ctxs, sweep_contexts(sc, ctxs, modes), args.plot_sweep,
                                   sc.label))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m specstream.sim``."""
    parser = argparse.ArgumentParser(prog="specstream")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["simulate", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))
