"""The HTTP side: the single-process server's OpenAI routes over a :class:`ReplicaPool`, with
``/health`` and ``/metrics`` gathered from every replica."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from specstream.server.ray_serve.pool import ReplicaPool

if TYPE_CHECKING:
    from fastapi import FastAPI
    from prometheus_client.metrics_core import Metric
    from ray.serve.handle import DeploymentHandle

    from specstream.server.app import ServerConfig
    from specstream.server.metrics import MetricsExporter

REPLICA_HEADER = "x-specstream-replica"  # which replica admitted the request


class OpenAIIngress:
    """The single-process server's OpenAI routes, over a :class:`ReplicaPool`."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
            self, engines: DeploymentHandle, config: ServerConfig, model_dir: str,
            max_retries: int) -> None:
        from specstream.tokenizer import Tokenizer

        self.engines, self.config = engines, config
        self.pool = ReplicaPool(engines, max_retries, config.queue_timeout_s)
        info = await engines.info.remote()
        self.max_len: int = info["max_model_len"]
        self.vocab_size: int | None = info.get("vocab_size")  # bounds logit_bias keys
        has_tok = (Path(model_dir) / "tokenizer.json").is_file()
        self.tok = Tokenizer(model_dir) if has_tok else None

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self.pool, self.engines, self.config, self.tok, self.max_len,
                                 self.vocab_size)


def build_ingress_app(pool: ReplicaPool, engines: DeploymentHandle, config: ServerConfig,
                      tok: Any, max_len: int, vocab_size: int | None = None) -> FastAPI:
    """The single-process server's routes (``app.openai_app``) with jobs sent to replicas,
    the serving replica named in a response header and ``/metrics`` merged over replicas.
    ``vocab_size`` (the replicas' model's) bounds ``logit_bias`` keys, as on one server."""
    from fastapi.responses import JSONResponse

    from specstream.server.app import openai_app
    from specstream.server.metrics import MetricsExporter

    exporter = MetricsExporter(config.model_name)

    def on_submit(job: Any, req: Any) -> dict[str, str]:
        remote = pool.job(job.request_ids)
        remote.restartable = not req.stream
        return {REPLICA_HEADER: remote.replica or ""}

    async def health() -> JSONResponse:
        snaps = await replica_metrics(engines)
        alive = sum(1 for s in snaps if s["alive"])
        if not alive:
            return JSONResponse({"status": "error", "error": "no engine replica is alive"},
                                status_code=503)
        return JSONResponse({"status": "ok", "replicas": alive})

    async def metrics() -> bytes:
        snaps = await replica_metrics(engines)
        return exporter.render([s["snapshot"] for s in snaps], pool_metrics(exporter, pool, snaps))

    return openai_app(config, tok, max_len, pool, health, metrics, on_submit,
                      vocab_size=vocab_size, title="SpecStream on Ray Serve")


async def replica_metrics(engines: DeploymentHandle, timeout_s: float = 5.0) -> list[dict]:
    """``EngineReplica.metrics()`` of every live replica (dead or slow ones are left out)."""
    results = await engines.broadcast("metrics").results_async(timeout_s=timeout_s,
                                                                return_exceptions=True)
    return [r for r in results if isinstance(r, dict)]


def pool_metrics(exporter: MetricsExporter, pool: ReplicaPool, snaps: list[dict]
                 ) -> list[Metric]:
    """Per-replica series and the ingress's routing counters (``exporter``: the ingress's
    :class:`MetricsExporter`, which labels them with the model; the engines' own series,
    summed over the replicas, carry vLLM's ``engine="0"`` as one engine's would)."""
    def per_replica(kind: str, name: str, help: str, field: str) -> Metric:
        return exporter.family(kind, name, help, [({"replica": s["replica"]}, s[field])
                                                  for s in snaps], engine=False)

    def by_replica(name: str, help: str, counts: dict[str, int]) -> Metric:
        return exporter.family("counter", name, help, [({"replica": r}, n)
                                                       for r, n in sorted(counts.items())],
                               engine=False)

    return [
        exporter.family("gauge", "specstream:ray_replicas",
                        "Engine replicas that answered this scrape.", [({}, len(snaps))],
                        engine=False),
        per_replica("gauge", "specstream:ray_replica_host_kv_free_bytes",
                    "Free host KV per replica (what routing prefers).", "host_kv_free_bytes"),
        per_replica("gauge", "specstream:ray_replica_requests_running",
                    "Requests being decoded per replica.", "running"),
        per_replica("counter", "specstream:ray_replica_requests_finished",
                    "Engine requests finished per replica.", "finished"),
        by_replica("specstream:ray_requests_routed",
                   "API requests admitted per replica (retries included).", pool.routed),
        by_replica("specstream:ray_replica_failures",
                   "API requests whose replica failed while running them.", pool.failures),
        exporter.family("counter", "specstream:ray_retries",
                        "API requests rerun after their replica failed while running them.",
                        [({}, pool.retries)], engine=False),
        exporter.family("counter", "specstream:ray_reroutes",
                        "API requests sent again after a replica failed before admitting them.",
                        [({}, pool.reroutes)], engine=False),
    ]


