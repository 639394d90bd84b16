"""A request's output constraint, from any of the spellings its client uses: OpenAI's
``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``) and older ``guided_*`` fields, and SGLang's
``json_schema``, ``regex`` and ``ebnf``. At most one may be given; anything else is a 400 that
names the field. Whether the grammar compiles is the engine's check (also a 400)."""

from __future__ import annotations

import json
from typing import Any

from specstream.server.errors import APIError
from specstream.structured import Constraint, GrammarError

# vLLM's structured_outputs keys this server has no use for, accepted where they are falsy
_VLLM_OFF = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
             "whitespace_pattern", "structural_tag")


def constraint_of(req: Any) -> Constraint | None:
    found: list[tuple[str, Constraint]] = []
    try:
        found += _response_format(req.response_format)
        found += _structured_outputs(req.structured_outputs)
        for field, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                            ("guided_choice", "choice"), ("guided_grammar", "grammar"),
                            ("json_schema", "json"), ("regex", "regex"), ("ebnf", "ebnf")):
            value = getattr(req, field, None)
            if value is not None:
                found.append((field, _make(kind, value, field)))
    except GrammarError as exc:  # an empty choice or an unknown kind
        raise APIError(400, str(exc), param="structured_outputs") from None
    if len(found) > 1:
        raise APIError(400, "give one output constraint, not "
                            + " and ".join(f"'{name}'" for name, _ in found),
                       param=found[1][0])
    return found[0][1] if found else None


def _response_format(fmt: dict[str, Any] | None) -> list[tuple[str, Constraint]]:
    if fmt is None:
        return []
    kind = fmt.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", Constraint("json_object", source="response_format"))]
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "'response_format' of type json_schema needs "
                                "'json_schema': {'name': ..., 'schema': {...}}",
                           param="response_format")
        return [("response_format", Constraint.json_schema(schema, "response_format"))]
    raise APIError(400, f"'response_format' of type {json.dumps(kind)[:40]} is not supported "
                        "(text, json_object or json_schema)", param="response_format")


def _structured_outputs(spec: Any) -> list[tuple[str, Constraint]]:
    if spec is None:
        return []
    if not isinstance(spec, dict):
        raise APIError(400, "'structured_outputs' must be an object", param="structured_outputs")
    out = []
    for key, value in spec.items():
        if key in _VLLM_OFF and not value:
            continue
        if key == "json_object":
            if value:
                out.append(("structured_outputs",
                            Constraint("json_object", source="structured_outputs")))
        elif key in ("json", "regex", "choice", "grammar"):
            out.append(("structured_outputs", _make(key, value, f"structured_outputs.{key}")))
        else:
            raise APIError(400, f"'structured_outputs.{key}' is not supported (json, regex, "
                                "choice, grammar, json_object)", param="structured_outputs")
    return out


def _make(kind: str, value: Any, field: str) -> Constraint:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise APIError(400, f"'{field}' is not valid JSON", param=field) from None
        if not isinstance(value, dict):
            raise APIError(400, f"'{field}' must be a JSON schema object", param=field)
        return Constraint.json_schema(value, field)
    if kind == "choice":
        if not isinstance(value, list):
            raise APIError(400, f"'{field}' must be a list of strings", param=field)
        return Constraint.choice(value, field)
    if not isinstance(value, str):
        raise APIError(400, f"'{field}' must be a string", param=field)
    return Constraint(kind, value, field)
