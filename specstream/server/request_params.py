"""What a parsed request asks of the engine and of its responses: :func:`sampling_params`
(one prompt's SamplingParams, the server's --generation-config defaults filling what the
request leaves unset) and :func:`render` (its output options: logprobs, echo, usage)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specstream.sampling_params import SamplingParams
from specstream.server.errors import APIError
from specstream.server.logprob_shapes import TokenNames
from specstream.server.protocol import ChatCompletionRequest, CompletionRequest
from specstream.server.structured_fields import constraint_of
from specstream.server.tools import parses_tool_calls, tool_constraint

TOP_K_MAX = (1 << 63) - 1
LOGIT_BIAS_MAX = 100.0  # OpenAI clamps biases to [-100, 100]; so does vLLM
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's max_tokens for completions


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
    structured, tool = constraint_of(req), tool_constraint(req) if chat else None
    if structured is not None and tool is not None:
        raise APIError(400, f"give one output constraint, not '{structured.source}' and "
                            f"'tool_choice' = {req.tool_choice!r}", param="tool_choice")
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
            prompt_logprobs=prompt_logprobs, n=req.n, best_of=req.best_of,
            structured=structured or tool)
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
    tool_calls: bool = False  # chat: calls are parsed out of the text (server.tool_calls)


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
                  cached_tokens=cached_tokens, skip_special_tokens=req.skip_special_tokens,
                  tool_calls=chat and parses_tool_calls(req))
