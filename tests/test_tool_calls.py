"""Tool calling's pieces without a server: the Hermes / Qwen parser (streamed deltas add up to
the whole reply's message, however the text is split), the grammar of ``tool_choice``
``required`` and named (a call of a given tool, its arguments held to the schema, name first),
and the embedded pair's template with tools, calls and tool results (as transformers renders
it)."""

from __future__ import annotations

import json
import random
from importlib.resources import files
from types import SimpleNamespace
from typing import Any

import pytest

from specstream.server.errors import APIError
from specstream.server.tool_calls import ToolCallParser, parse_tool_calls
from specstream.server.tools import tool_choice_error, tool_constraint

TARGET = files("specstream") / "assets" / "default-target"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}

REPLIES = [
    ("plain text, kept exactly \n\n", "plain text, kept exactly \n\n", []),
    ("Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
     "{\"city\": \"Par}is \\\"x\\\"\", \"unit\": \"c\"}}\n</tool_call>\n<tool_call>\n"
     "{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
     "Sure.", [("get_weather", '{"city": "Par}is \\"x\\"", "unit": "c"}'), ("f", "{}")]),
    ('<tool_call>{"arguments": {"a": [1, {"b": 2}]}, "name": "g"}</tool_call>', None,
     [("g", '{"a": [1, {"b": 2}]}')]),
    ('<tool_call>{"name": "p", "parameters": {"x": 1}}</tool_call>', None, [("p", '{"x": 1}')]),
    ("<tool_call>not json</tool_call> tail", "<tool_call>not json</tool_call> tail", []),
    ('<tool_call>\n{"name": "h", "arguments": {"q": "cut', None, [("h", '{"q": "cut')]),
    ("a <tool x", "a <tool x", []),
    ("a <tool_call", "a <tool_call", []),
]


def _streamed(text: str, cuts: list[int]) -> tuple[str | None, list[tuple[str, str]], set[str]]:
    """Feed ``text`` in the pieces ``cuts`` makes; the content, calls and ids the deltas add up
    to (a call's id and name come once, in its first delta)."""
    parser, content = ToolCallParser(), ""
    calls: dict[int, dict[str, Any]] = {}
    bounds = [0, *cuts, len(text)]
    releases = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
    for r in releases:
        content += r.content
        for d in r.calls:
            body = d.body()
            if "id" in body:
                assert d.index not in calls and body["type"] == "function"
                calls[d.index] = {"id": body["id"], "name": d.name, "arguments": ""}
            calls[d.index]["arguments"] += d.arguments
    pairs = [(c["name"], c["arguments"]) for c in calls.values()]
    return (content or None) if pairs else content, pairs, {c["id"] for c in calls.values()}


@pytest.mark.parametrize("text,content,calls", REPLIES)
def test_parser_whole_reply(text: str, content: str | None, calls: list[tuple[str, str]]):
    got_content, got = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("text,content,calls", REPLIES)
def test_streamed_deltas_add_up_to_the_whole_reply(text: str, content: str | None,
                                                    calls: list[tuple[str, str]]):
    rng = random.Random(len(text))
    splits = [[], list(range(1, len(text)))]
    splits += [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, k))) for k in (2, 5, 9)]
    for cuts in splits:
        got_content, got, ids = _streamed(text, cuts)
        assert (got_content, got) == (content, calls), cuts
        assert len(ids) == len(calls)


def test_arguments_stream_before_the_call_ends():
    """A call in the template's layout is announced once its name is complete, and its
    arguments go out as they are generated, not at ``</tool_call>``."""
    parser = ToolCallParser()
    assert parser.feed("<tool_call>\n{\"name\": \"get_wea").calls == []
    first = parser.feed("ther\", \"arguments\": {\"ci")
    assert [(d.name, d.arguments) for d in first.calls] == [("get_weather", '{"ci')]
    assert first.calls[0].id is not None
    more = parser.feed('ty": "Paris"}}\n</tool')
    assert [(d.id, d.arguments) for d in more.calls] == [(None, 'ty": "Paris"}')]
    assert parser.feed("_call>").calls == [] and parser.finish().content == ""


def _request(**kw: Any) -> Any:
    tools = [SimpleNamespace(function=SimpleNamespace(name="get_weather", parameters=WEATHER)),
             SimpleNamespace(function=SimpleNamespace(name="noop", parameters=None))]
    return SimpleNamespace(**({"tools": tools, "tool_choice": "auto",
                               "parallel_tool_calls": None} | kw))


