"""The ingress's engine: each API request (a job) runs on one replica, retried after a failure.

:class:`ReplicaPool` has ``AsyncEngine``'s ``add``/``abort``, so the single-process server's
``serving`` and ``stream`` code runs unchanged over it; :class:`RemoteJob` is one job on one
replica.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from specstream.server.ray_serve.replica import SubRequest


class ReplicaPool:
    """What ``serving.submit/collect`` and ``stream.JobStream`` need from an engine (``add``,
    ``abort``), with each job sent to one ``EngineReplica``; counts what it routed for
    ``/metrics``."""

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


