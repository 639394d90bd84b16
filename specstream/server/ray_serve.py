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

Ray, FastAPI and the engine are imported where used: the CLI imports this module for its flags.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from fastapi import FastAPI
    from prometheus_client.metrics_core import Metric
    from ray.serve.deployment import Application
    from ray.serve.handle import DeploymentHandle

    from specstream.engine.request import RequestOutput
    from specstream.sampling_params import SamplingParams
    from specstream.server.app import ServerConfig
    from specstream.server.metrics import MetricsExporter

    SubRequest = tuple[str, list[int], SamplingParams]

APP_NAME = "specstream"
REPLICA_HEADER = "x-specstream-replica"  # which replica admitted the request
K = TypeVar("K", bound=Hashable)


# ---- engine replicas -----------------------------------------------------------------------
class EngineReplica:
    """One engine (``LLM`` + its ``AsyncEngine`` loop thread) in a Serve replica actor."""

    def __init__(self, llm_kwargs: dict[str, Any], max_queue: int, queue_timeout_s: float):
        from ray import serve

        from specstream.llm import LLM
        from specstream.server.async_engine import AsyncEngine

        self.llm = LLM(**llm_kwargs)
        self.engine = AsyncEngine(self.llm, max_queue, queue_timeout_s)
        self.replica_id: str = serve.get_replica_context().replica_id.unique_id
        self._started = False

    def _start(self) -> None:
        if not self._started:  # AsyncEngine binds to the event loop that reads its outputs
            self.engine.start()
            self._started = True

    async def generate(self, requests: list[SubRequest]) -> AsyncIterator[Any]:
        """Admit a job's sub-requests, then stream their outputs.

        Yields ``("admitted", replica_id)`` or ``("error", exception name, message)`` first, then
        lists of the newest (cumulative) output per sub-request until all have finished.
        Cancelling the stream aborts the sub-requests.
        """
        self._start()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        ids = [r[0] for r in requests]
        try:
            await self.engine.add(requests, outputs)
        except Exception as exc:  # refused (ValueError, QueueFull, ...) or a bug: not a death
            yield ("error", type(exc).__name__, str(exc))
            return
        yield ("admitted", self.replica_id)
        live = set(ids)
        try:
            while live:
                newest = {}
                out = await outputs.get()
                while True:  # outputs are cumulative: only the newest one per request matters
                    newest[out.request_id] = out
                    if outputs.empty():
                        break
                    out = outputs.get_nowait()
                live -= {rid for rid, o in newest.items() if o.finished}
                yield list(newest.values())
        finally:
            self.engine.abort(ids)  # no-op for finished ones

    def record_routing_stats(self) -> dict[str, float]:
        """What ``FreeHostKVRouter`` ranks by; Serve polls it every routing-stats period."""
        engine = self.llm.engine
        kv, block = engine.kv, engine.store.block_bytes
        return {"host_kv_free_bytes": kv.host.num_free * block,
                "host_kv_total_bytes": kv.host.num_blocks * block,
                "device_kv_free_bytes": kv.device.num_free * block}

    async def metrics(self) -> dict[str, Any]:
        """This replica's metrics snapshot and the numbers ``/metrics`` shows per replica."""
        self._start()
        m = self.engine.metrics
        return {"replica": self.replica_id, "alive": self.engine.alive,
                "snapshot": m.snapshot(self.engine.num_pending),
                "running": m.engine.get("running", 0), "waiting": m.engine.get("waiting", 0),
                "finished": sum(dict(m.finished).values()), **self.record_routing_stats()}

    async def info(self) -> dict[str, Any]:
        """Identity (Serve replica id, actor name, pid) and the model's context length."""
        import ray

        self._start()
        return {"replica": self.replica_id, "pid": os.getpid(),
                "actor_name": ray.get_runtime_context().get_actor_name(),
                "max_model_len": self.llm.engine.max_model_len}

    def check_health(self) -> None:
        """Serve replaces a replica whose engine loop has stopped."""
        if self._started and not self.engine.alive:
            raise RuntimeError(self.engine.error or "the engine loop stopped")

    def __del__(self) -> None:
        if hasattr(self, "engine"):  # the constructor may have failed (e.g. a bad model path)
            self.engine.shutdown()
            self.llm.close()


