"""``specstream serve``: the OpenAI-compatible server on uvicorn.

Speculation is set with the engine flags (``--proposer``, ``--draft-model``, ``-q``) or with
vLLM's ``--speculative-config '{"method": ..., "model": ..., "num_speculative_tokens": ...}'``,
which :func:`apply_speculative_config` maps onto those flags (a mismatch is an error). Token
trees take the engine flags ``--speculative-topk`` (alias SGLang's ``--speculative-eagle-topk``)
and ``--speculative-num-draft-tokens``.
"""

from __future__ import annotations

import argparse
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
SPEC_KEYS = ("method", "model", "num_speculative_tokens")

def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``serve`` on the ``specstream`` command's subparsers."""
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions (streaming), /v1/models, "
                    "/health and /metrics over HTTP. Binds to loopback unless --host says "
                    "otherwise.")
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
    unknown = sorted(set(cfg) - set(SPEC_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown key(s) {', '.join(map(repr, unknown))}; this server takes "
            f"{', '.join(SPEC_KEYS)}")
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
    return {"proposer": proposer, "draft_model": model, "num_speculative_tokens": q}


def apply_speculative_config(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``--speculative-config`` moved onto the engine flags it stands for.

    Raises ValueError (``specstream`` exits with 2) where a flag given as well says otherwise.
    """
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


def run_serve(args: argparse.Namespace) -> int:
    args = apply_speculative_config(args)
    if args.ray:
        from specstream.server.ray_serve import run_ray_serve

        return run_ray_serve(args)
    import uvicorn

    from specstream.server.app import ServerConfig, build_app

    config = ServerConfig(
        model_name=args.served_model_name or served_name(args.model),
        api_key=args.api_key, max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
        queue_timeout_s=args.queue_timeout, max_n=args.max_n,
    )
    if not _is_loopback(args.host) and not args.api_key:
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


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
