"""The engine side: what the ingress and the router call on each of the N replicas."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specstream.engine.request import RequestOutput
    from specstream.sampling_params import SamplingParams

    SubRequest = tuple[str, list[int], SamplingParams]  # (request id, prompt ids, params)


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
        """Identity (Serve replica id, actor name, pid), the model's context length and its
        vocabulary size."""
        import ray

        self._start()
        return {"replica": self.replica_id, "pid": os.getpid(),
                "actor_name": ray.get_runtime_context().get_actor_name(),
                "max_model_len": self.llm.engine.max_model_len,
                "vocab_size": self.llm.engine.model_config.vocab_size}

    def check_health(self) -> None:
        """Serve replaces a replica whose engine loop has stopped."""
        if self._started and not self.engine.alive:
            raise RuntimeError(self.engine.error or "the engine loop stopped")

    def __del__(self) -> None:
        if hasattr(self, "engine"):  # the constructor may have failed (e.g. a bad model path)
            self.engine.shutdown()
            self.llm.close()
