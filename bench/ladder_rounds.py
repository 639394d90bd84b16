"""The ladder's default against its control, alternating, with what their decode rounds did.

    PYTHONPATH=. python bench/ladder_rounds.py [--passes 2] [-- bench flags, e.g. --link-gbps 0.5]
    PYTHONPATH=. python bench/ladder_rounds.py --variant tree16:speculative_policy=fixed,\
        num_speculative_tokens=8,speculative_topk=4,speculative_num_draft_tokens=16

`specstream bench --preset link-bound --ladder` runs each step once; this runs only the
default (`specstream`, no options) and the control (`offload-spec` given the same options) in
turn, ``--passes`` times each, on the preset's workload (other `specstream bench` flags after
``--``), and prints per run the decode rounds' means: requests verified, tree nodes and tokens
emitted per request, wall / compute / draft / link-wait ms, the draft's forwards, the bytes
the host attended and the link carried. The accepted-tokens target compares the two rows'
``acc``; the rows' round shapes say why they differ. With ``--variant`` the default runs
against `specstream` variants of itself instead of the control (a Step field such as
``speculative_topk``, or any EngineConfig field), e.g. a fixed larger tree: what the shapes the
policy passes over would give."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from typing import Any

from bench.matrix_variants import parse_variant
from specstream.bench import cli
from specstream.bench.ladder import CONTROL, DEFAULT, LADDER, Step
from specstream.bench.runner import run_compared, run_reference


def summary(res: dict[str, Any]) -> str:
    rounds = [r for r in res["rounds"] if r["prefill_tokens"] == 0]
    seqs = sum(r["num_seqs"] for r in rounds) or 1

    def ms(key: str) -> float:
        return 1e3 * statistics.mean(r[key] for r in rounds) if rounds else 0.0

    def mb(key: str) -> float:
        return statistics.mean(r[key] for r in rounds) / 1e6 if rounds else 0.0

    shapes = sorted(Counter((r["num_seqs"], r["tree_nodes"]) for r in rounds).items())
    return (f"{res['output_tokens_per_s']:.1f} tok/s, decode-only "
            f"{res['decode_only_tokens_per_s']:.1f}, acc {res['mean_accepted_len']:.2f}; "
            f"{len(rounds)} decode rounds of {seqs / max(len(rounds), 1):.2f} requests, "
            f"{sum(r['tree_nodes'] for r in rounds) / seqs:.1f} nodes and "
            f"{sum(r['new_tokens'] for r in rounds) / seqs:.2f} tokens a request; wall "
            f"{ms('wall_s'):.1f} ms, compute {ms('compute_s'):.1f}, draft {ms('draft_s'):.1f}, "
            f"link wait {ms('wait_s'):.1f}; host {mb('host_bytes'):.1f} MB and link "
            f"{mb('link_bytes'):.1f} MB a round\n"
            f"    (requests, tree nodes): rounds {shapes}")


def variant_step(name: str, fields: dict[str, Any]) -> Step:
    """The default step with ``fields`` changed: Step's own fields directly, the rest as
    EngineConfig fields."""
    base = LADDER[DEFAULT]
    own = {k: v for k, v in fields.items() if k in Step.__dataclass_fields__}
    extra = {k: v for k, v in fields.items() if k not in own}
    params = {k: getattr(base, k) for k in Step.__dataclass_fields__}
    params.update(own, name=name, extra={**base.extra, **extra})
    return Step(**params)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--preset", default="link-bound")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE")
    ap.add_argument("bench_flags", nargs="*", help="after --: more `specstream bench` flags")
    args = ap.parse_args(argv)
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    bench = parser.parse_args(["bench", "--preset", args.preset, *args.bench_flags])
    cli.apply_preset(bench)
    workload = cli.resolve_workload(bench)
    settings = cli.settings_from(bench)
    steps = [LADDER[DEFAULT]]
    steps += ([variant_step(*parse_variant(v)) for v in args.variant] if args.variant
              else [LADDER[CONTROL]])
    _, ref = run_reference(workload, settings)
    for i in range(args.passes):
        for step in steps:
            res = run_compared(step.mode, workload, step.settings(settings), ref)
            print(f"[pass {i + 1}] {step.name}: {summary(res)}; outputs match "
                  f"{res['outputs_match_reference']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
