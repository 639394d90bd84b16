"""``specstream serve``: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path

from specstream.cli import add_engine_args, build_llm
from specstream.server.ray_serve import add_ray_args


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
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    add_engine_args(p)
    add_ray_args(p)
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
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
