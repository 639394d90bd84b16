"""The engine loop thread and per-request asyncio queues.

The engine is not thread-safe, so exactly one thread (the loop) ever calls it. HTTP handlers
send it commands (add, abort) through a thread-safe queue that the loop drains between steps;
the loop hands every output back to the handler's ``asyncio.Queue`` with
``call_soon_threadsafe``. Outputs are cumulative (full text so far), so a consumer may skip to
the newest one.

Backpressure: at most ``max_queue`` requests may wait for admission at a time (more get
:class:`QueueFull`, a 429), and a request not admitted within ``queue_timeout_s`` is withdrawn
(:class:`AdmitTimeout`, a 503). Once admitted, a request runs to completion unless its client
goes away.

Request ids: ``add`` claims its ids and ``abort`` hands them back. A request whose id is still
claimed is refused (:class:`RequestIdInUse`) before anything is sent to the loop, so a reused
id never touches the request that holds it.

Metrics: the loop feeds :class:`ServerMetrics` from every step's outputs: a request's first
tokens give its time to first token, later ones its inter-token latencies (per token: the first
token of a step waited since the request's previous tokens, the rest of that step's burst came
with it), a finished request its phase times; the sub-requests of one prompt's ``n`` choices
(consecutive in one ``add``, same prompt, same parameters but the seed) count as one request
for ``n`` and its longest generation, as vLLM counts a parent request.

Faults: an exception in one loop iteration (a step, an add, the metrics) is logged and fails
the requests that the step may have touched (everything admitted; requests still waiting were
not touched and stay); the loop carries on. Only ``shutdown`` stops it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from specstream.engine.request import CompletionOutput, RequestOutput, Status
from specstream.llm import LLM
from specstream.sampling_params import SamplingParams
from specstream.server.metrics import ServerMetrics

log = logging.getLogger("specstream.server")
SNAPSHOT_EVERY_S = 0.25  # how often the loop copies engine metrics for /metrics
RETRY_PAUSE_S = 0.05  # pause after a failed loop iteration


class QueueFull(Exception):
    """Too many requests are already waiting for admission."""


class AdmitTimeout(Exception):
    """The request could not be admitted in time (memory or batch slots stayed full)."""


class EngineDead(Exception):
    """The engine loop is not running."""


class RequestIdInUse(ValueError):
    """A request id is still held by a request in flight."""


@dataclass
class _Parent:
    """The ``n`` sub-requests of one prompt (vLLM's parent request), for its metrics."""

    n: int = 0
    left: int = 0  # sub-requests not yet ended
    max_generated: int = 0


@dataclass
class _Pending:
    """One engine request, as the loop thread tracks it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    outputs: asyncio.Queue[RequestOutput]
    admitted: asyncio.Event = field(default_factory=asyncio.Event)
    add_error: Exception | None = None
    parent: _Parent = field(default_factory=_Parent)
    # (loop thread) tokens seen in its outputs so far, and when the newest of them came
    num_seen: int = 0
    last_token_time: float = 0.0


class AsyncEngine:
    """Runs ``llm.engine`` in its own thread; handlers ``await`` admission and read outputs."""

    def __init__(self, llm: LLM, max_queue: int = 256, queue_timeout_s: float = 60.0,
                 metrics: ServerMetrics | None = None) -> None:
        self.llm, self.engine = llm, llm.engine
        self.max_queue, self.queue_timeout_s = max_queue, queue_timeout_s
        self.metrics = metrics or ServerMetrics(
            max_model_len=self.engine.max_model_len,
            num_speculative_tokens=llm.config.q)
        self.num_pending = 0  # requests awaiting admission (event-loop side only)
        self._cmds: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._claimed: set[str] = set()  # ids from add() not yet handed back (event-loop side)
        self._live: dict[str, _Pending] = {}  # loop-thread side only
        self._unadmitted: dict[str, _Pending] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_snapshot = 0.0  # when the loop last copied the engine's metrics
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: str | None = None

    # ---- event-loop side ----------------------------------------------------------------
    def start(self) -> None:
        """Start the loop thread; call from the event loop that will read the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="specstream-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        ranks = getattr(self.engine, "ranks", None)  # tensor parallelism: a rank gone
        if self.error is None and ranks is not None and ranks.failure() is not None:
            self.error = f"the tensor-parallel group is broken: {ranks.failure()}"
        return self._thread is not None and self._thread.is_alive() and self.error is None

    async def add(self, requests: list[tuple[str, list[int], SamplingParams]],
                  outputs: asyncio.Queue[RequestOutput]) -> None:
        """Add requests that share one output queue; return once all are admitted.

        Raises ValueError (invalid for the engine; RequestIdInUse), QueueFull, AdmitTimeout or
        EngineDead; on any failure, and on cancellation (the client left), none of them stays in
        the engine. Once it returned, the ids are claimed until ``abort`` hands them back.
        """
        if not self.alive:
            raise EngineDead(self.error or "the engine loop is not running")
        if len(requests) > self.max_queue:  # would be refused even on an idle server
            raise ValueError(f"{len(requests)} requests at once are more than the server ever "
                             f"queues (--max-queue {self.max_queue})")
        ids = [rid for rid, _, _ in requests]
        taken = [rid for rid in ids if rid in self._claimed]
        if taken or len(set(ids)) < len(ids):
            raise RequestIdInUse(f"request id {(taken or ids)[0]!r} is already in use")
        if self.num_pending + len(requests) > self.max_queue:
            self.metrics.on_reject("queue_full")
            raise QueueFull(f"the server is busy: {self.num_pending} requests are already "
                            f"waiting for admission (--max-queue {self.max_queue}); retry later")
        items = _with_parents([_Pending(rid, toks, p, outputs) for rid, toks, p in requests])
        self._claimed.update(ids)
        self.num_pending += len(items)
        try:
            for it in items:
                self._cmds.put(("add", it))
            waits = [it.admitted.wait() for it in items]
            await asyncio.wait_for(asyncio.gather(*waits), self.queue_timeout_s)
        except asyncio.TimeoutError:
            self.abort([it.request_id for it in items])
            self.metrics.on_reject("admit_timeout")
            raise AdmitTimeout(
                f"the request was not admitted within {self.queue_timeout_s:g} s: KV memory "
                "and batch slots stayed full; retry later") from None
        except BaseException:
            self.abort([it.request_id for it in items])
            raise
        finally:
            self.num_pending -= len(items)
        errors = [it.add_error for it in items if it.add_error is not None]
        if errors:
            self.abort([it.request_id for it in items])
            raise errors[0]

    def abort(self, request_ids: list[str]) -> None:
        """Withdraw requests (no-op for finished ones) and hand their ids back; their KV is
        freed on both tiers. Ids this engine does not hold are left alone."""
        for rid in request_ids:
            if rid in self._claimed:
                self._claimed.discard(rid)
                self._cmds.put(("abort", rid))

    # ---- loop thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._iterate()
                except Exception as exc:  # a bug or a device fault: fail what it touched
                    self._recover(exc)
        except BaseException as exc:  # not an error a request caused: the loop is gone
            self.error = f"engine loop stopped: {type(exc).__name__}: {exc}"
            raise
        finally:
            self._fail_all(self.error or "the server is shutting down")

    def _iterate(self) -> None:
        """Take the commands, step, hand the outputs out."""
        self._drain(block=not self.engine.has_unfinished())
        outs: list[RequestOutput] = []
        now = 0.0
        if self.engine.has_unfinished():
            t0 = time.perf_counter()
            outs = self.engine.step()
            now = time.perf_counter()
            self.metrics.on_step(now - t0)
        # periodically, and before the last outputs of a busy spell reach their clients (so
        # a client that got its answer finds it counted in /metrics)
        idle = bool(outs) and not self.engine.has_unfinished()
        if idle or time.perf_counter() - self._last_snapshot > SNAPSHOT_EVERY_S:
            self._last_snapshot = time.perf_counter()
            self.metrics.on_engine(self.engine.get_metrics())
        self._dispatch(outs, now)
        self._signal_admitted()

    def _recover(self, exc: Exception) -> None:
        """After a failed iteration: fail every request the engine may have touched (all but
        those still waiting for admission, which no step has seen) and drop anything else it
        still holds, so the next iteration starts from a consistent engine."""
        log.exception("engine loop iteration failed; carrying on", exc_info=exc)
        self.metrics.on_loop_error()
        message = f"the engine failed: {type(exc).__name__}: {exc}"
        try:
            waiting = {r.request_id for r in self.engine.scheduler.waiting}
            for rid, it in list(self._live.items()):
                if rid not in waiting:
                    self._fail(it, message)
            for rid in list(self.engine.scheduler.requests):
                if rid not in waiting:
                    self._engine_abort(rid)
        except Exception:  # the engine is too broken to tell: fail them all
            log.exception("recovery failed; failing every request in the engine")
            for it in list(self._live.values()):
                self._fail(it, message)
        self._stop.wait(RETRY_PAUSE_S)  # a fault that repeats does not spin

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=0.05) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = cmd
            if kind == "add":
                self._add(arg)
            else:
                self._abort(arg)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _add(self, it: _Pending) -> None:
        try:
            self.engine.add_request(it.prompt_token_ids, it.params, it.request_id)
        except Exception as exc:  # ValueError: invalid for the engine (a 400); else a bug (500)
            it.add_error = exc
            self._call(it.admitted.set)
            return
        self._live[it.request_id] = it
        self._unadmitted[it.request_id] = it

    def _abort(self, rid: str) -> None:
        it = self._live.pop(rid, None)
        if it is None:
            return  # finished (or never added)
        self._unadmitted.pop(rid, None)
        self.engine.abort_request(rid)
        self._release(rid)
        self._ended(it, None, "abort")

    def _dispatch(self, outs: list[RequestOutput], now: float) -> None:
        step_tokens = 0
        for out in outs:
            it = self._live.get(out.request_id)
            if it is None:
                continue
            step_tokens += self._observe(it, out, now)
            if out.finished:  # counted before its client can hear of it
                del self._live[out.request_id]
                self._release(out.request_id)
                self._ended(it, out, out.outputs[0].finish_reason or "stop")
            self._call(it.outputs.put_nowait, out)
        self.metrics.on_iteration(step_tokens)

    def _observe(self, it: _Pending, out: RequestOutput, now: float) -> int:
        """One output's new tokens into the latency histograms (times: the engine's where its
        output carries them, else when the step returned); its share of the step's tokens
        (vLLM's: the prompt with the first token, plus the tokens generated)."""
        new = len(out.outputs[0].token_ids) - it.num_seen
        if new <= 0:
            return 0
        m = out.metrics
        if it.num_seen == 0:
            ttft = m.get("ttft_s", now - m["arrival_time"] if "arrival_time" in m else None)
            self.metrics.on_tokens(new, ttft_s=ttft)
            # (decode time, vLLM's, runs from the first token: the gaps then add up to it)
            it.last_token_time = m.get("first_token_time", m.get("last_token_time", now))
            share = new + len(it.prompt_token_ids)
        else:
            t = m.get("last_token_time", now)
            self.metrics.on_tokens(new, gap_s=t - it.last_token_time)
            it.last_token_time = t
            share = new
        it.num_seen += new
        return share

    def _ended(self, it: _Pending, out: RequestOutput | None, reason: str) -> None:
        """Count a sub-request's end, and its parent's once all of the parent's have ended."""
        self.metrics.on_finish(out, reason, it.params.max_tokens)
        parent = it.parent
        generated = len(out.outputs[0].token_ids) if out is not None else it.num_seen
        parent.max_generated = max(parent.max_generated, generated)
        parent.left -= 1
        if parent.left == 0:
            self.metrics.on_parent_finished(parent.n, parent.max_generated)

    def _signal_admitted(self) -> None:
        requests = self.engine.scheduler.requests
        for rid, it in list(self._unadmitted.items()):
            req = requests.get(rid)
            if req is None or req.status is not Status.WAITING:
                del self._unadmitted[rid]
                self._call(it.admitted.set)

    def _release(self, rid: str) -> None:
        """Forget a finished request (the scheduler keeps finished ones, which would leak)."""
        self.engine.scheduler.requests.pop(rid, None)

    def _fail(self, it: _Pending, message: str) -> None:
        """End one live request with an error output (a 500, or an error event)."""
        rid = it.request_id
        self._engine_abort(rid)
        self._live.pop(rid, None)
        self._unadmitted.pop(rid, None)
        self._release(rid)
        self._ended(it, None, "error")
        comp = CompletionOutput(0, "", [], "error", error=message)
        self._call(it.outputs.put_nowait, RequestOutput(rid, None, it.prompt_token_ids, [comp],
                                                        True))
        self._call(it.admitted.set)

    def _engine_abort(self, rid: str) -> None:
        try:
            self.engine.abort_request(rid)
        except Exception:  # the engine may be broken; the clients must still hear
            log.exception("abort of %s failed", rid)
            self._release(rid)

    def _fail_all(self, message: str) -> None:
        """At shutdown: fail every request, those not yet added too."""
        for it in list(self._live.values()):
            self._fail(it, message)
        while True:  # adds that never reached the engine
            try:
                kind, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                arg.add_error = EngineDead(message)
                self._call(arg.admitted.set)

    def _call(self, fn: Any, *args: Any) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop closed meanwhile
            pass


def _with_parents(items: list[_Pending]) -> list[_Pending]:
    """Give the sub-requests of one prompt one :class:`_Parent`: consecutive ones with the
    same prompt and the same parameters but the seed (how the server splits ``n``)."""
    prev: _Pending | None = None
    for it in items:
        if prev is not None and prev.prompt_token_ids == it.prompt_token_ids and (
                dataclasses.replace(prev.params, seed=None)
                == dataclasses.replace(it.params, seed=None)):
            it.parent = prev.parent
        it.parent.n += 1
        it.parent.left += 1
        prev = it
    return items