# ---- routing -------------------------------------------------------------------------------
def rank_by_free_host_kv(free: dict[K, float], slack: float) -> list[list[K]]:
    """Replicas in preference ranks: those within ``slack`` bytes of the most free host KV,
    then the rest. Unknown (``inf``, no stats yet: a new, empty replica) counts as most free.
    """
    if not free:
        return []
    best = max(free.values())
    top = [k for k, v in free.items() if v >= best - slack]
    rest = sorted((k for k in free if k not in top), key=lambda k: -free[k])
    return [top, rest] if rest else [top]


@functools.cache
def _router_class() -> type:
    from ray.serve.request_router import FIFOMixin, RequestRouter

    class FreeHostKVRouter(FIFOMixin, RequestRouter):
        """Prefer replicas with the most free host KV; in a rank Serve picks the shortest queue.

        ``slack_fraction`` of the largest host tier is the margin within which replicas count
        as equally free (stats are up to one routing-stats period old).
        """

        def initialize_state(self, slack_fraction: float = 0.1, **kwargs: Any) -> None:
            self.slack_fraction = slack_fraction

        async def choose_replicas(self, candidate_replicas: list[Any],
                                  pending_request: Any = None) -> list[list[Any]]:
            stats = {r: r.routing_stats or {} for r in candidate_replicas}
            free = {r: float(s.get("host_kv_free_bytes", math.inf)) for r, s in stats.items()}
            total = max((float(s.get("host_kv_total_bytes", 0)) for s in stats.values()),
                        default=0.0)
            ranks = rank_by_free_host_kv(free, self.slack_fraction * total)
            random.shuffle(ranks[0])  # Serve takes the first of equal queues: spread ties
            return ranks

    FreeHostKVRouter.__module__ = __name__
    return FreeHostKVRouter


def __getattr__(name: str) -> Any:
    """``FreeHostKVRouter`` (which Serve imports by path) is built on first use, so importing
    this module for the CLI flags does not import Ray."""
    if name == "FreeHostKVRouter":
        return _router_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- the ingress's engine: jobs on replicas ------------------------------------------------
class ReplicaPool:
    """What ``serving.submit/collect/stream`` need from an engine (``add``, ``abort``), with
    each job sent to one ``EngineReplica``; counts what it routed for ``/metrics``."""

    def __init__(self, handle: DeploymentHandle, max_retries: int, admit_timeout_s: float):
        self.handle = handle.options(stream=True)
        self.max_retries, self.admit_timeout_s = max_retries, admit_timeout_s
        self.jobs: dict[str, RemoteJob] = {}  # by the job's first sub-request id
        self.routed: dict[str, int] = {}  # replica -> jobs admitted there (retries included)
        self.failures: dict[str, int] = {}  # replica -> jobs that failed on it
        self.retries = 0  # jobs rerun after their replica failed while running them
        self.reroutes = 0  # jobs sent again after a replica failed before admitting them

    async def add(self, requests: list[SubRequest], outputs: asyncio.Queue[Any]) -> None:
        """Route the job and return once a replica admitted it (AsyncEngine.add's contract)."""
        from specstream.server.async_engine import RequestIdInUse

        if requests[0][0] in self.jobs:  # sub-request ids are <api id>-<k>: the api id is taken
            raise RequestIdInUse(f"request id {requests[0][0]!r} is already in use")
        job = RemoteJob(self, requests, outputs)
        self.jobs[requests[0][0]] = job
        try:
            await job.open()
        except BaseException:
            self.jobs.pop(requests[0][0], None)
            raise
        job.task = asyncio.create_task(job.pump())

    def abort(self, request_ids: list[str]) -> None:
        """Stop a job (no-op once it is gone): its replica aborts the sub-requests."""
        job = self.jobs.pop(request_ids[0], None) if request_ids else None
        if job is not None:
            job.close()

    def job(self, request_ids: list[str]) -> RemoteJob:
        return self.jobs[request_ids[0]]


