"""OpenAI request bodies (pydantic, strict types), OpenAI-style error bodies, logprob shapes.

Requests are validated strictly, as the OpenAI API does: ``"5"`` is not an integer, a field of
the wrong type is a 400 naming the field, and an unrecognised argument is a 400 ("Unrecognized
request argument supplied: foo"). The fields are OpenAI's and vLLM's (same names, defaults and
checks, so vLLM's and SGLang's clients work unchanged). A field this server cannot honour is
accepted only at the values where it changes nothing (``best_of == n``, ``response_format``
text, ``store: false``, ``priority: 0``, ...) and is otherwise a 400 naming it, so a client
never silently gets other semantics than it asked for.

Bodies are decoded by :func:`decode_json`, stricter than ``json.loads``: ``NaN``, ``Infinity``,
numbers beyond a double, integers of over 100 digits and nesting deeper than the recursion
limit are 400s. Text with a lone surrogate (``"\\ud800"`` is valid JSON but no Unicode
character) is a 400 naming its field: no tokenizer can encode it, no response could echo it.

The logprob shapes (:func:`completion_logprobs`, :func:`chat_logprobs`) are pure functions of
the engine's per-position :class:`~specstream.engine.request.Logprob` dicts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specstream.engine.request import Logprob, PositionLogprobs

MAX_INT_DIGITS = 100  # no field takes more (a seed has 20); Python refuses past 4300 anyway
MAX_LOGPROBS = 20  # vLLM's default max_logprobs (and OpenAI's top_logprobs limit)
LOGPROB_FLOOR = -9999.0  # what OpenAI and vLLM send for a log-probability of -inf


class APIError(Exception):
    """An error answered with an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = status if code is None else code

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends it."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def server_error(message: str) -> APIError:
    """A 500 for failures inside the engine (a failed KV transfer, a crashed loop)."""
    return APIError(500, message, type="server_error")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    # Fields accepted only at these values (each does nothing here at them); a reason may
    # follow the values. Anything else is a 400 naming the field.
    NOOP: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def unsupported(self) -> APIError | None:
        """A 400 for the first field set to a value this server does not implement."""
        for name, accepted in self.NOOP.items():
            value = getattr(self, name)
            values = [a for a in accepted if not isinstance(a, _Why)]
            if not any(value == a and type(value) is type(a) for a in values):
                why = next((a.text for a in accepted if isinstance(a, _Why)), "")
                shown = " or ".join(json.dumps(a) for a in values)
                return APIError(400, f"'{name}' = {json.dumps(value)[:80]} is not supported by "
                                     f"this server (it accepts {shown}){why}.", param=name)
        return None


@dataclass(frozen=True)
class _Why:
    text: str


STRUCTURED = _Why(": structured output (JSON mode, schemas, regexes, grammars) is not "
                  "implemented yet")
TOOLS = _Why(": tool calling is not implemented")


class StreamOptions(_Strict):
    include_usage: bool | None = True  # vLLM: stream_options given means usage unless false
    continuous_usage_stats: bool | None = False  # vLLM: usage on every chunk too


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's)."""

    model: str
    max_tokens: int | None = None
    # Sampling: None takes the server's default (--generation-config), else vLLM's.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    best_of: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    # The response's id (as X-Request-Id; the header wins).
    request_id: str | None = None
    # With logprobs: tokens as "token_id:<id>" (text that is not valid UTF-8 stays readable).
    return_tokens_as_token_ids: bool | None = None
    # Accepted at their no-op values (see ``NOOP``).
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    structured_outputs: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None

    NOOP: ClassVar[dict[str, tuple[Any, ...]]] = {
        "store": (None, False, _Why(": responses are not stored")),
        "service_tier": (None, "auto", "default"),
        "spaces_between_special_tokens": (True,),
        "truncate_prompt_tokens": (None,),
        "priority": (0, _Why(": requests are served first come, first served")),
        "use_beam_search": (False,),
        "length_penalty": (1.0, _Why(": it applies to beam search only")),
        "allowed_token_ids": (None,),
        "bad_words": (None, []),
        "logits_processors": (None,),
        **{name: (None, STRUCTURED) for name in (
            "guided_json", "guided_regex", "guided_choice", "guided_grammar",
            "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag",
            "structured_outputs")},
        "cache_salt": (None, _Why(": the prefix cache is shared by all requests")),
        "kv_transfer_params": (None,),
        "vllm_xargs": (None,),
    }

    def unsupported(self) -> APIError | None:
        fmt = self.response_format
        if fmt is not None and fmt != {"type": "text"}:
            kind = fmt.get("type")
            return APIError(400, f"'response_format' of type {json.dumps(kind)[:40]} is not "
                                 f"supported by this server (only {{\"type\": \"text\"}})"
                                 f"{STRUCTURED.text}.", param="response_format")
        return super().unsupported() or self._check()

    def _check(self) -> APIError | None:
        """vLLM's checks across fields."""
        if self.stream_options is not None and not self.stream:
            return APIError(400, "Stream options can only be defined when `stream=True`.",
                            param="stream_options")
        lp = self.prompt_logprobs
        if lp is not None and not 0 <= lp <= MAX_LOGPROBS:
            return APIError(400, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {lp}",
                            param="prompt_logprobs")
        if lp and self.stream:
            return APIError(400, "`prompt_logprobs` are not available when `stream=True`.",
                            param="prompt_logprobs")
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options
                                           and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``; ``prompt`` is text, token ids, or a list of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    prompt_embeds: Any = None

    NOOP: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_SamplingRequest.NOOP, "suffix": (None,), "prompt_embeds": (None,)}

    def _check(self) -> APIError | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            return APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got "
                                 f"{self.logprobs}", param="logprobs")
        if self.max_tokens == 0 and not self.echo:
            return APIError(400, "max_tokens must be >= 1 (0 only with echo, which returns "
                                 "the prompt alone)", param="max_tokens")
        return super()._check()


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


