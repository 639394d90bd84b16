"""OpenAI request bodies (pydantic, strict types) and OpenAI-style error bodies.

Requests are validated strictly, as the OpenAI API does: ``"5"`` is not an integer, a field of
the wrong type is a 400 naming the field, and an unrecognised argument is a 400 ("Unrecognized
request argument supplied: foo"). Known OpenAI arguments this server does not implement are
accepted at their no-op values and rejected otherwise, so a client never silently gets
different semantics than it asked for. ``top_k`` and ``ignore_eos`` are vLLM-style extensions.

Bodies are decoded by :func:`decode_json`, stricter than ``json.loads``: ``NaN``, ``Infinity``,
numbers beyond a double, integers of over 100 digits and nesting deeper than the recursion
limit are 400s. Text with a lone surrogate (``"\\ud800"`` is valid JSON but no Unicode
character) is a 400 naming its field: no tokenizer can encode it, no response could echo it.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_INT_DIGITS = 100  # no field takes more (a seed has 20); Python refuses past 4300 anyway


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


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI arguments accepted only at their no-op values (see ``unsupported``).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    # vLLM-style extensions.
    top_k: int = 0
    ignore_eos: bool = False

    def unsupported(self) -> str | None:
        """Name of a known argument set to a value this server does not implement."""
        noop: dict[str, Any] = {"presence_penalty": 0.0, "frequency_penalty": 0.0,
                                "logit_bias": None, "logprobs": None}
        noop.update(self._extra_noop())
        for name, default in noop.items():
            value = getattr(self, name)
            if value != default and not (default is None and value in ({}, False, [])):
                return name
        return None

    def _extra_noop(self) -> dict[str, Any]:
        return {}


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``; ``prompt`` is text, token ids, or a list of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def _extra_noop(self) -> dict[str, Any]:
        return {"echo": False, "best_of": None, "suffix": None}


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


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``; messages are rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None

    def _extra_noop(self) -> dict[str, Any]:
        return {"top_logprobs": None, "tools": None, "tool_choice": None,
                "response_format": None, "parallel_tool_calls": None}


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


def parse_request(cls: type[_SamplingRequest], data: Any) -> _SamplingRequest:
    """Validate a decoded JSON body; every failure becomes a 400 naming the field."""
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    _check_unicode(data)
    try:
        req = cls.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    bad = req.unsupported()
    if bad is not None:
        raise APIError(400, f"'{bad}' is not supported by this server.", param=bad)
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