class RemoteJob:
    """One job on a replica: admission, forwarding outputs, and retry after a failure."""

    def __init__(self, pool: ReplicaPool, requests: list[SubRequest],
                 outputs: asyncio.Queue[Any]) -> None:
        self.pool, self.requests, self.outputs = pool, requests, outputs
        self.replica: str | None = None
        self.stream: Any = None  # the replica's DeploymentResponseGenerator
        self.task: asyncio.Task[None] | None = None
        # Nothing reaches the client before the end (non-streaming), so a rerun is invisible.
        self.restartable = False
        self.produced = False  # some token was forwarded (a stream may have sent it)
        self.finished: set[str] = set()
        self.attempts = 0
        self.closed = False  # the handler is done with the job (finished, failed or left)

    async def open(self) -> None:
        """Send the unfinished sub-requests to a replica; wait until it admits them.

        A replica that fails before admitting (it died, or its engine did) is skipped: Serve
        routes the next attempt elsewhere once it has seen the death.
        """
        from specstream.server.async_engine import (
            AdmitTimeout,
            EngineDead,
            QueueFull,
            RequestIdInUse,
        )

        errors = {"ValueError": ValueError, "QueueFull": QueueFull, "AdmitTimeout": AdmitTimeout,
                  "EngineDead": EngineDead, "RequestIdInUse": RequestIdInUse}
        todo = [r for r in self.requests if r[0] not in self.finished]
        while True:
            self.attempts += 1
            gen: Any = self.pool.handle.generate.remote(todo)  # a DeploymentResponseGenerator
            try:
                first = await asyncio.wait_for(gen.__anext__(), self.pool.admit_timeout_s)
            except asyncio.TimeoutError:
                gen.cancel()
                raise AdmitTimeout(f"no replica admitted the request within "
                                   f"{self.pool.admit_timeout_s:g} s; retry later") from None
            except Exception as exc:  # the replica died (or broke) before admitting
                gen.cancel()
                if self.attempts > self.pool.max_retries:
                    raise EngineDead(f"replicas failed {self.attempts} times before admitting "
                                     f"the request; last: {_describe(exc)}") from None
                self.pool.reroutes += 1
                continue
            except BaseException:  # cancelled: the client left while it was routed
                gen.cancel()
                raise
            if first[0] == "error":
                if first[1] == "EngineDead" and self.attempts <= self.pool.max_retries:
                    self.pool.reroutes += 1
                    continue  # that replica's engine crashed; Serve will replace it
                raise errors.get(first[1], RuntimeError)(first[2])
            self.replica, self.stream = first[1], gen
            self.pool.routed[first[1]] = self.pool.routed.get(first[1], 0) + 1
            return

    async def pump(self) -> None:
        """Forward outputs to the job's queue; after a replica failure, rerun or fail the job."""
        while True:
            try:
                async for outs in self.stream:
                    for out in outs:
                        self.produced = self.produced or bool(out.outputs[0].token_ids)
                        if out.finished:
                            self.finished.add(out.request_id)
                        self.outputs.put_nowait(out)
                    if len(self.finished) == len(self.requests):
                        return  # the handler may close the stream before it ends: not a failure
                raise RuntimeError("its output stream ended before the request finished")
            except Exception as exc:
                if self.closed:  # Serve's RequestCancelledError after close()
                    return
                dead = self.replica or "?"
                self.pool.failures[dead] = self.pool.failures.get(dead, 0) + 1
                reason = f"replica {dead} failed while running this request: {_describe(exc)}"
                if (self.restartable or not self.produced) \
                        and self.attempts <= self.pool.max_retries:
                    try:
                        await self.open()
                        self.pool.retries += 1
                        continue
                    except Exception as again:
                        reason += f"; the retry failed too: {again}"
                self._fail(reason + "; send the request again")
                return

    def _fail(self, message: str) -> None:
        from specstream.engine.request import CompletionOutput, RequestOutput

        for rid, ids, _ in self.requests:
            if rid not in self.finished:
                comp = CompletionOutput(0, "", [], "error", error=message)
                self.outputs.put_nowait(RequestOutput(rid, None, ids, [comp], True))

    def close(self) -> None:
        self.closed = True
        if self.task is not None:
            self.task.cancel()
        if self.stream is not None:
            self.stream.cancel()  # the replica's generator is cancelled and aborts


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


