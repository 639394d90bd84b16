"""Structured outputs over HTTP with the ``openai`` client, on the embedded pair (specstream,
draft-model speculation): OpenAI's response_format, vLLM's structured_outputs and guided_*, and
SGLang's regex / ebnf fields, streamed and not; a grammar the library rejects is a 400 that
names the field it came in."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from importlib.resources import files
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from server_helpers import MODEL, LiveServer  # noqa: E402

from specstream import LLM  # noqa: E402

TARGET = str(files("specstream") / "assets" / "default-target")
DRAFT = str(files("specstream") / "assets" / "default-draft")
NESTED = {
    "type": "object", "additionalProperties": False, "required": ["title", "author"],
    "properties": {
        "title": {"type": "string", "maxLength": 16},
        "author": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                   "properties": {"name": {"type": "string", "maxLength": 10},
                                  "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    },
}
MESSAGES = [{"role": "user", "content": "Describe a book as JSON."}]


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    server = LiveServer(LLM(TARGET, draft_model=DRAFT, mode="specstream"))
    yield server
    server.close()


def chat(live: LiveServer, **kw: Any) -> Any:
    args: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0)
    return live.client().chat.completions.create(**(args | kw))


def test_response_format_json_schema_nested(live: LiveServer) -> None:
    r = chat(live, response_format={"type": "json_schema", "json_schema": {
        "name": "book", "schema": NESTED, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    book = json.loads(r.choices[0].message.content)
    assert set(book) == {"title", "author"} and set(book["author"]) == {"name", "age"}
    assert 0 <= book["author"]["age"] <= 120


def test_json_object_streamed(live: LiveServer) -> None:
    stream = chat(live, response_format={"type": "json_object"}, stream=True, max_tokens=200)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.startswith("{")  # a prefix of an object even where max_tokens cut it


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{3}"}},
     lambda t: re.fullmatch("[0-9]{3}-[a-z]{3}", t)),
    ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),  # SGLang's field
    ({"ebnf": 'root ::= "<" [a-c]+ ">"'}, lambda t: re.fullmatch("<[a-c]+>", t)),
])
def test_vllm_and_sglang_spellings(live: LiveServer, extra: dict[str, Any], check: Any) -> None:
    r = live.client().completions.create(model=MODEL, prompt="The answer is", max_tokens=24,
                                         temperature=0, extra_body=extra)
    assert r.choices[0].finish_reason == "stop"
    assert check(r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "structured_outputs.regex"),
    ({"extra_body": {"regex": "a", "guided_choice": ["b"]}}, "regex"),  # the second named
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_constraints_are_400s_naming_the_field(live: LiveServer, extra: dict[str, Any],
                                                   field: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(live, **extra)
    assert err.value.body["param"] == field, err.value.body