_RENDER_ARGS = {"messages", "add_generation_prompt", "continue_final_message", "chat_template"}


class _ChatTemplateFields(_Strict):
    """How messages are rendered: vLLM's fields, shared by chat and ``/tokenize``."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: Any = None
    tools: list[Any] | None = None

    NOOP: ClassVar[dict[str, tuple[Any, ...]]] = {
        "chat_template": (None, _Why(": templates sent with requests are not trusted; start "
                                     "the server with --chat-template instead")),
        "mm_processor_kwargs": (None,),
        "tools": (None, [], TOOLS),
    }

    def template_check(self) -> APIError | None:
        if self.continue_final_message and "add_generation_prompt" in self.model_fields_set \
                and self.add_generation_prompt:
            return APIError(400, "Cannot set both `continue_final_message` and "
                                 "`add_generation_prompt` to True.",
                            param="continue_final_message")
        return None

    def render_args(self) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """Messages and keyword arguments for ``Tokenizer.apply_chat_template``."""
        messages = [{"role": m.role, "content": m.text()} for m in self.messages]
        kwargs = {k: v for k, v in (self.chat_template_kwargs or {}).items()
                  if k not in _RENDER_ARGS}  # the request's own fields decide those
        if self.documents is not None:
            kwargs["documents"] = self.documents
        kwargs["continue_final_message"] = self.continue_final_message
        kwargs["add_generation_prompt"] = (self.add_generation_prompt
                                           and not self.continue_final_message)
        return messages, kwargs


class ChatCompletionRequest(_ChatTemplateFields, _SamplingRequest):
    """``POST /v1/chat/completions``; messages are rendered with the model's chat template."""

    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's echo: the reply starts with the last message's text when that is the assistant's.
    echo: bool = False
    include_reasoning: bool = True
    reasoning_effort: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    verbosity: str | None = None
    web_search_options: Any = None

    NOOP: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_SamplingRequest.NOOP, **_ChatTemplateFields.NOOP,
        "reasoning_effort": (None,), "modalities": (None, ["text"]), "audio": (None,),
        "prediction": (None,), "functions": (None, [], TOOLS),
        "function_call": (None, "none", TOOLS), "verbosity": (None,),
        "web_search_options": (None,)}

    def _check(self) -> APIError | None:
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            return APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}",
                            param="top_logprobs")
        if top and not self.logprobs:
            return APIError(400, "when using `top_logprobs`, `logprobs` must be set to true.",
                            param="top_logprobs")
        if self.tool_choice not in (None, "none", "auto", "required"):
            return APIError(400, f"'tool_choice' = {json.dumps(self.tool_choice)[:80]} is not "
                                 f"supported by this server (only none){TOOLS.text}.",
                            param="tool_choice")
        return self.template_check() or super()._check()

    @property
    def top_n(self) -> int | None:
        """Top logprobs per token (SamplingParams.logprobs); None without logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeCompletionRequest(_Strict):
    """``POST /tokenize`` with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_ChatTemplateFields):
    """``POST /tokenize`` with messages, rendered as chat completions render them."""

    model: str | None = None
    return_token_strs: bool | None = False

    def unsupported(self) -> APIError | None:
        return super().unsupported() or self.template_check()


class DetokenizeRequest(_Strict):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]


def decode_json(body: bytes) -> Any:
    """A request body as JSON; anything that is not plain JSON is a 400."""
    try:
        return json.loads(body, parse_constant=_no_constant, parse_float=_finite_float,
                          parse_int=_short_int)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        detail = "it is nested too deeply" if isinstance(exc, RecursionError) else exc
        raise APIError(400, f"The request body is not valid JSON: {detail}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _short_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"the integer {text[:24]}... has more than {MAX_INT_DIGITS} digits")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:32]} is out of range")
    return value


def parse_request(cls: type[_Strict], data: Any) -> Any:
    """Validate a decoded JSON body; every failure becomes a 400 naming the field."""
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    _check_unicode(data)
    try:
        req = cls.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    err = req.unsupported()
    if err is not None:
        raise err
    return req