# ---- the ingress ---------------------------------------------------------------------------
class OpenAIIngress:
    """The single-process server's OpenAI routes, over a :class:`ReplicaPool`."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
            self, engines: DeploymentHandle, config: ServerConfig, model_dir: str,
            max_retries: int) -> None:
        from specstream.tokenizer import Tokenizer

        self.engines, self.config = engines, config
        self.pool = ReplicaPool(engines, max_retries, config.queue_timeout_s)
        self.max_len = (await engines.info.remote())["max_model_len"]
        has_tok = (Path(model_dir) / "tokenizer.json").is_file()
        self.tok = Tokenizer(model_dir) if has_tok else None

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self.pool, self.engines, self.config, self.tok, self.max_len)


def build_ingress_app(pool: ReplicaPool, engines: DeploymentHandle, config: ServerConfig,
                      tok: Any, max_len: int) -> FastAPI:
    """The single-process server's routes (``app.openai_app``) with jobs sent to replicas,
    the serving replica named in a response header and ``/metrics`` merged over replicas."""
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
                      title="SpecStream on Ray Serve")


async def replica_metrics(engines: DeploymentHandle, timeout_s: float = 5.0) -> list[dict]:
    """``EngineReplica.metrics()`` of every live replica (dead or slow ones are left out)."""
    results = await engines.broadcast("metrics").results_async(timeout_s=timeout_s,
                                                                return_exceptions=True)
    return [r for r in results if isinstance(r, dict)]


def pool_metrics(exporter: MetricsExporter, pool: ReplicaPool, snaps: list[dict]
                 ) -> list[Metric]:
    """Per-replica series and the ingress's routing counters (``exporter``: the ingress's
    :class:`MetricsExporter`, which labels them with the model)."""
    def per_replica(kind: str, name: str, help: str, field: str) -> Metric:
        return exporter.family(kind, name, help, [({"replica": s["replica"]}, s[field])
                                                  for s in snaps])

    def by_replica(name: str, help: str, counts: dict[str, int]) -> Metric:
        return exporter.family("counter", name, help, [({"replica": r}, n)
                                                       for r, n in sorted(counts.items())])

    return [
        exporter.family("gauge", "specstream_ray_replicas",
                        "Engine replicas that answered this scrape.", [({}, len(snaps))]),
        per_replica("gauge", "specstream_ray_replica_host_kv_free_bytes",
                    "Free host KV per replica (what routing prefers).", "host_kv_free_bytes"),
        per_replica("gauge", "specstream_ray_replica_requests_running",
                    "Requests being decoded per replica.", "running"),
        per_replica("counter", "specstream_ray_replica_requests_finished",
                    "Engine requests finished per replica.", "finished"),
        by_replica("specstream_ray_requests_routed",
                   "API requests admitted per replica (retries included).", pool.routed),
        by_replica("specstream_ray_replica_failures",
                   "API requests whose replica failed while running them.", pool.failures),
        exporter.family("counter", "specstream_ray_retries",
                        "API requests rerun after their replica failed while running them.",
                        [({}, pool.retries)]),
        exporter.family("counter", "specstream_ray_reroutes",
                        "API requests sent again after a replica failed before admitting them.",
                        [({}, pool.reroutes)]),
    ]


# ---- building and running ------------------------------------------------------------------
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


def build_ray_app(args: argparse.Namespace) -> Application:
    """The Serve application for parsed ``specstream serve --ray`` arguments."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from specstream.llm import default_model_dir
    from specstream.server.app import ServerConfig
    from specstream.server.cli import served_name

    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    llm_kwargs = replica_llm_kwargs(args)
    model = llm_kwargs["model"] or str(default_model_dir("target"))  # the ingress's tokenizer
    config = ServerConfig(
        model_name=args.served_model_name or served_name(args.model), api_key=args.api_key,
        max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
        queue_timeout_s=args.queue_timeout, max_n=args.max_n)
    gpus = args.replica_gpus
    if gpus is None:
        gpus = 1.0 if str(args.device).startswith("cuda") else 0.0
    router = RequestRouterConfig(
        request_router_class=f"{__name__}.FreeHostKVRouter",  # type: ignore[arg-type]
        request_router_kwargs={"slack_fraction": args.routing_slack},
        request_routing_stats_period_s=args.routing_stats_period)
    engine: Any = serve.deployment(
        EngineReplica, name="SpecStreamEngine", num_replicas=args.replicas,
        ray_actor_options={"num_cpus": args.replica_cpus, "num_gpus": gpus},
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

    from specstream.server.cli import _is_loopback

    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:  # a local cluster; logical CPUs may exceed cores (replicas cap their threads)
        need = args.replicas * args.replica_cpus + args.ingress_cpus
        ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(need)))
    if not _is_loopback(args.host) and not args.api_key:
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
