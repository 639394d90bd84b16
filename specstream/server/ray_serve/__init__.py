"""Scale out on Ray Serve: N engine replicas behind one OpenAI-compatible ingress.

``specstream serve --ray --replicas N`` (or ``serve run`` with :func:`app_builder`) deploys::

    HTTP -> Serve proxy -> OpenAIIngress (1 replica) --handle--> EngineReplica (N replicas)
                           routes, parsing, SSE: the           LLM + AsyncEngine each, with
                           single-process server's code        its own KV tiers and device

The ingress runs the single-process server's protocol and serving code against
:class:`ReplicaPool`, which stands in for ``AsyncEngine`` (``add``/``abort``) and sends each API
request (a *job*: its ``len(prompts) * n`` sub-requests) to one replica.

Routing: every replica reports its free host KV through ``record_routing_stats``;
``FreeHostKVRouter`` ranks replicas by it (those within ``slack`` of the best form the first
rank, in which Serve picks the shortest queue), so long contexts go where host memory is free.

Failures: a job that a replica had not admitted when it died is sent to another replica. A job
whose replica dies while it runs is retried elsewhere unless tokens may already have reached
the client (a stream that has produced tokens); that stream gets an error event naming the
replica. ``/metrics`` sums the replicas' metric snapshots (rendered by the single-process
server's exporter, under its names) and adds per-replica series.

The modules, in the order a request meets them:

- ``ingress``: :class:`OpenAIIngress`, the HTTP app and ``/metrics`` over all replicas;
- ``pool``: :class:`ReplicaPool` and :class:`RemoteJob`, one API request on one replica,
  admission, forwarding and retry;
- ``router``: ``FreeHostKVRouter``, which replica a job goes to;
- ``replica``: :class:`EngineReplica`, one engine in a Serve replica;
- ``deploy``: the ``--ray`` flags, the Serve application and ``specstream serve --ray``.

Ray, FastAPI and the engine are imported where used: the CLI imports this package for its
flags, and none of these modules imports them at the top.
"""

from __future__ import annotations

from typing import Any

from specstream.server.ray_serve.deploy import (
    APP_NAME,
    add_ray_args,
    app_builder,
    build_ray_app,
    ingress_config,
    replica_llm_kwargs,
    replica_resources,
    run_ray_serve,
    serve_parser,
)
from specstream.server.ray_serve.ingress import (
    REPLICA_HEADER,
    OpenAIIngress,
    build_ingress_app,
    pool_metrics,
    replica_metrics,
)
from specstream.server.ray_serve.pool import RemoteJob, ReplicaPool
from specstream.server.ray_serve.replica import EngineReplica
from specstream.server.ray_serve.router import rank_by_free_host_kv

__all__ = [
    "APP_NAME", "REPLICA_HEADER", "EngineReplica", "FreeHostKVRouter", "OpenAIIngress",
    "RemoteJob", "ReplicaPool", "add_ray_args", "app_builder", "build_ingress_app",
    "build_ray_app", "ingress_config", "pool_metrics", "rank_by_free_host_kv",
    "replica_llm_kwargs", "replica_metrics", "replica_resources", "run_ray_serve",
    "serve_parser",
]


def __getattr__(name: str) -> Any:
    """``FreeHostKVRouter`` needs Ray, so it is built on first use (see ``router``)."""
    if name == "FreeHostKVRouter":
        from specstream.server.ray_serve import router

        return router.FreeHostKVRouter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
