"""A job's server-sent events: text deltas, held-back text and per-delta logprobs.

Streams send text deltas; text that could still turn out to be the start of a stop string, or
an incomplete UTF-8 character, is held back until it is settled, so the streamed text always
equals the final text. A delta carries the logprobs of the tokens whose text it completes (a
token whose text is held back goes with the delta that releases it), so streamed logprobs join
to the non-streamed ones. A chat stream sends the role with a choice's first text, when the
engine has produced it, as vLLM's first real chunk.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specstream.engine.request import RequestOutput
from specstream.server.async_engine import AsyncEngine
from specstream.server.errors import server_error
from specstream.server.logprob_shapes import chat_logprobs, completion_logprobs
from specstream.server.responses import (
    finish_reason,
    generated_tokens,
    head,
    tool_finish_reason,
    usage,
    with_echo,
)
from specstream.server.serving import Job, close
from specstream.server.tool_calls import Release, ToolCallParser


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


@dataclass
class _Choice:
    """What of one choice a stream has sent."""

    text: str = ""  # generated text sent
    tokens: int = 0  # generated tokens whose logprobs went out
    started: bool = False  # its first chunk (role, echo) went out
    done: bool = False
    offset: int = 0  # completions: text_offset of the next token
    # Where each generated token's text ends in the text (tokens that end inside a character
    # are listed once the character is complete); fed by an incremental decoder.
    ends: list[int] = field(default_factory=list)
    decoded: int = 0  # tokens fed to the decoder
    waiting: int = 0  # of those, tokens whose text is not complete yet
    length: int = 0  # characters decoded
    decode: Callable[[int], str | None] | None = None
    tools: ToolCallParser | None = None  # chat with tools: the calls parsed out of the text

    def covered(self, token_ids: list[int], tok: Any, skip_special_tokens: bool) -> int:
        """How many generated tokens the sent text holds in full."""
        if tok is None:
            return len(token_ids)
        if self.decode is None:
            self.decode = tok.decode_stream(skip_special_tokens)
        for token_id in token_ids[self.decoded:]:
            piece = self.decode(token_id)
            self.decoded += 1
            if piece is None:
                self.waiting += 1
                continue
            self.length += len(piece)
            self.ends.extend([self.length] * (self.waiting + 1))
            self.waiting = 0
        return max(self.tokens, bisect.bisect_right(self.ends, len(self.text)))


async def stream(engine: AsyncEngine, job: Job) -> AsyncIterator[str]:
    """Server-sent events: deltas per choice (or an error event on failure), then ``[DONE]``."""
    obj = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
    index = {rid: i for i, rid in enumerate(job.request_ids)}
    choices = [_Choice() for _ in job.request_ids]
    generated = [0] * len(choices)
    cached: dict[int, int] = {}  # prompt -> its tokens found in the prefix cache
    extra = {"usage": None} if job.include_usage else {}
    r = job.render
    try:
        while not all(c.done for c in choices):
            latest = {}
            out = await job.outputs.get()
            while True:  # outputs are cumulative: only the newest one per choice matters
                latest[out.request_id] = out
                if job.outputs.empty():
                    break
                out = job.outputs.get_nowait()
            for rid, out in latest.items():
                i, o = index[rid], out.outputs[0]
                c = choices[i]
                if c.done:
                    continue
                if o.finish_reason == "error":
                    yield _sse(server_error(o.error or "the request failed").body())
                    yield "data: [DONE]\n\n"
                    return
                cached.setdefault(i // job.n, out.num_cached_tokens)
                generated[i] = generated_tokens(job, o)
                if r.echo_only and not out.finished:
                    continue
                text = o.text if out.finished else _settled(o.text, job.stops)
                delta = text[len(c.text):] if text.startswith(c.text) else ""
                if not delta and not out.finished:
                    continue  # nothing settled yet (a chat choice's role waits for it too)
                released = _parse(job, c, delta, out.finished)
                c.text += delta
                if released is not None and not (released.content or released.calls
                                                 or out.finished):
                    continue  # held back (a tag begun): its logprobs go with what follows
                k = len(o.token_ids) if out.finished else \
                    c.covered(o.token_ids, r.names.tok, r.skip_special_tokens)
                choice = _chunk_choice(job, i, c, out, delta, k, released)
                c.tokens, c.started, c.done = k, True, out.finished
                chunk = {**head(job, obj), "choices": [choice], **extra}
                if r.continuous_usage:
                    chunk["usage"] = usage(job, [generated[i]], None, [i // job.n])
                yield _sse(chunk)
        if job.include_usage:
            total = usage(job, generated, sum(cached.values()))
            yield _sse({**head(job, obj), "choices": [], "usage": total})
        yield "data: [DONE]\n\n"
    finally:  # normal end, error, or the client went away (cancellation)
        close(engine, job)


def _parse(job: Job, c: _Choice, delta: str, finished: bool) -> Release | None:
    """A chat choice's text delta through its tool-call parser (None: not parsed)."""
    if not job.render.tool_calls:
        return None
    if c.tools is None:
        c.tools = ToolCallParser()
    released = c.tools.feed(("" if c.started or c.text else job.render.prefix) + delta)
    return released.then(c.tools.finish()) if finished else released


def _chunk_choice(job: Job, i: int, c: _Choice, out: RequestOutput, delta: str, k: int,
                  released: Release | None = None) -> dict[str, Any]:
    """One choice of a chunk: ``delta`` (or what the tool-call parser ``released`` of it) and
    the logprobs of generated tokens ``c.tokens:k`` (the role, the echo and its logprobs first
    in a choice's first chunk)."""
    o, r = out.outputs[0], job.render
    ids, positions = o.token_ids[c.tokens:k], (o.logprobs or [])[c.tokens:k] or None
    finish = finish_reason(job, o) if out.finished else None
    stop_reason = o.stop_reason if out.finished else None
    if job.kind == "chat":
        message: dict[str, Any] = {"role": "assistant"} if not c.started else {}
        if released is not None:
            if released.content or not c.started:
                message["content"] = released.content
            if released.calls:
                message["tool_calls"] = [d.body() for d in released.calls]
            finish = tool_finish_reason(finish, bool(c.tools and c.tools.calls))
        elif delta or not c.started:
            message["content"] = (r.prefix if not c.started else "") + delta
        logprobs = None if r.logprobs is None else {
            "content": chat_logprobs(ids, positions, r.logprobs, r.names)}
        return {"index": i, "delta": message, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": stop_reason}
    if not c.started:
        ids, positions, delta = with_echo(job, i, out, ids, positions, delta)
    lp = None
    if r.logprobs is not None:
        lp, c.offset = completion_logprobs(ids, positions, r.logprobs, r.names, c.offset)
    return {"index": i, "text": delta, "logprobs": lp, "finish_reason": finish,
            "stop_reason": stop_reason}


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


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
