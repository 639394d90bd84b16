"""The non-streamed response body of a job, and the pieces streamed chunks share with it
(the head, usage, a completion's echo, its finish reason)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from specstream.engine.request import CompletionOutput, RequestOutput
from specstream.server.logprob_shapes import (
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_body,
)
from specstream.server.tool_calls import parse_tool_calls

if TYPE_CHECKING:
    from specstream.server.serving import Job


def response_body(job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
    """The non-streamed response: one choice per finished engine request, in order."""
    choices = [_final_choice(job, i, out) for i, out in enumerate(finals)]
    body = {**head(job, "text_completion" if job.kind == "completion" else "chat.completion"),
            "choices": choices,
            "usage": usage(job, [generated_tokens(job, out.outputs[0]) for out in finals],
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
        message: dict[str, Any] = {"role": "assistant", "content": r.prefix + o.text}
        finish = o.finish_reason
        if r.tool_calls:
            content, calls = parse_tool_calls(message["content"])
            message = {"role": "assistant", "content": content, "tool_calls": [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
            finish = tool_finish_reason(finish, bool(calls))
        return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": o.stop_reason}
    ids, positions, text = with_echo(job, i, out, o.token_ids, o.logprobs, o.text)
    logprobs = None if r.logprobs is None else completion_logprobs(
        ids, positions, r.logprobs, r.names)[0]
    return {"index": i, "text": text, "logprobs": logprobs,
            "finish_reason": finish_reason(job, o), "stop_reason": o.stop_reason,
            "prompt_logprobs": prompt_logprobs_body(out.prompt_logprobs, r.names)}


def with_echo(job: Job, i: int, out: RequestOutput, ids: list[int],
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


def tool_finish_reason(finish: str | None, called: bool) -> str | None:
    """"tool_calls" where a reply that ended on its own made calls (OpenAI's and vLLM's)."""
    return "tool_calls" if called and finish == "stop" else finish


def finish_reason(job: Job, o: CompletionOutput) -> str | None:
    """The choice's finish reason ("length" for the echo alone: its one token is dropped)."""
    return "length" if job.render.echo_only else o.finish_reason


def generated_tokens(job: Job, o: CompletionOutput) -> int:
    """The choice's tokens that usage counts (none for the echo alone)."""
    return 0 if job.render.echo_only else len(o.token_ids)


def _cached(job: Job, outs: list[RequestOutput]) -> int:
    """Prompt tokens found in the prefix cache, each prompt counted once (its first choice)."""
    return sum(out.num_cached_tokens for out in outs[::job.n])


def head(job: Job, obj: str) -> dict[str, Any]:
    """The fields every response and chunk of the job starts with."""
    return {"id": job.api_id, "object": obj, "created": int(time.time()), "model": job.model}


def usage(job: Job, completion_tokens: list[int], cached: int | None,
          prompts: list[int] | None = None) -> dict[str, Any]:
    """Usage of ``prompts`` (default: all, each once) and the given choices' tokens; the
    cached prompt tokens as vLLM's --enable-prompt-tokens-details reports them."""
    lens = [len(job.prompts[p]) for p in (range(len(job.prompts)) if prompts is None
                                         else prompts)]
    prompt, completion = sum(lens), sum(completion_tokens)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if job.render.cached_tokens and cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out
