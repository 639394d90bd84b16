"""Command line: ``specstream {generate,bench,simulate,serve}``; ``--help`` everywhere."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence

from specstream.config import MODES, EngineConfig

Command = Callable[[argparse._SubParsersAction], None]  # registers one subcommand
_COMMANDS: list[Command] = []


def command(fn: Command) -> Command:
    _COMMANDS.append(fn)
    return fn


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that builds an engine."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF model folder (default: embedded target)")
    g.add_argument("--draft-model", default=None,
                   help="draft model folder (default with --proposer draft: embedded draft)")
    g.add_argument("--mode", default="resident", choices=sorted(MODES), help="engine mode")
    g.add_argument("--proposer", default=None, choices=["draft", "ngram"],
                   help="speculation proposer (default: draft when a draft model is set)")
    g.add_argument("--num-speculative-tokens", "-q", type=int, default=None,
                   help="draft tokens per round (default 4 with a proposer)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device-kv-bytes", type=float, default=None, help="device KV budget")
    g.add_argument("--host-kv-bytes", type=float, default=None, help="host KV capacity")
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--chunk-tokens", type=int, default=None)
    g.add_argument("--staging-buffers", type=int, default=None)
    g.add_argument("--resident-tail-tokens", type=int, default=None)
    g.add_argument("--offload-after-tokens", type=int, default=None)
    g.add_argument("--link-gbps", type=float, default=None,
                   help="emulated link bandwidth on the cpu backend (GB/s)")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-prefill-tokens", type=int, default=None)
    g.add_argument("--draft-cache", choices=["window", "full"], default=None)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments from parsed engine options (unset ones keep defaults)."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    kw = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    for k in ("device_kv_bytes", "host_kv_bytes"):
        if k in kw:
            kw[k] = int(kw[k])
    if args.proposer is None and (args.draft_model or args.num_speculative_tokens):
        kw["proposer"] = "draft"
    if kw.get("proposer") and "num_speculative_tokens" not in kw:
        kw["num_speculative_tokens"] = 4
    kw.pop("draft_model", None)
    return kw


def build_llm(args: argparse.Namespace, trace: bool = False):  # -> LLM
    from specstream.llm import LLM, default_model_dir

    kw = engine_kwargs(args)
    draft = args.draft_model
    if draft is None and kw.get("proposer") == "draft":
        draft = str(default_model_dir("draft"))
    return LLM(model=args.model, draft_model=draft, trace=trace, **kw)


@command
def _generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for a prompt",
                       description="Generate text for one prompt (or one per line of a file).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file whose whole text is the prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print a JSON record instead of text")
    p.add_argument("--trace", default=None,
                   help="write a Chrome trace JSON of every round (and a .png timeline)")
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from specstream.sampling_params import SamplingParams

    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    else:
        prompt = args.prompt
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens, stop=args.stop)
    llm = build_llm(args, trace=args.trace is not None)
    try:
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        metrics = llm.get_metrics()
        if args.trace:
            from pathlib import Path

            llm.engine.tracer.to_chrome(args.trace)
            llm.engine.tracer.to_png(Path(args.trace).with_suffix(".png"))
    finally:
        llm.close()
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids,
                          "finish_reason": out.finish_reason, "metrics": metrics}))
    else:
        print(out.text)
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, "
              f"mode={metrics['mode']}, mean_accepted_len={metrics['mean_accepted_len']:.2f}]",
              file=sys.stderr)
    return 0


def _optional_commands(sub: argparse._SubParsersAction) -> None:
    """Subcommands that live in their own packages."""
    from specstream.bench.cli import add_parser as add_bench
    from specstream.server.cli import add_parser as add_serve
    from specstream.sim.cli import add_parser as add_simulate

    add_bench(sub)
    add_simulate(sub)
    add_serve(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specstream",
        description="Long-context LLM serving: KV offloading + streamed attention + "
                    "speculative decoding.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for register in _COMMANDS:
        register(sub)
    _optional_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"specstream: error: {exc}", file=sys.stderr)
        return 2
