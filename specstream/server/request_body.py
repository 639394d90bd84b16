"""A request body, from bytes to a validated request model; every failure is a 400.

:func:`decode_json` is stricter than ``json.loads``: ``NaN``, ``Infinity``, numbers beyond a
double, integers of over 100 digits and nesting deeper than the recursion limit are 400s. Text
with a lone surrogate (``"\\ud800"`` is valid JSON but no Unicode character) is a 400 naming its
field: no tokenizer can encode it, no response could echo it. :func:`parse_request` turns
pydantic's errors into OpenAI's messages ("Missing required parameter", "Unrecognized request
argument supplied", "Invalid value for ...").
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import ValidationError

from specstream.server.errors import APIError
from specstream.server.field_policy import StrictModel

MAX_INT_DIGITS = 100  # no field takes more (a seed has 20); Python refuses past 4300 anyway


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


def parse_request(cls: type[StrictModel], data: Any) -> Any:
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

