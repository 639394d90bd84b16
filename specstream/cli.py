"""Command line: ``specstream {generate,bench,simulate,serve}``; ``--help`` everywhere."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from specstream.config import (
    AUTO_MAX_DEPTH,
    CPU_DEVICE_KV_BYTES,
    DEFAULT_SPECULATIVE_TOKENS,
    DEFAULT_TREE_NODES,
    DEFAULT_TREE_TOPK,
    MAX_TREE_NODES,
    MODES,
    EngineConfig,
    GiB,
)

Command = Callable[[argparse._SubParsersAction], None]  # registers one subcommand
_COMMANDS: list[Command] = []


def command(fn: Command) -> Command:
    _COMMANDS.append(fn)
    return fn


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and action.default is not argparse.SUPPRESS
                and "default" not in text.lower()):
            text += " (default: %(default)s)"
        return text


def _default(name: str) -> object:
    """EngineConfig's default for a field (engine options left unset keep it)."""
    return EngineConfig.__dataclass_fields__[name].default


def human_readable_int(text: str) -> int:
    """An integer as vLLM's flags take them: ``32768``, ``32k`` (32,000), ``25.6k`` (25,600),
    ``32K`` (32,768); k/m/g/t count in thousands, K/M/G/T in 1024s (whole numbers only)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r} (e.g. 32768, 32k, 32K)")
    number, suffix = match.groups()
    if suffix and suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: decimals go with k/m/g/t (thousands), not with K/M/G/T (1024s)")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1 if suffix else 0)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that builds an engine. Unset ones keep
    EngineConfig's defaults (named in each help), so the CLI and the Python API agree.
    vLLM's spellings are accepted where the concept exists here (each help says how it maps);
    flags named in bytes take bytes, vLLM's sizes take GiB as vLLM's do."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model folder (default: the embedded target)")
    g.add_argument("--draft-model", default=None,
                   help="draft model folder (default: the embedded draft when the embedded "
                        "target speculates with the draft proposer)")
    g.add_argument("--mode", default=None, choices=sorted(MODES),
                   help="engine mode: where KV lives and how rounds are scheduled (default: "
                        "specstream where there is a proposer, as for the embedded target, "
                        "else stream; the others are baselines and ablations)")
    g.add_argument("--proposer", default=None, choices=["draft", "ngram"],
                   help="speculation proposer (default: draft with --draft-model, or for the "
                        "embedded target in the default mode or one that speculates; else "
                        "none)")
    g.add_argument("--num-speculative-tokens", "-q", type=int, default=None,
                   help=f"draft tokens per round; with token trees, their depth (default: "
                        f"with a proposer up to {AUTO_MAX_DEPTH} under the auto policy, "
                        f"{DEFAULT_SPECULATIVE_TOKENS} under fixed; else 0)")
    g.add_argument("--speculative-topk", "--speculative-eagle-topk", type=int, default=None,
                   help="token trees: children per expanded node of the draft model's tree "
                        "(SGLang's --speculative-eagle-topk); 1 is a chain of -q drafts "
                        f"(default: the auto policy may choose trees of up to "
                        f"{DEFAULT_TREE_TOPK} children with a draft model; else 1)")
    g.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="token trees: draft tokens (nodes) per request and round, at least -q "
                        f"and at most {MAX_TREE_NODES}; unlike SGLang's flag of that name the "
                        "last accepted token is not counted (default: up to "
                        f"{DEFAULT_TREE_NODES} where the auto policy may choose trees, else -q)")
    g.add_argument("--speculative-policy", choices=["auto", "fixed"], default=None,
                   help="'fixed': every round drafts -q tokens; 'auto': the engine chooses each "
                        "round's shape (no drafts, a chain up to -q deep, or a tree within the "
                        "limits) for the most expected tokens per second from what it measures "
                        "(default: auto with a proposer, else fixed)")
    g.add_argument("--device", default="auto",
                   help="auto (CUDA when this torch sees a CUDA device, else cpu, as vLLM), "
                        "cpu, or cuda[:N]")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV dtype (auto: bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--device-kv-bytes", type=float, default=None,
                   help="device memory for KV, in bytes: resident tails and staging buffers "
                        "(default: on CUDA --gpu-memory-utilization of the memory free once the "
                        f"models are loaded, on cpu {CPU_DEVICE_KV_BYTES >> 20} MiB); 1e7 and "
                        "10000000 both work")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="without --device-kv-bytes, the share of the CUDA device's memory "
                        "free once the models are loaded that KV takes (vLLM's name; its "
                        "share is of the whole device) (default: "
                        f"{_default('gpu_memory_utilization')})")
    g.add_argument("--host-kv-bytes", type=float, default=None,
                   help=f"host memory for offloaded KV, in bytes (default: "
                        f"{_default('host_kv_bytes')}, 8 GiB)")
    g.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="vLLM's name for the host tier's size, in GiB: the same as "
                        f"--host-kv-bytes GIB x 2^30 (default: "
                        f"{EngineConfig.host_kv_bytes / GiB:g})")
    g.add_argument("--block-size", type=int, default=None,
                   help=f"tokens per KV block (default: {_default('block_size')})")
    g.add_argument("--chunk-tokens", type=int, default=None,
                   help="tokens per streamed restore chunk (default: 2048 where a staging ring "
                        "of them fits in an eighth of the device budget, else shorter, to 256)")
    g.add_argument("--staging-buffers", type=int, default=None,
                   help=f"staging slots for streamed chunk waves (default: "
                        f"{_default('staging_buffers')})")
    g.add_argument("--wave-requests", type=int, default=None,
                   help=f"requests per chunk wave: a staging slot holds one chunk of each "
                        f"(default: {_default('wave_requests')})")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default=None,
                   help="attention kernels: auto = Triton on CUDA when importable, else torch "
                        f"(default: {_default('attention_backend')})")
    g.add_argument("--resident-tail-tokens", type=int, default=None,
                   help=f"newest tokens of a request kept on the device (default: "
                        f"{_default('resident_tail_tokens')})")
    g.add_argument("--residency", choices=["fill", "tail"], default=None,
                   help="offloading modes: 'fill' keeps as much of each request's newest "
                        "history on the device as fits (equal shares) and streams the rest; "
                        "'tail' keeps only the resident tail and streams everything older "
                        f"(default: {_default('residency')})")
    g.add_argument("--host-attention", choices=["off", "auto"], default=None,
                   help="offloading modes: attend part of each request's cold history on the "
                        "host CPU beside the link, the share that finishes with it ('auto'), "
                        "or not (default: auto where the host has cores the engine's threads "
                        "leave while a round waits on the link, i.e. two cores or more)")
    g.add_argument("--host-attention-fraction", type=float, default=None,
                   help="a fixed share (0-1) of each request's cold chunks attended on the "
                        "host instead (for ablations)")
    g.add_argument("--host-attention-gbps", type=float, default=None,
                   help="emulated host attention rate on the cpu backend, GB/s of KV attended "
                        "(default: none, as fast as the host computes)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="automatic prefix caching (vLLM's flag): keep finished requests' KV "
                        "blocks for later prompts that start with the same tokens; "
                        "--no-enable-prefix-caching turns it off (default: on)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=None, help="the same as --no-enable-prefix-caching (default: on)")
    g.add_argument("--prefix-sharing", action=argparse.BooleanOptionalAction, default=None,
                   help="offloading modes: requests that start with the same full KV blocks "
                        "reference one copy of them, streamed once a round for all; "
                        "--no-prefix-sharing copies prefix-cache hits instead (default: on)")
    g.add_argument("--offload-after-tokens", type=int, default=None,
                   help="a request's history moves to the host past this many tokens "
                        "(default: a quarter of the model's context, at most 8192)")
    g.add_argument("--link-gbps", type=float, default=None,
                   help="emulated host-device link bandwidth on the cpu backend, GB/s "
                        "(default: none, copies at memory speed)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"requests decoded at once (default: {_default('max_num_seqs')})")
    g.add_argument("--max-model-len", type=human_readable_int, default=None,
                   help="longest prompt + output of a request, in tokens (32k = 32000, 32K = "
                        "32768, as vLLM); at most the model's (default: the model's context)")
    g.add_argument("--max-prefill-tokens", type=int, default=None,
                   help=f"prompt tokens one step may prefill (default: "
                        f"{_default('max_prefill_tokens')})")
    g.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None,
                   help="vLLM's tokens per step, mapped to its nearest concept here, "
                        "--max-prefill-tokens: the prompt tokens a step may prefill; the step's "
                        "decode tokens (up to --max-num-seqs x (q + 1)) come on top of it, "
                        "where vLLM counts them in (default: as --max-prefill-tokens)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="ranks the target is sharded over, one process each, started by the "
                        "engine (vLLM's flag; on cpu the ranks share the machine's cores) "
                        f"(default: {_default('tensor_parallel_size')})")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of the engine's generator, which requests without their own "
                        "seed sample from (generate: the request's own generator too) "
                        f"(default: {_default('seed')})")
    g.add_argument("--draft-cache", choices=["window", "full"], default=None,
                   help="draft KV policy: attention sinks + recent window, or every token "
                        f"(default: {_default('draft_cache')})")


# vLLM's flags that name an EngineConfig field under another name or unit:
# (dest, flag, its field, the field's own flag, value -> field value)
VLLM_ALIASES: tuple[tuple[str, str, str, str, Callable[[Any], Any]], ...] = (
    ("kv_offloading_size", "--kv-offloading-size", "host_kv_bytes", "--host-kv-bytes",
     lambda gib: int(gib * GiB)),
    ("max_num_batched_tokens", "--max-num-batched-tokens", "max_prefill_tokens",
     "--max-prefill-tokens", int),
)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments from parsed engine options (unset ones keep defaults).

    Raises ValueError where a vLLM-named flag and the flag it stands for disagree.
    """
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    kw = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    for k in ("device_kv_bytes", "host_kv_bytes"):
        if k in kw:
            kw[k] = int(kw[k])
    for dest, flag, field, own_flag, convert in VLLM_ALIASES:
        given = getattr(args, dest, None)
        if given is None:
            continue
        value = convert(given)
        if field in kw and kw[field] != value:
            raise ValueError(f"{flag} {given:g} is {field}={value} but {own_flag} says "
                             f"{kw[field]}; give one of them")
        kw[field] = value
    kw.pop("draft_model", None)
    return kw