def _check_unicode(data: dict[str, Any]) -> None:
    """A 400 naming the top-level field whose text (or key) holds a lone surrogate."""
    for name, value in data.items():
        if not _valid_text(name):
            raise APIError(400, "A field name is not valid Unicode (it holds a lone surrogate).")
        todo = [value]
        while todo:  # iterative: JSON nesting may be deeper than Python's recursion limit
            item = todo.pop()
            if isinstance(item, str):
                bad = not _valid_text(item)
            elif isinstance(item, dict):
                bad = not all(_valid_text(k) for k in item)
                todo.extend(item.values())
            elif isinstance(item, list):
                bad = False
                todo.extend(item)
            else:
                bad = False
            if bad:
                raise APIError(400, f"Invalid value for '{name}': the text is not valid Unicode "
                                    "(it holds a lone surrogate, \\ud800-\\udfff).", param=name)


def _valid_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    param = loc[0] if loc else None
    if err["type"] == "missing":
        return APIError(400, f"Missing required parameter: '{'.'.join(loc)}'.", param=param)
    if err["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {'.'.join(loc)}",
                        param=param)
    if param == "prompt":
        return APIError(400, "Invalid type for 'prompt': expected a string, an array of "
                             "strings, an array of token ids or an array of such arrays.",
                        param=param)
    where = ".".join(p for p in loc if not _is_type_name(p))
    return APIError(400, f"Invalid value for '{where or param}': {err['msg']}.", param=param)


def _is_type_name(part: str) -> bool:
    """Pydantic puts union member types ("str", "list[int]", "TextPart") into error paths."""
    return "[" in part or part[:1].isupper() or part in {"str", "int", "float", "bool", "dict"}


# ---- logprobs, as OpenAI's responses spell them --------------------------------------------

@dataclass(frozen=True)
class TokenNames:
    """How tokens are written in logprobs: their text (the engine's ``decoded_token``, else
    the tokenizer's), or ``token_id:<id>`` (vLLM's return_tokens_as_token_ids)."""

    tok: Any  # the Tokenizer, or None (token-id models)
    as_ids: bool = False

    def text(self, token_id: int, lp: Logprob | None = None) -> str:
        if self.as_ids or self.tok is None:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tok.decode([token_id], skip_special_tokens=False)

    def bytes(self, token_id: int, text: str) -> list[int]:
        if self.as_ids or self.tok is None:
            return list(text.encode("utf-8"))
        return self.tok.token_bytes(token_id)


def _floor(logprob: float) -> float:
    """JSON has no -inf (nor NaN): OpenAI's floor instead."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _top(position: PositionLogprobs, n: int) -> list[tuple[int, Logprob]]:
    """The ``n`` most likely tokens at a position, most likely first."""
    return sorted(((t, lp) for t, lp in position.items() if lp.rank <= n),
                  key=lambda item: item[1].rank)


Positions = Sequence[PositionLogprobs | None]  # one entry per token (None: no logprobs)


def _position(positions: Positions | None, i: int) -> PositionLogprobs | None:
    return positions[i] if positions is not None and i < len(positions) else None


def completion_logprobs(token_ids: list[int], positions: Positions | None,
                        top_n: int, names: TokenNames, offset: int = 0
                        ) -> tuple[dict[str, list[Any]], int]:
    """Completions ``logprobs`` for ``token_ids`` (``positions[i]`` holds token i's): tokens,
    their log-probabilities, ``top_n`` alternatives (and the token itself) by text, and text
    offsets from ``offset`` on. A position without logprobs (the prompt's first token) has
    null ones. Also returns the offset after the last token."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    for i, token_id in enumerate(token_ids):
        pos = _position(positions, i)
        lp = pos.get(token_id) if pos is not None else None
        text = names.text(token_id, lp)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if pos is None or lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_floor(lp.logprob))
        top: dict[str, float] = {}
        for t, p in [*_top(pos, top_n), (token_id, lp)]:  # tokens of the same text: the likelier
            top.setdefault(names.text(t, p), _floor(p.logprob))
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(token_ids: list[int], positions: Positions | None,
                  top_n: int, names: TokenNames) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` for ``token_ids``: each token with its log-probability, its
    bytes and the ``top_n`` most likely tokens at its position."""
    content = []
    for i, token_id in enumerate(token_ids):
        pos = _position(positions, i)
        lp = pos.get(token_id) if pos is not None else None
        text = names.text(token_id, lp)
        top = [] if pos is None else [
            {"token": (t_text := names.text(t, p)), "logprob": _floor(p.logprob),
             "bytes": names.bytes(t, t_text)} for t, p in _top(pos, top_n)]
        content.append({"token": text,
                        "logprob": LOGPROB_FLOOR if lp is None else _floor(lp.logprob),
                        "bytes": names.bytes(token_id, text), "top_logprobs": top})
    return content


def prompt_logprobs_body(positions: Positions | None, names: TokenNames
                         ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token, ``{token id: {logprob, rank,
    decoded_token}}`` (None for the first token)."""
    if positions is None:
        return None
    return [None if pos is None else {
        str(t): {"logprob": _floor(p.logprob), "rank": p.rank, "decoded_token": names.text(t, p)}
        for t, p in pos.items()} for pos in positions]
