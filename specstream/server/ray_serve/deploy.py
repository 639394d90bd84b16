"""``specstream serve --ray``: its flags, the Serve application it deploys, and running it.

Serve resolves ``specstream.server.ray_serve:app_builder`` (``serve run``, config files) through
the package, which re-exports :func:`app_builder` from here.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specstream.server.ray_serve.ingress import OpenAIIngress
from specstream.server.ray_serve.replica import EngineReplica
from specstream.server.ray_serve.router import ROUTER_PATH

if TYPE_CHECKING:
    from ray.serve.deployment import Application

    from specstream.server.app import ServerConfig

APP_NAME = "specstream"


def add_ray_args(p: argparse.ArgumentParser) -> None:
    """``--ray`` and its options, on the ``serve`` command's parser."""
    g = p.add_argument_group("ray (pip install 'specstream[ray]')")
    g.add_argument("--ray", action="store_true",
                   help="serve --replicas engine replicas on Ray Serve behind one endpoint")
    g.add_argument("--replicas", type=int, default=1, help="engine replicas (default 1)")
    g.add_argument("--address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS, else a local cluster)")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs reserved per replica")
    g.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs per replica (default: 1 with --device cuda, else 0)")
    g.add_argument("--ingress-cpus", type=float, default=0.5,
                   help="CPUs reserved for the HTTP ingress")
    g.add_argument("--ray-max-retries", type=int, default=2,
                   help="times a request is sent to another replica after its replica failed")
    g.add_argument("--routing-slack", type=float, default=0.1,
                   help="replicas within this fraction of the host tier of the most free "
                        "host KV count as equal (then the shortest queue wins)")
    g.add_argument("--routing-stats-period", type=float, default=1.0,
                   help="seconds between replicas' free-KV reports")


def replica_llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments of every replica from ``specstream serve`` arguments
    (``--speculative-config`` too), as ``build_llm`` passes them: folders given are made
    absolute (replicas may run elsewhere), and ``LLM`` fills in the embedded pair."""
    from specstream.cli import engine_kwargs
    from specstream.server.cli import apply_speculative_config

    args = apply_speculative_config(args)
    folder = {k: str(Path(v).resolve()) if v else None
              for k, v in (("model", args.model), ("draft_model", args.draft_model))}
    return {**folder, **engine_kwargs(args)}


def replica_resources(args: argparse.Namespace) -> dict[str, Any]:
    """What each engine replica reserves: --replica-cpus and --replica-gpus (default: a GPU on
    cuda) for the replica, and with --tensor-parallel-size N a placement group of N such
    bundles packed on one node (``STRICT_PACK``: the replica starts its ranks as local
    processes), so replicas spread over a cluster's nodes with their ranks beside them."""
    gpus = args.replica_gpus
    if gpus is None:
        gpus = 1.0 if str(args.device).startswith("cuda") else 0.0
    out: dict[str, Any] = {"ray_actor_options": {"num_cpus": args.replica_cpus,
                                                 "num_gpus": gpus}}
    ranks = getattr(args, "tensor_parallel_size", None) or 1
    if ranks > 1:
        bundle = {"CPU": args.replica_cpus, **({"GPU": gpus} if gpus else {})}
        out |= {"placement_group_bundles": [dict(bundle) for _ in range(ranks)],
                "placement_group_strategy": "STRICT_PACK"}
    return out


def ingress_config(args: argparse.Namespace, model: str) -> ServerConfig:
    """The ingress's ServerConfig from ``specstream serve --ray`` arguments, as the
    single-process server builds its own: --chat-template, --generation-config (``auto``
    reads ``model``'s generation_config.json) and --enable-prompt-tokens-details included."""
    from specstream.server.app import ServerConfig
    from specstream.server.cli import generation_defaults, load_chat_template, served_name

    return ServerConfig(
        model_name=args.served_model_name or served_name(args.model), api_key=args.api_key,
        max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
        queue_timeout_s=args.queue_timeout, max_n=args.max_n,
        chat_template=load_chat_template(args.chat_template),
        default_sampling=generation_defaults(args.generation_config, model),
        enable_prompt_tokens_details=args.enable_prompt_tokens_details)


def build_ray_app(args: argparse.Namespace) -> Application:
    """The Serve application for parsed ``specstream serve --ray`` arguments."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from specstream.llm import default_model_dir

    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    llm_kwargs = replica_llm_kwargs(args)
    model = llm_kwargs["model"] or str(default_model_dir("target"))  # the ingress's tokenizer
    config = ingress_config(args, model)
    if config.default_sampling:
        print(f"specstream: request defaults from generation_config.json: "
              f"{dict(config.default_sampling)} (--generation-config vllm leaves them out)",
              file=sys.stderr)
    router = RequestRouterConfig(
        request_router_class=ROUTER_PATH,  # type: ignore[arg-type]
        request_router_kwargs={"slack_fraction": args.routing_slack},
        request_routing_stats_period_s=args.routing_stats_period)
    engine: Any = serve.deployment(
        EngineReplica, name="SpecStreamEngine", num_replicas=args.replicas,
        **replica_resources(args),
        # admission control is the engine's (--max-queue); Serve's default cap is 5
        max_ongoing_requests=config.max_queue + (args.max_num_seqs or 64),
        health_check_period_s=5.0, request_router_config=router)
    ingress: Any = serve.deployment(
        serve.ingress()(OpenAIIngress), name="SpecStreamIngress",
        ray_actor_options={"num_cpus": args.ingress_cpus},
        max_ongoing_requests=4 * config.max_queue)
    return ingress.bind(engine.bind(llm_kwargs, config.max_queue, config.queue_timeout_s),
                        config, model, args.ray_max_retries)


def serve_parser() -> argparse.ArgumentParser:
    """The ``specstream serve`` parser, with the Ray flags."""
    from specstream.server.cli import add_parser

    sub = argparse.ArgumentParser(prog="specstream").add_subparsers()
    add_parser(sub)
    p: argparse.ArgumentParser = sub.choices["serve"]
    if p.get_default("ray") is None:  # the serve command does not register them itself yet
        add_ray_args(p)
    return p


def app_builder(args: dict[str, Any]) -> Application:
    """For ``serve run specstream.server.ray_serve:app_builder replicas=2 model=/m``: the flags
    of ``specstream serve --ray`` as key=value (``_`` or ``-``; ``true`` for a switch)."""
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            argv += [flag] if str(value).lower() == "true" else []
        else:
            argv += [flag, str(value)]
    return build_ray_app(serve_parser().parse_args(argv))


def run_ray_serve(args: argparse.Namespace) -> int:
    """``specstream serve --ray``: deploy on a Ray cluster (joined or local) until Ctrl-C."""
    import ray
    from ray import serve

    from specstream.server.cli import is_loopback

    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:  # a local cluster; logical CPUs may exceed cores (replicas cap their threads)
        need = args.replicas * args.replica_cpus + args.ingress_cpus
        ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(need)))
    if not is_loopback(args.host) and not args.api_key:
        print(f"specstream: warning: serving on {args.host} without --api-key", file=sys.stderr)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_ray_app(args), name=APP_NAME, route_prefix="/")
        print(f"specstream: {args.replicas} replica(s) on Ray Serve at "
              f"http://{args.host}:{args.port}/v1 (Ctrl-C stops)", file=sys.stderr)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if address:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
        ray.shutdown()
    return 0