def build_llm(args: argparse.Namespace, trace: bool = False):  # -> LLM
    """The LLM the engine options describe; the embedded pair fills in what is not given
    (see :class:`specstream.llm.LLM`)."""
    from specstream.llm import LLM

    return LLM(model=args.model, draft_model=args.draft_model, trace=trace,
               **engine_kwargs(args))


@command
def _generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for a prompt",
                       description="Generate text for one prompt; progress on stderr, then the "
                                   "text on stdout and a summary of what the engine did "
                                   "(rounds, accepted length, link bytes, KV peaks) on stderr.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (default: none; this or --prompt-file)")
    src.add_argument("--prompt-file",
                     help="file whose whole text is the prompt (default: none)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 is off")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely; 0 is off")
    p.add_argument("--stop", action="append", default=None,
                   help="stop string, repeatable (default: none)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON record (text, token ids, metrics) instead of text")
    p.add_argument("--trace", default=None,
                   help="write a Chrome trace JSON of every round and a .png timeline "
                        "(default: none)")
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from specstream.sampling_params import SamplingParams
    from specstream.summary import generation_summary

    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    else:
        prompt = args.prompt
    # --seed seeds the engine and, as before, the request's own generator
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens, stop=args.stop)
    llm = build_llm(args, trace=args.trace is not None)
    try:
        t0 = time.perf_counter()
        out = _generate_with_progress(llm, prompt, params, show=not args.json)
        wall = time.perf_counter() - t0
        metrics = llm.get_metrics()
        if args.trace:
            from pathlib import Path

            llm.engine.tracer.to_chrome(args.trace)
            llm.engine.tracer.to_png(Path(args.trace).with_suffix(".png"))
        summary = generation_summary(llm, out, metrics, wall)
    finally:
        llm.close()
    comp = out.outputs[0]
    if args.json:
        print(json.dumps({"text": comp.text, "token_ids": comp.token_ids,
                          "finish_reason": comp.finish_reason, "error": comp.error,
                          "wall_s": wall, "metrics": metrics}))
    else:
        print(comp.text)
        print(summary, file=sys.stderr)
    return 0 if comp.finish_reason != "error" else 1


def _generate_with_progress(llm: Any, prompt: str, params: Any, show: bool) -> Any:
    """One request, stepped here so a long prefill shows its progress (prompt tokens whose KV
    is cached), then the decode (tokens generated)."""
    from tqdm.auto import tqdm

    ids = llm.encode(prompt)
    engine = llm.engine
    rid = engine.add_request(ids, params)
    last = None
    bar = tqdm(total=len(ids), desc="prefill", unit="tok", disable=not show, leave=False,
               file=sys.stderr)
    decoding = False
    with bar:
        while last is None or not last.finished:
            for o in engine.step():
                if o.request_id == rid:
                    last = o
            if last is None:
                continue
            generated = len(last.outputs[0].token_ids)
            if not decoding and generated:
                decoding = True
                bar.reset(total=params.max_tokens)
                bar.set_description("decode")
            bar.update((generated if decoding else min(last.num_computed_tokens, len(ids)))
                       - bar.n)
    return last


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
    for p in sub.choices.values():
        p.formatter_class = HelpFormatter
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"specstream: error: {exc}", file=sys.stderr)
        return 2
