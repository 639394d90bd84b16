"""``specstream serve``: the OpenAI-compatible server on uvicorn.

vLLM's spellings work: ``specstream serve MODEL_DIR`` (or ``--model``), ``--chat-template``,
``--generation-config auto|vllm|DIR`` (sampling defaults from the model's
generation_config.json), ``--enable-prompt-tokens-details``, and speculation as the engine
flags (``--proposer``, ``--draft-model``, ``-q``) or vLLM's ``--speculative-config '{"method":
..., "model": ..., "num_speculative_tokens": ...}'``, which :func:`apply_speculative_config`
maps onto those flags (a mismatch is an error). vLLM's other keys for ``draft_model`` and
``ngram`` are accepted where they change nothing here and refused, saying why, where this
engine cannot honour them. Token trees take the engine flags ``--speculative-topk`` (alias
SGLang's ``--speculative-eagle-topk``) and ``--speculative-num-draft-tokens``.
"""

from __future__ import annotations

import argparse
import codecs
import copy
import ipaddress
import json
import sys
from pathlib import Path
from typing import Any

from specstream.cli import add_engine_args, build_llm
from specstream.server.ray_serve import add_ray_args

# vLLM's speculative methods this engine has, by the proposer that implements them
SPEC_METHODS = {"draft_model": "draft", "draft": "draft", "ngram": "ngram"}
SPEC_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max",
             "prompt_lookup_min")
# vLLM's other SpeculativeConfig keys, accepted at the values where they change nothing here
SPEC_NOOP: dict[str, tuple[Any, ...]] = {
    "draft_tensor_parallel_size": (None, 1),  # one device
    "tensor_parallel_size": (None, 1),
    "max_model_len": (None,),  # the draft keeps a window of its own (--draft-cache)
    "disable_by_batch_size": (None,),  # --speculative-policy auto decides per round
    "quantization": (None,),
    "revision": (None,),  # local folders only
    "code_revision": (None,),
    "enforce_eager": (None, True, False),  # always eager: no CUDA graphs here
    "disable_padded_drafter_batch": (False, True),  # EAGLE only
    "acceptance_method": (None, "rejection_sampler"),  # vLLM v0's name for what is done here
    "rejection_sample_method": (None, "standard"),
}
# generation_config.json fields vLLM takes as request defaults (max_new_tokens as max_tokens)
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``serve`` on the ``specstream`` command's subparsers."""
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions (streaming), /v1/models, "
                    "/tokenize, /detokenize, /tokenizer_info, /version, /health and /metrics "
                    "over HTTP. Binds to loopback unless --host says otherwise.")
    p.add_argument("model_dir", nargs="?", default=None, metavar="MODEL",
                   help="HF model folder, as `vllm serve MODEL` takes it (the same as --model; "
                        "default: the embedded target)")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (else 401)")
    s.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: the model folder's name)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="larger request bodies get 413 (default 1 MiB)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait for admission at once; more get 429")
    s.add_argument("--queue-timeout", type=float, default=60.0,
                   help="seconds a request may wait for admission before a 503")
    s.add_argument("--max-n", type=int, default=16, help="largest n (choices per prompt)")
    s.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="chat template (a Jinja file, or the template itself) instead of the "
                        "tokenizer's (default: the tokenizer's)")
    s.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="request defaults for temperature, top_p, top_k, min_p, "
                        "repetition_penalty and max_tokens (max_new_tokens) where a request "
                        "sets none, from generation_config.json: 'auto' reads the model "
                        "folder's, DIR that folder's, 'vllm' none (vLLM's defaults)")
    s.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (prompt tokens "
                        "found in the prefix cache), as vLLM's flag of that name")
    s.add_argument("--speculative-config", type=speculative_config, default=None,
                   metavar="JSON",
                   help="vLLM-style speculation settings, e.g. '{\"method\": \"draft_model\", "
                        "\"model\": DIR, \"num_speculative_tokens\": 4}' (methods: "
                        "draft_model or draft, ngram); the same as --proposer, --draft-model "
                        "and -q, which it must not contradict (default: none, those "
                        "flags decide)")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    add_engine_args(p)
    add_ray_args(p)
    p.set_defaults(func=run_serve)


