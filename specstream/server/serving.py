"""Completions and chat completions: prompts -> engine requests -> JSON or server-sent events.

One API request becomes ``len(prompts) * n`` engine requests (ids ``<base>-<k>``, seeds
``derive_seed(seed, i)`` as in :meth:`LLM.generate`) that share one output queue. Streams send
text deltas; text that could still turn out to be the start of a stop string, or an incomplete
UTF-8 character, is held back until it is settled, so the streamed text always equals the final
text.

A job's ids are the engine's while it is open: :func:`close` (called once, however the response
ends) hands them back. Closing twice could abort a newer request that reused the ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specstream.engine.request import RequestOutput
from specstream.sampling_params import SamplingParams, derive_seed
from specstream.server.async_engine import (
    AdmitTimeout,
    AsyncEngine,
    EngineDead,
    QueueFull,
    RequestIdInUse,
)
from specstream.server.protocol import APIError, ChatCompletionRequest, server_error

DISCONNECT_POLL_S = 0.5  # how often a non-streaming handler checks that its client is there
TOP_K_MAX = (1 << 63) - 1


@dataclass
class Job:
    """One API request in the engine: its sub-request ids and their shared output queue."""

    kind: str  # "completion" or "chat"
    api_id: str
    model: str
    request_ids: list[str]
    prompt_lens: list[int]  # one per prompt (usage counts each prompt once)
    stops: tuple[str, ...]
    outputs: asyncio.Queue[RequestOutput]
    include_usage: bool = False
    closed: bool = False  # its ids went back to the engine (see ``close``)


def sampling_params(req: Any, prompt_len: int, max_model_len: int, param: str) -> SamplingParams:
    """SamplingParams for one prompt; context violations are 400s naming the field."""
    if prompt_len >= max_model_len:
        raise APIError(400, f"The prompt is {prompt_len} tokens long; the model's context is "
                            f"{max_model_len} tokens.", param=param, code="context_length_exceeded")
    max_tokens = getattr(req, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = req.max_tokens
    if max_tokens is None:  # OpenAI: 16 for completions, the rest of the context for chat
        room = max_model_len - prompt_len
        max_tokens = room if isinstance(req, ChatCompletionRequest) else min(16, room)
    if max_tokens >= 1 and prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"max_tokens ({max_tokens}) + the prompt ({prompt_len} tokens) "
                            f"exceeds the model's context of {max_model_len} tokens.",
                       param="max_tokens", code="context_length_exceeded")
    if not 0.0 <= req.temperature <= 2.0:
        raise APIError(400, f"temperature must be in [0, 2], got {req.temperature}",
                       param="temperature")
    if req.top_k > TOP_K_MAX:  # the engine keeps top_k in an int64 tensor
        raise APIError(400, f"top_k must be -1, 0 (off) or in [1, {TOP_K_MAX}], got {req.top_k}",
                       param="top_k")
    try:
        return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              seed=req.seed, max_tokens=max_tokens, stop=req.stop,
                              ignore_eos=req.ignore_eos, n=req.n)
    except (ValueError, TypeError) as exc:  # the message starts with the field's name
        raise APIError(400, str(exc), param=str(exc).split()[0]) from None


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
            sub = p if p.n == 1 else dataclasses.replace(p, n=1, seed=seed)
            subs.append((f"{job.api_id}-{len(subs)}", ids, sub))
    job.request_ids = [s[0] for s in subs]
    try:
        await engine.add(subs, job.outputs)
    except RequestIdInUse:
        raise APIError(400, f"The request id {job.api_id!r} (X-Request-Id) is already in use "
                            "by a request in flight; send a unique id.",
                       code="request_id_in_use") from None
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


class JobStream(StreamingResponse):
    """The server-sent events of an open job; closes the job however the response ends, even
    when the body was never iterated (the client left before the first byte)."""

    def __init__(self, engine: AsyncEngine, job: Job, headers: dict[str, str]) -> None:
        super().__init__(stream(engine, job), media_type="text/event-stream", headers=headers)
        self.engine, self.job = engine, job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close(self.engine, self.job)


def new_job(kind: str, model: str, prompt_lens: list[int], stops: tuple[str, ...],
            include_usage: bool, request_id: str | None) -> Job:
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    api_id = request_id or f"{prefix}-{uuid.uuid4().hex}"
    return Job(kind, api_id, model, [], prompt_lens, stops, asyncio.Queue(), include_usage)


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
    outs = [final[rid].outputs[0] for rid in job.request_ids]
    choices = []
    for i, o in enumerate(outs):
        body = ({"text": o.text, "logprobs": None} if job.kind == "completion" else
                {"message": {"role": "assistant", "content": o.text}, "logprobs": None})
        choices.append({"index": i, **body, "finish_reason": o.finish_reason})
    return {**_head(job, "text_completion" if job.kind == "completion" else "chat.completion"),
            "choices": choices, "usage": _usage(job, [len(o.token_ids) for o in outs])}


async def stream(engine: AsyncEngine, job: Job) -> AsyncIterator[str]:
    """Server-sent events: deltas per choice (or an error event on failure), then ``[DONE]``."""
    obj = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
    index = {rid: i for i, rid in enumerate(job.request_ids)}
    sent = [""] * len(index)
    tokens = [0] * len(index)
    done: set[int] = set()
    extra = {"usage": None} if job.include_usage else {}

    def event(i: int, text: str | None, finish: str | None, role: bool = False) -> str:
        choice: dict[str, Any]
        if job.kind == "completion":
            choice = {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
        else:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _sse({**_head(job, obj), "choices": [choice], **extra})

    try:
        if job.kind == "chat":
            for i in range(len(sent)):
                yield event(i, "", None, role=True)
        while len(done) < len(sent):
            latest = {}
            out = await job.outputs.get()
            while True:  # outputs are cumulative: only the newest one per choice matters
                latest[out.request_id] = out
                if job.outputs.empty():
                    break
                out = job.outputs.get_nowait()
            for rid, out in latest.items():
                i, o = index[rid], out.outputs[0]
                if i in done:
                    continue
                if o.finish_reason == "error":
                    err = server_error(o.error or "the request failed")
                    yield _sse(err.body())
                    yield "data: [DONE]\n\n"
                    return
                tokens[i] = len(o.token_ids)
                text = o.text if out.finished else _settled(o.text, job.stops)
                delta = text[len(sent[i]):] if text.startswith(sent[i]) else ""
                if out.finished:
                    done.add(i)
                    yield event(i, delta, o.finish_reason)
                elif delta:
                    sent[i] += delta
                    yield event(i, delta, None)
        if job.include_usage:
            yield _sse({**_head(job, obj), "choices": [], "usage": _usage(job, tokens)})
        yield "data: [DONE]\n\n"
    finally:  # normal end, error, or the client went away (cancellation)
        close(engine, job)


def _settled(text: str, stops: tuple[str, ...]) -> str:
    """The part of a running choice's text that can no longer change."""
    text = text.rstrip("\ufffd")  # an incomplete UTF-8 character at the end
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return text[: len(text) - hold]


def _head(job: Job, obj: str) -> dict[str, Any]:
    return {"id": job.api_id, "object": obj, "created": int(time.time()), "model": job.model}


def _usage(job: Job, completion_tokens: list[int]) -> dict[str, int]:
    prompt = sum(job.prompt_lens)
    completion = sum(completion_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"

