"""Completions and chat completions: one API request -> engine requests -> a response.

One API request becomes ``len(prompts) * n`` engine requests (ids ``<base>-<k>``, seeds
``derive_seed(seed, i)`` as in :meth:`LLM.generate`) that share one output queue: a *job*.
:func:`submit` hands a job to the engine (``AsyncEngine``, or the Ray ingress's replica pool),
:func:`collect` waits for its choices and returns the JSON body (``responses``), and
``stream.JobStream`` sends its server-sent events instead.

A job's ids are the engine's while it is open: :func:`close` (called once, however the response
ends) hands them back. Closing twice could abort a newer request that reused the ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from specstream.engine.request import RequestOutput
from specstream.sampling_params import SamplingParams, derive_seed
from specstream.server.async_engine import (
    AdmitTimeout,
    AsyncEngine,
    EngineDead,
    QueueFull,
    RequestIdInUse,
)
from specstream.server.errors import APIError, server_error
from specstream.server.request_params import Render
from specstream.server.responses import response_body
from specstream.structured import GrammarError

DISCONNECT_POLL_S = 0.5  # how often a non-streaming handler checks that its client is there


@dataclass
class Job:
    """One API request in the engine: its sub-request ids and their shared output queue."""

    kind: str  # "completion" or "chat"
    api_id: str
    model: str
    request_ids: list[str]
    prompts: list[list[int]]  # token ids, one list per prompt (usage counts each once)
    prompt_texts: list[str | None]  # the prompts as sent (None: given as token ids)
    n: int  # choices per prompt: choice i answers prompt i // n
    stops: tuple[str, ...]
    outputs: asyncio.Queue[RequestOutput]
    render: Render
    include_usage: bool = False
    closed: bool = False  # its ids went back to the engine (see ``close``)

    def prompt_text(self, p: int) -> str:
        text = self.prompt_texts[p]
        tok = self.render.names.tok
        if text is None:  # token ids: as vLLM echoes them, special tokens spelled out
            text = "" if tok is None else tok.decode(self.prompts[p], skip_special_tokens=False)
        return text


def new_job(kind: str, model: str, prompts: list[list[int]], prompt_texts: list[str | None],
            n: int, stops: tuple[str, ...], render: Render, include_usage: bool,
            request_id: str | None) -> Job:
    """A job not yet submitted; its id is ``request_id`` (X-Request-Id), else a new one."""
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    api_id = request_id or f"{prefix}-{uuid.uuid4().hex}"
    return Job(kind, api_id, model, [], prompts, prompt_texts, n, stops, asyncio.Queue(),
               render, include_usage)


async def submit(engine: AsyncEngine, job: Job, prompts: list[list[int]],
                 params: list[SamplingParams]) -> None:
    """Add every sub-request of ``job``; map engine refusals to HTTP errors.

    On success the job is open: the caller must :func:`close` it. On failure nothing of it
    stays in the engine (and nothing else was touched: a refused job never aborts anything).
    """
    subs: list[tuple[str, list[int], SamplingParams]] = []
    for ids, p in zip(prompts, params):
        for i in range(p.n):
            seed = None if p.seed is None else derive_seed(p.seed, i)
            sub = p if p.n == 1 else dataclasses.replace(p, n=1, best_of=None, seed=seed)
            subs.append((f"{job.api_id}-{len(subs)}", ids, sub))
    job.request_ids = [s[0] for s in subs]
    try:
        await engine.add(subs, job.outputs)
    except RequestIdInUse:
        raise APIError(400, f"The request id {job.api_id!r} (X-Request-Id) is already in use "
                            "by a request in flight; send a unique id.",
                       code="request_id_in_use") from None
    except GrammarError as exc:  # the output constraint's grammar: name the field it came in
        given = [s[2].structured.source for s in subs if s[2].structured is not None]
        field = given[0] if given and given[0] else None
        raise APIError(400, f"{field}: {exc}" if field else str(exc), param=field) from None
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    except QueueFull as exc:
        raise APIError(429, str(exc), type="rate_limit_error") from None
    except (AdmitTimeout, EngineDead) as exc:
        raise APIError(503, str(exc), type="server_error") from None
    except Exception as exc:  # a bug behind the engine's interface: still an OpenAI body
        raise server_error(f"the engine could not take the request: "
                           f"{type(exc).__name__}: {exc}") from None


def close(engine: AsyncEngine, job: Job) -> None:
    """Give the job's ids back (aborting what still runs); only the first call does anything."""
    if not job.closed:
        job.closed = True
        engine.abort(job.request_ids)


async def collect(engine: AsyncEngine, job: Job, request: Request) -> dict[str, Any]:
    """Wait for every choice (aborting all if the client leaves); the response body."""
    final: dict[str, RequestOutput] = {}
    checked = time.monotonic()
    try:
        while len(final) < len(job.request_ids):
            try:
                out = await asyncio.wait_for(job.outputs.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                out = None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:
                if await request.is_disconnected():  # nobody to answer; stop the work
                    raise APIError(499, "The client closed the request.")
                checked = time.monotonic()
            if out is not None and out.finished:
                final[out.request_id] = out
                if out.outputs[0].finish_reason == "error":
                    raise server_error(out.outputs[0].error or "the request failed")
    finally:
        close(engine, job)  # a no-op in the engine for the finished ones
    return response_body(job, [final[rid] for rid in job.request_ids])