def speculative_config(text: str) -> dict[str, Any]:
    """``--speculative-config`` (vLLM's JSON) as the engine flags it stands for:
    ``{"proposer", "draft_model", "num_speculative_tokens"}``, None where it says nothing."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(cfg, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    unknown = sorted(set(cfg) - set(SPEC_KEYS) - set(SPEC_NOOP))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown key(s) {', '.join(map(repr, unknown))}; this server takes "
            f"{', '.join(SPEC_KEYS + tuple(SPEC_NOOP))}")
    for key, accepted in SPEC_NOOP.items():
        if key in cfg and not any(cfg[key] == a and type(cfg[key]) is type(a)
                                  for a in accepted):
            raise argparse.ArgumentTypeError(
                f"{key} {json.dumps(cfg[key])} cannot be honoured by this engine; it takes "
                f"{' or '.join(json.dumps(a) for a in accepted)}")
    model, q = cfg.get("model"), cfg.get("num_speculative_tokens")
    method = cfg.get("method", "draft_model" if model is not None else None)
    if method is None:
        raise argparse.ArgumentTypeError('give "method" (draft_model or ngram) or a draft "model"')
    if not isinstance(method, str) or method not in SPEC_METHODS:
        raise argparse.ArgumentTypeError(
            f"unknown method {method!r}; this server has {', '.join(SPEC_METHODS)}")
    proposer = SPEC_METHODS[method]
    if model is not None and (not isinstance(model, str) or not model):
        raise argparse.ArgumentTypeError(f'"model" must be a folder name, got {model!r}')
    if model is not None and proposer == "ngram":
        raise argparse.ArgumentTypeError('method "ngram" takes no "model"')
    if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
        raise argparse.ArgumentTypeError(
            f'"num_speculative_tokens" must be an integer >= 1, got {q!r}')
    if proposer == "ngram":  # vLLM ignores the lookup sizes for other methods
        _check_lookup(cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max"))
    return {"proposer": proposer, "draft_model": model, "num_speculative_tokens": q}


def _check_lookup(low: Any, high: Any) -> None:
    """The n-gram proposer's match sizes are fixed (the longest suffix of ``min_n`` to
    ``max_n`` tokens that occurred before): only those values can be honoured."""
    from specstream.spec.ngram import NgramProposer

    fixed = NgramProposer()
    for key, value, want in (("prompt_lookup_min", low, fixed.min_n),
                             ("prompt_lookup_max", high, fixed.max_n)):
        if value is not None and (isinstance(value, bool) or value != want):
            raise argparse.ArgumentTypeError(
                f"{key} {json.dumps(value)} cannot be honoured: this engine's n-gram proposer "
                f"drafts from the longest earlier match of the last {fixed.min_n} to "
                f"{fixed.max_n} tokens (prompt_lookup_min {fixed.min_n}, prompt_lookup_max "
                f"{fixed.max_n}); leave it out or give {want}")


def apply_speculative_config(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``--speculative-config`` moved onto the engine flags it stands for (and
    the positional MODEL onto ``--model``).

    Raises ValueError (``specstream`` exits with 2) where a flag given as well says otherwise.
    """
    args = merge_model_arg(args)
    spec = getattr(args, "speculative_config", None)
    if spec is None:
        return args
    out = copy.copy(args)
    out.speculative_config = None
    flags = {"proposer": "--proposer", "draft_model": "--draft-model",
             "num_speculative_tokens": "--num-speculative-tokens/-q"}
    for key, flag in flags.items():
        value, given = spec[key], getattr(args, key)
        if value is None:
            continue
        same = given == value or (key == "draft_model" and given is not None
                                  and Path(given).resolve() == Path(value).resolve())
        if given is not None and not same:
            raise ValueError(f"--speculative-config sets {key} to {value!r} but {flag} says "
                             f"{given!r}; give one of them")
        setattr(out, key, value)
    if spec["proposer"] == "ngram" and args.draft_model is not None:
        raise ValueError("--speculative-config says method ngram but --draft-model names a "
                         "draft model; give one of them")
    return out