@pytest.fixture(scope="module")
def grammar_for():
    from specstream.structured.grammar import compile_constraint, grammar_tokenizer
    from specstream.structured.matcher import Matcher
    from specstream.tokenizer import Tokenizer

    tok = Tokenizer(TARGET)
    lltok = grammar_tokenizer(tok.to_json(), (tok.eos_token_id,), None)

    def accepts(constraint, text: str) -> bool:
        matcher = Matcher(lltok, compile_constraint(constraint, lltok), 1 << 16)
        ids = tok.encode(text)
        return matcher.advance(ids) == len(ids) and matcher.accepting

    return accepts


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n' \
       "</tool_call>"
NOOP = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'


def test_required_and_named_grammars(grammar_for):
    required = tool_constraint(_request(tool_choice="required"))
    named = tool_constraint(_request(tool_choice={"type": "function",
                                                  "function": {"name": "noop"}}))
    single = tool_constraint(_request(tool_choice="required", parallel_tool_calls=False))
    assert tool_constraint(_request()) is None
    assert tool_constraint(_request(tool_choice="none")) is None
    assert grammar_for(required, CALL) and grammar_for(required, NOOP)
    assert grammar_for(required, CALL + "\n" + NOOP)
    assert not grammar_for(single, CALL + "\n" + NOOP) and grammar_for(single, CALL)
    assert grammar_for(named, NOOP) and not grammar_for(named, CALL)
    assert not grammar_for(required, CALL.replace('"c"', '"k"'))  # outside the enum
    assert not grammar_for(required, CALL.replace("get_weather", "get_time"))  # no such tool
    assert not grammar_for(required, CALL.replace(', "unit": "c"', ""))  # a required key
    assert not grammar_for(required, '<tool_call>\n{"arguments": {}, "name": "noop"}\n'
                                     "</tool_call>")  # the template's order: name first
    assert not grammar_for(required, "Sure. " + CALL)


def test_parameter_definitions_move_to_the_root(grammar_for):
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}},
              "required": ["p"], "$defs": {"point": {
                  "type": "object", "properties": {"x": {"type": "integer"}},
                  "required": ["x"], "additionalProperties": False}}}
    req = _request(tool_choice="required")
    req.tools[0].function.parameters = params
    constraint = tool_constraint(req)
    assert grammar_for(constraint, '<tool_call>\n{"name": "get_weather", "arguments": '
                                   '{"p": {"x": 3}}}\n</tool_call>')
    assert not grammar_for(constraint, '<tool_call>\n{"name": "get_weather", "arguments": '
                                       '{"p": {"x": "3"}}}\n</tool_call>')
    other = dict(params, **{"$defs": {"point": {"type": "string"}}})
    req.tools[1].function.parameters = other
    with pytest.raises(APIError, match="point"):
        tool_constraint(req)


def test_tool_choice_errors():
    assert tool_choice_error(_request()) is None
    assert tool_choice_error(_request(tool_choice="required")) is None
    assert "needs 'tools'" in tool_choice_error(_request(tools=None, tool_choice="required"))\
        .message
    named = {"type": "function", "function": {"name": "get_time"}}
    assert "not among" in tool_choice_error(_request(tool_choice=named)).message
    assert tool_choice_error(_request(tool_choice="sometimes")).param == "tool_choice"


def test_template_renders_tools_calls_and_results_as_transformers_does():
    transformers = pytest.importorskip("transformers")
    from specstream.tokenizer import Tokenizer

    ours, theirs = Tokenizer(TARGET), transformers.AutoTokenizer.from_pretrained(str(TARGET))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    conv = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "a", "type": "function", "function": {
                    "name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}},
                {"id": "b", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Rome", "unit": "c"}'}}]},
            {"role": "tool", "content": "3C", "tool_call_id": "a"},
            {"role": "tool", "content": "18C", "tool_call_id": "b"}]
    for messages, kw in ((conv, {"tools": tools}), (conv[:2], {"tools": tools}),
                         (conv[:2], {}), (conv[1:2], {})):
        text = ours.apply_chat_template(messages, **kw)
        assert text == theirs.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True, **kw)
    text = ours.apply_chat_template(conv, tools=tools)
    assert json.dumps(tools[0]) in text and text.count("<tool_response>") == 2
    assert '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}' in text
    assert "<|im_start|>user\n<tool_response>\n3C\n</tool_response>\n<tool_response>" in text
    # no tools: the plain ChatML the pair has always had
    assert ours.apply_chat_template(conv[1:2]) == \
        "<|im_start|>user\nWeather in Oslo and Rome?<|im_end|>\n<|im_start|>assistant\n"
