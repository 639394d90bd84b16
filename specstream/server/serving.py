"""Completions and chat completions: prompts -> engine requests -> JSON or server-sent events.

One API request becomes ``len(prompts) * n`` engine requests (ids ``<base>-<k>``, seeds
``derive_seed(seed, i)`` as in :meth:`LLM.generate`) that share one output queue. Streams send
text deltas; text that could still turn out to be the start of a stop string, or an incomplete
UTF-8 character, is held back until it is settled, so the streamed text always equals the final
text. A delta carries the logprobs of the tokens whose text it completes (a token whose text is
held back goes with the delta that releases it), so streamed logprobs join to the
non-streamed ones. A chat stream sends the role with a choice's first text, when the engine
has produced it, as vLLM's first real chunk.

A job's ids are the engine's while it is open: :func:`close` (called once, however the response
ends) hands them back. Closing twice could abort a newer request that reused the ids.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specstream.engine.request import CompletionOutput, RequestOutput
from specstream.sampling_params import SamplingParams, derive_seed
from specstream.server.async_engine import (
    AdmitTimeout,
    AsyncEngine,
    EngineDead,
    QueueFull,
    RequestIdInUse,
)
from specstream.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_body,
    server_error,
)

DISCONNECT_POLL_S = 0.5  # how often a non-streaming handler checks that its client is there
TOP_K_MAX = (1 << 63) - 1
LOGIT_BIAS_MAX = 100.0  # OpenAI clamps biases to [-100, 100]; so does vLLM
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's max_tokens for completions


@dataclass(frozen=True)
class Render:
    """What a job's responses show besides the text: the output options of its request."""

    names: TokenNames  # how tokens are spelled in logprobs
    logprobs: int | None = None  # top logprobs per generated token; None: no logprobs
    echo: bool = False  # completions: the prompt (its text and logprobs) first
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, the one token dropped
    prefix: str = ""  # chat echo: the last (assistant) message's text, before the reply
    continuous_usage: bool = False  # usage on every chunk (stream_options)
    cached_tokens: bool = False  # usage.prompt_tokens_details.cached_tokens
    skip_special_tokens: bool = True  # as the engine decodes the text


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


def sampling_params(req: Any, prompt_len: int, max_model_len: int, param: str,
                    defaults: Mapping[str, Any] | None = None,
                    vocab_size: int | None = None) -> SamplingParams:
    """SamplingParams for one prompt; context violations are 400s naming the field.

    ``defaults`` (from --generation-config: temperature, top_p, top_k, min_p,
    repetition_penalty, max_tokens) fill what the request leaves unset, as vLLM does.
    """
    defaults = defaults or {}
    if prompt_len >= max_model_len:
        raise APIError(400, f"The prompt is {prompt_len} tokens long; the model's context is "
                            f"{max_model_len} tokens.", param=param, code="context_length_exceeded")
    max_tokens = _max_tokens(req, max_model_len - prompt_len, defaults)
    if max_tokens >= 1 and prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"max_tokens ({max_tokens}) + the prompt ({prompt_len} tokens) "
                            f"exceeds the model's context of {max_model_len} tokens.",
                       param="max_tokens", code="context_length_exceeded")
    if isinstance(req, CompletionRequest) and req.echo and max_tokens == 0:
        max_tokens = 1  # vLLM's echo-only request: one token is generated and dropped

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

    temperature = pick("temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise APIError(400, f"temperature must be in [0, 2], got {temperature}",
                       param="temperature")
    top_k = pick("top_k", 0)
    if top_k > TOP_K_MAX:  # the engine keeps top_k in an int64 tensor
        raise APIError(400, f"top_k must be -1, 0 (off) or in [1, {TOP_K_MAX}], got {top_k}",
                       param="top_k")
    chat = isinstance(req, ChatCompletionRequest)
    logprobs = req.top_n if chat else req.logprobs
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo and logprobs is not None:
        prompt_logprobs = logprobs  # vLLM: echo with logprobs returns the prompt's too
    try:
        return SamplingParams(
            temperature=temperature, top_p=pick("top_p", 1.0), top_k=top_k,
            min_p=pick("min_p", 0.0), repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=_logit_bias(req.logit_bias, vocab_size), seed=req.seed,
            max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
            stop_token_ids=req.stop_token_ids or (), ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, n=req.n, best_of=req.best_of)
    except (ValueError, TypeError) as exc:  # the message starts with the field's name
        raise APIError(400, str(exc), param=str(exc).split()[0]) from None


