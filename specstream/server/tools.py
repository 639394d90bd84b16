"""Tool calling: what ``tools`` and ``tool_choice`` ask of a chat completion.

The tools go to the chat template, which lays them out in the system turn; calls come back in
the Hermes / Qwen style the embedded pair's template teaches, one JSON object per call between
``<tool_call>`` and ``</tool_call>`` (``server.tool_calls`` parses them out of the text).

- ``none``: the text is the reply; nothing is parsed.
- ``auto`` (the default when tools are given): the model decides; calls are parsed out.
- ``required``: the output is constrained to one call or more of the given tools (several only
  where ``parallel_tool_calls`` is not false), each ``{"name": ..., "arguments": ...}`` held to
  its function's parameter schema by the grammar, so speculation drafts under it too.
- a named function (``{"type": "function", "function": {"name": ...}}``): one call of it.
"""

from __future__ import annotations

import json
from typing import Any

from specstream.server.errors import APIError
from specstream.structured import JSON_LAYOUT, Constraint

_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_DEFS = ("$defs", "definitions")


def tool_choice_error(req: Any) -> APIError | None:
    """A 400 for a ``tool_choice`` that is not one of OpenAI's, or names no given tool."""
    choice, names = req.tool_choice, [t.function.name for t in req.tools or ()]
    if choice in (None, "none", "auto"):
        return None
    if choice == "required":
        if not names:
            return APIError(400, "tool_choice 'required' needs 'tools'", param="tool_choice")
        return None
    name = _named(choice)
    if name is None:
        return APIError(400, f"'tool_choice' = {json.dumps(choice)[:80]} is not one of 'none', "
                             "'auto', 'required' or {\"type\": \"function\", \"function\": "
                             "{\"name\": ...}}", param="tool_choice")
    if name not in names:
        return APIError(400, f"tool_choice names the function {name!r}, which is not among "
                             "'tools'", param="tool_choice")
    return None


def parses_tool_calls(req: Any) -> bool:
    """Whether the reply's text is parsed for tool calls (tools given, tool_choice not none)."""
    return bool(getattr(req, "tools", None)) and getattr(req, "tool_choice", None) != "none"


def tool_constraint(req: Any) -> Constraint | None:
    """The grammar ``required`` and named choices hold the output to; None for the others."""
    choice = getattr(req, "tool_choice", None)
    if not getattr(req, "tools", None) or choice in (None, "none", "auto"):
        return None
    name = None if choice == "required" else _named(choice)
    tools = [t.function for t in req.tools if name is None or t.function.name == name]
    defs: dict[str, Any] = {}
    calls = [_call_schema(f.name, f.parameters, defs) for f in tools]
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, **({"$defs": defs} if defs else {}), "x-guidance": JSON_LAYOUT}
    repeat = ' ("\\n" call)*' if name is None and req.parallel_tool_calls is not False else ""
    lark = (f"start: call{repeat}\n"
            f'call: "<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"\n')
    return Constraint("lark", lark, "tool_choice")


def _named(choice: Any) -> str | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return str(function["name"])
    return None


def _call_schema(name: str, parameters: dict[str, Any] | None, defs: dict[str, Any]
                 ) -> dict[str, Any]:
    """``{"name": <name>, "arguments": <parameters>}``, name first (the template's order);
    the parameters' ``$defs`` move to the root, where their ``#/$defs/...`` references point."""
    params: dict[str, Any] = dict(parameters) if parameters else dict(_NO_PARAMETERS)
    for key in _DEFS:
        for def_name, value in (params.pop(key, None) or {}).items():
            if defs.setdefault(def_name, value) != value:
                raise APIError(400, f"tools: two functions define {key} {def_name!r} "
                                    "differently; give them distinct names", param="tools")
    text = json.dumps(params)
    if '"#/definitions/' in text:  # the older spelling of the same references
        params = json.loads(text.replace('"#/definitions/', '"#/$defs/'))
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}
