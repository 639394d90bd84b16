"""Tool calling over HTTP with the ``openai`` client, on the embedded pair (specstream,
draft-model speculation): ``tool_choice`` required and named give calls of the given tools with
arguments that meet their schemas, streamed as ``tool_calls`` deltas that add up to the
non-streamed message; ``auto`` leaves a reply without calls as it is; calls and tool results in
the history go to the template; bad tool requests are 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib.resources import files
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from server_helpers import MODEL, LiveServer  # noqa: E402

from specstream import LLM  # noqa: E402
from specstream.tokenizer import Tokenizer  # noqa: E402

TARGET = str(files("specstream") / "assets" / "default-target")
DRAFT = str(files("specstream") / "assets" / "default-draft")
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["zone"],
         "properties": {"zone": {"type": "string", "maxLength": 8}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [*MESSAGES,
           {"role": "assistant", "content": None, "tool_calls": [{
               "id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    server = LiveServer(LLM(TARGET, draft_model=DRAFT, mode="specstream"))
    yield server
    server.close()


def chat(live: LiveServer, **kw: Any) -> Any:
    args: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                temperature=0, parallel_tool_calls=False)
    return live.client().chat.completions.create(**(args | kw))


def _meets(name: str, arguments: str) -> None:
    schema = {"get_weather": WEATHER, "get_time": CLOCK}[name]
    args = json.loads(arguments)
    assert set(args) == set(schema["required"])
    for key, value in args.items():
        prop = schema["properties"][key]
        assert isinstance(value, str) and len(value) <= prop.get("maxLength", 99)
        assert value in prop.get("enum", [value])


def test_required_gives_a_call_that_meets_its_schema(live: LiveServer) -> None:
    r = chat(live, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    _meets(call.function.name, call.function.arguments)


def test_named_choice_calls_that_function(live: LiveServer) -> None:
    r = chat(live, tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _meets("get_time", call.function.arguments)


def test_streamed_tool_call_adds_up_to_the_message(live: LiveServer) -> None:
    whole = chat(live, tool_choice="required").choices[0].message.tool_calls
    calls: dict[int, dict[str, str]] = {}
    deltas, finish = 0, None
    for chunk in chat(live, tool_choice="required", stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or ():
                deltas += 1
                if d.id is not None:  # a call's first delta: its id and name
                    assert d.index not in calls and d.type == "function"
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            assert not choice.delta.content
    assert finish == "tool_calls" and deltas > 2  # the arguments came in pieces
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole]


def test_auto_without_a_call_is_the_plain_reply(live: LiveServer) -> None:
    auto, none = chat(live, tool_choice="auto"), chat(live, tool_choice="none")
    plain = none.choices[0].message
    assert plain.tool_calls is None
    if auto.choices[0].message.tool_calls:  # the small pair chose to call: it is parsed
        _meets(auto.choices[0].message.tool_calls[0].function.name,
               auto.choices[0].message.tool_calls[0].function.arguments)
    else:
        assert auto.choices[0].message.content == plain.content
        assert auto.choices[0].finish_reason == none.choices[0].finish_reason


def test_history_with_calls_and_results_reaches_the_template(live: LiveServer) -> None:
    r = chat(live, messages=HISTORY, max_tokens=8)
    text = Tokenizer(TARGET).apply_chat_template(
        [MESSAGES[0], {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
         {"role": "tool", "content": "21 degrees, sunny"}], tools=TOOLS)
    assert "<tool_response>\n21 degrees, sunny\n</tool_response>" in text
    assert r.usage.prompt_tokens == len(Tokenizer(TARGET).encode(text))
    # the reply appended as the client returns it, and asked again
    again = [*MESSAGES, chat(live, tool_choice="required").choices[0].message,
             {"role": "tool", "tool_call_id": "x", "content": "ok"}]
    assert chat(live, messages=again, max_tokens=4).choices[0].finish_reason is not None


@pytest.mark.parametrize("kw,param", [
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ({"messages": [{"role": "user"}]}, "messages"),
])
def test_bad_tool_requests_are_400s(live: LiveServer, kw: dict[str, Any], param: str) -> None:
    args = {k: v for k, v in kw.items() if v is not None}
    if kw.get("tools", 1) is None:
        args["tools"] = openai.NOT_GIVEN
    with pytest.raises(openai.BadRequestError) as err:
        chat(live, **args)
    assert param in (err.value.body or {}).get("param", "")