def _max_tokens(req: Any, room: int, defaults: Mapping[str, Any]) -> int:
    """The request's max_tokens; unset: the server's default, else OpenAI's (16 for
    completions, the rest of the context for chat, and for an explicit null)."""
    if isinstance(req, CompletionRequest):
        unset = "max_tokens" not in req.model_fields_set
        asked = None if unset else req.max_tokens
        fallback = DEFAULT_COMPLETION_TOKENS if unset else room
    else:
        asked = req.max_completion_tokens
        asked = req.max_tokens if asked is None else asked
        fallback = room
    if asked is not None:
        return int(asked)
    return min(int(defaults.get("max_tokens", fallback)), room)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> dict[int, float] | None:
    """OpenAI's string keys as token ids, values clamped to [-100, 100] (as vLLM does)."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids (integers), got {key!r}",
                           param="logit_bias") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise APIError(400, f"logit_bias token id {token} is outside the vocabulary "
                                f"[0, {vocab_size})", param="logit_bias")
        out[token] = max(-LOGIT_BIAS_MAX, min(LOGIT_BIAS_MAX, value))
    return out


def render(req: Any, tok: Any, cached_tokens: bool = False) -> Render:
    """How responses to ``req`` are written (its logprobs, echo and usage options)."""
    names = TokenNames(tok, bool(req.return_tokens_as_token_ids))
    chat = isinstance(req, ChatCompletionRequest)
    prefix = ""
    if chat and req.echo and req.messages[-1].role == "assistant":
        prefix = req.messages[-1].text()
    return Render(names=names, logprobs=req.top_n if chat else req.logprobs,
                  echo=not chat and req.echo,
                  echo_only=not chat and req.echo and req.max_tokens == 0, prefix=prefix,
                  continuous_usage=req.stream and req.continuous_usage,
                  cached_tokens=cached_tokens, skip_special_tokens=req.skip_special_tokens)


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


def new_job(kind: str, model: str, prompts: list[list[int]], prompt_texts: list[str | None],
            n: int, stops: tuple[str, ...], render: Render, include_usage: bool,
            request_id: str | None) -> Job:
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    api_id = request_id or f"{prefix}-{uuid.uuid4().hex}"
    return Job(kind, api_id, model, [], prompts, prompt_texts, n, stops, asyncio.Queue(),
               render, include_usage)


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


def response_body(job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
    """The non-streamed response: one choice per finished engine request, in order."""
    choices = [_final_choice(job, i, out) for i, out in enumerate(finals)]
    body = {**_head(job, "text_completion" if job.kind == "completion" else "chat.completion"),
            "choices": choices,
            "usage": _usage(job, [_generated(job, out.outputs[0]) for out in finals],
                            _cached(job, finals))}
    if job.kind == "chat":  # vLLM's field (the prompt's logprobs, when asked for)
        body["prompt_logprobs"] = prompt_logprobs_body(finals[0].prompt_logprobs,
                                                       job.render.names)
    return body


def _final_choice(job: Job, i: int, out: RequestOutput) -> dict[str, Any]:
    o, r = out.outputs[0], job.render
    if job.kind == "chat":
        logprobs = None if r.logprobs is None else {
            "content": chat_logprobs(o.token_ids, o.logprobs, r.logprobs, r.names)}
        return {"index": i, "message": {"role": "assistant", "content": r.prefix + o.text},
                "logprobs": logprobs, "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason}
    ids, positions, text = _completion_tokens(job, i, out, o.token_ids, o.logprobs, o.text)
    logprobs = None if r.logprobs is None else completion_logprobs(
        ids, positions, r.logprobs, r.names)[0]
    return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": _finish(job, o),
            "stop_reason": o.stop_reason,
            "prompt_logprobs": prompt_logprobs_body(out.prompt_logprobs, r.names)}


def _completion_tokens(job: Job, i: int, out: RequestOutput, ids: list[int],
                       positions: list[Any] | None, text: str
                       ) -> tuple[list[int], list[Any] | None, str]:
    """A completion choice's tokens, their logprobs and text, the prompt first with echo
    (only the prompt with echo and max_tokens 0)."""
    r = job.render
    if not r.echo:
        return ids, positions, text
    p = i // job.n
    prompt, prompt_positions = job.prompts[p], out.prompt_logprobs
    if prompt_positions is None:
        prompt_positions = [None] * len(prompt)
    if r.echo_only:
        return prompt, prompt_positions, job.prompt_text(p)
    return prompt + ids, prompt_positions + list(positions or [None] * len(ids)), \
        job.prompt_text(p) + text


def _finish(job: Job, o: CompletionOutput) -> str | None:
    return "length" if job.render.echo_only else o.finish_reason


def _generated(job: Job, o: CompletionOutput) -> int:
    return 0 if job.render.echo_only else len(o.token_ids)


def _cached(job: Job, outs: list[RequestOutput]) -> int:
    """Prompt tokens found in the prefix cache, each prompt counted once (its first choice)."""
    return sum(out.num_cached_tokens for out in outs[::job.n])


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
                generated[i] = _generated(job, o)
                if r.echo_only and not out.finished:
                    continue
                text = o.text if out.finished else _settled(o.text, job.stops)
                delta = text[len(c.text):] if text.startswith(c.text) else ""
                if not delta and not out.finished:
                    continue  # nothing settled yet (a chat choice's role waits for it too)
                c.text += delta
                k = len(o.token_ids) if out.finished else \
                    c.covered(o.token_ids, r.names.tok, r.skip_special_tokens)
                choice = _chunk_choice(job, i, c, out, delta, k)
                c.tokens, c.started, c.done = k, True, out.finished
                chunk = {**_head(job, obj), "choices": [choice], **extra}
                if r.continuous_usage:
                    chunk["usage"] = _usage(job, [generated[i]], None, [i // job.n])
                yield _sse(chunk)
        if job.include_usage:
            usage = _usage(job, generated, sum(cached.values()))
            yield _sse({**_head(job, obj), "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
    finally:  # normal end, error, or the client went away (cancellation)
        close(engine, job)


def _chunk_choice(job: Job, i: int, c: _Choice, out: RequestOutput, delta: str, k: int
                  ) -> dict[str, Any]:
    """One choice of a chunk: ``delta`` and the logprobs of generated tokens ``c.tokens:k``
    (the role, the echo and its logprobs first in a choice's first chunk)."""
    o, r = out.outputs[0], job.render
    ids, positions = o.token_ids[c.tokens:k], (o.logprobs or [])[c.tokens:k] or None
    finish = _finish(job, o) if out.finished else None
    stop_reason = o.stop_reason if out.finished else None
    if job.kind == "chat":
        message: dict[str, str] = {"role": "assistant"} if not c.started else {}
        if delta or not c.started:
            message["content"] = (r.prefix if not c.started else "") + delta
        logprobs = None if r.logprobs is None else {
            "content": chat_logprobs(ids, positions, r.logprobs, r.names)}
        return {"index": i, "delta": message, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": stop_reason}
    if not c.started:
        ids, positions, delta = _completion_tokens(job, i, out, ids, positions, delta)
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


def _head(job: Job, obj: str) -> dict[str, Any]:
    return {"id": job.api_id, "object": obj, "created": int(time.time()), "model": job.model}


def _usage(job: Job, completion_tokens: list[int], cached: int | None,
           prompts: list[int] | None = None) -> dict[str, Any]:
    """Usage of ``prompts`` (default: all, each once) and the given choices' tokens; the
    cached prompt tokens as vLLM's --enable-prompt-tokens-details reports them."""
    lens = [len(job.prompts[p]) for p in (range(len(job.prompts)) if prompts is None
                                         else prompts)]
    prompt, completion = sum(lens), sum(completion_tokens)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    if job.render.cached_tokens and cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