def merge_model_arg(args: argparse.Namespace) -> argparse.Namespace:
    """The positional MODEL as ``--model`` (an error where both are given and differ)."""
    positional = getattr(args, "model_dir", None)
    if positional is None:
        return args
    if args.model is not None and Path(args.model).resolve() != Path(positional).resolve():
        raise ValueError(f"the model is given twice: {positional!r} and --model "
                         f"{args.model!r}; give one of them")
    out = copy.copy(args)
    out.model, out.model_dir = positional, None
    return out


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template itself (as vLLM reads it: text with
    Jinja's braces or a newline is a template, its ``\\n`` escapes as typed in a shell
    decoded)."""
    if value is None:
        return None
    try:
        is_file = Path(value).is_file()
    except OSError:  # a template too long to be a file name
        is_file = False
    if is_file:
        return Path(value).read_text(encoding="utf-8")
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"--chat-template {value!r} is neither a file nor a template")
    return codecs.decode(value, "unicode_escape") if value.isascii() else value


def generation_defaults(source: str, model: str | None) -> dict[str, Any]:
    """``--generation-config``: the request defaults generation_config.json sets (vLLM's
    fields; ``max_new_tokens`` as ``max_tokens``). ``auto`` reads the model folder's (none
    there: no defaults), ``vllm`` none, anything else names a folder that must hold one."""
    from specstream.llm import default_model_dir
    from specstream.sampling_params import SamplingParams

    if source == "vllm":
        return {}
    folder = Path(source) if source != "auto" else Path(model or default_model_dir("target"))
    path = folder / "generation_config.json"
    if not path.is_file():
        if source == "auto":
            return {}
        raise ValueError(f"--generation-config {source}: no generation_config.json in that "
                         "folder (give auto, vllm or a folder that holds one)")
    cfg = json.loads(path.read_text(encoding="utf-8"))
    out = {k: cfg[k] for k in GENERATION_KEYS if cfg.get(k) is not None}
    if cfg.get("max_new_tokens") is not None:
        out["max_tokens"] = cfg["max_new_tokens"]
    try:
        SamplingParams(**out)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    return out


def run_serve(args: argparse.Namespace) -> int:
    args = apply_speculative_config(args)
    if args.ray:
        from specstream.server.ray_serve import run_ray_serve

        return run_ray_serve(args)
    import uvicorn

    from specstream.server.app import ServerConfig, build_app

    defaults = generation_defaults(args.generation_config, args.model)
    if defaults:
        print(f"specstream: request defaults from generation_config.json: {defaults} "
              "(--generation-config vllm leaves them out)", file=sys.stderr)
    config = ServerConfig(
        model_name=args.served_model_name or served_name(args.model),
        api_key=args.api_key, max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
        queue_timeout_s=args.queue_timeout, max_n=args.max_n,
        chat_template=load_chat_template(args.chat_template), default_sampling=defaults,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
    )
    if not is_loopback(args.host) and not args.api_key:
        print(f"specstream: warning: serving on {args.host} without --api-key",
              file=sys.stderr)
    llm = build_llm(args)
    try:
        app = build_app(llm, config)
        print(f"specstream: serving model {config.model_name!r} on "
              f"http://{args.host}:{args.port}/v1", file=sys.stderr)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        llm.close()
    return 0


def served_name(model: str | None) -> str:
    """The model id: the folder's name, or ``specstream-default`` for the embedded pair."""
    return Path(model).resolve().name if model else "specstream-default"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
