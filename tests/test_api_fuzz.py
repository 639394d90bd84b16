"""Property-based fuzzing of the HTTP API (Hypothesis) against the single-process app.

Generated bodies (arbitrary JSON, raw bytes, and OpenAI-shaped bodies whose fields take wrong
types, extreme numbers, NaN/Infinity, lone surrogates and nested junk) go to every route of
``build_app`` over the embedded model, in process (Starlette's TestClient). The properties:
no 5xx, an OpenAI error body on every 4xx, well-formed 200s (a stream ends with ``[DONE]``,
an error event included), and a healthy server afterwards. Deterministic (``derandomize``), a
few hundred requests; valid requests generate at most 16 tokens.
"""

from __future__ import annotations

import json
import math
import string
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specstream import LLM  # noqa: E402

MODEL = "fuzz"
CONTEXT, VOCAB = 8192, 4096  # the embedded target's
ERROR_KEYS = {"message", "type", "param", "code"}
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=list(HealthCheck))

EXTREME_INTS = [0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1,
                10**30, -(10**30)]
EXTREME_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, -0.0, 5e-324, 2.0000001, -1e-9,
                  0.5]
ODD_TEXT = ["", "\ud800", "a\udfffb", "\ud83d\ude00", "\ud83d", "\x00", "é漢字", "\u202e",
            " " * 50, "<|im_end|>"]

texts = st.one_of(
    st.text(st.characters(categories=["L", "N", "P", "S", "Z", "Cc", "Cs"]), max_size=12),
    st.sampled_from(ODD_TEXT))
ints = st.one_of(st.integers(-5, 40), st.sampled_from(EXTREME_INTS), st.integers())
floats = st.one_of(st.floats(-3, 3), st.sampled_from(EXTREME_FLOATS), st.floats())
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
json_values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(texts, inner, max_size=4)),
    max_leaves=10)


# Shaped bodies: every field valid, then (two times in three) one field replaced by a bad
# value, an unknown key added, or a field dropped, so both the engine and every check are hit.
# max_tokens is valid only in 1..4; chat never loses it (its default is the rest of the context).
good_text = st.text(st.characters(categories=["L", "N", "P", "S", "Z"]), max_size=24)
good_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
good_sampling = {
    "max_tokens": st.integers(1, 4),
    "temperature": st.one_of(st.just(0.0), st.floats(0, 2)),
    "top_p": st.floats(0.01, 1),
    "top_k": st.one_of(st.integers(-1, 50), st.just(2**63 - 1)),
    "n": st.integers(1, 3),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1),
                      st.sampled_from([0, 2**64 - 1, -(2**63)])),
    "stop": st.one_of(st.none(), good_text.filter(bool),
                      st.lists(good_text.filter(bool), max_size=3)),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries(
        {"include_usage": st.booleans()})),
    "ignore_eos": st.booleans(),
    "user": good_text,
    "presence_penalty": st.just(0.0),
    "logprobs": st.sampled_from([None, False]),
}
bad_values = st.one_of(json_values, st.sampled_from(EXTREME_INTS), st.sampled_from(EXTREME_FLOATS),
                       st.sampled_from(ODD_TEXT))
completion_fields = {
    "model": st.just(MODEL),
    "prompt": st.one_of(good_text, st.lists(good_text, min_size=1, max_size=4), good_ids,
                        st.lists(good_ids, min_size=1, max_size=3)),
    **good_sampling,
    "echo": st.just(False),
}
message = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant"]),
    "content": st.one_of(good_text, st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": good_text}), max_size=2))})
chat_fields = {
    "model": st.just(MODEL),
    "messages": st.lists(message, min_size=1, max_size=3),
    **good_sampling,
    "max_completion_tokens": st.one_of(st.none(), st.integers(1, 4)),
    "tools": st.sampled_from([None, []]),
}
# bad values that are still safe: a bad max_tokens is never null or a valid large number
bad_max_tokens = st.sampled_from([0, -1, CONTEXT, 2**64, "4", 2.0, True, [], {}])
bad_prompts = st.one_of(
    st.just(list(range(CONTEXT + 1))), st.lists(st.one_of(good_text, good_ids), max_size=3),
    st.lists(st.sampled_from(EXTREME_INTS), min_size=1, max_size=3),
    st.lists(good_text, min_size=5, max_size=6), st.sampled_from(ODD_TEXT), bad_values)
bad_messages = st.one_of(st.lists(st.fixed_dictionaries({
    "role": st.one_of(st.sampled_from(["tool", "x", ""]), bad_values),
    "content": st.one_of(st.sampled_from(ODD_TEXT), bad_values)},
    optional={"name": bad_values, "tool_calls": bad_values}), max_size=3), bad_values)


@st.composite
def shaped(draw: Any, fields: dict[str, Any], required: tuple[str, ...],
           special: dict[str, Any]) -> dict[str, Any]:
    """A body of ``fields`` (``required`` ones always, the rest at random), maybe corrupted."""
    body = {k: draw(v) for k, v in fields.items() if k in required or draw(st.booleans())}
    how = draw(st.sampled_from(["keep", "value", "value", "extra", "drop", "keep"]))
    if how == "value":
        key = draw(st.sampled_from(sorted(fields)))
        body[key] = draw(special.get(key, bad_values))
    elif how == "extra":
        body[draw(good_text)] = draw(json_values)
    elif how == "drop":
        droppable = sorted(set(body) - {"max_tokens"} if "messages" in fields else body)
        if droppable:
            del body[draw(st.sampled_from(droppable))]
    return body


completion_bodies = shaped(completion_fields, ("model", "prompt", "max_tokens"),
                           {"max_tokens": bad_max_tokens, "prompt": bad_prompts,
                            "max_completion_tokens": bad_max_tokens})
chat_bodies = shaped(chat_fields, ("model", "messages", "max_tokens"),
                     {"max_tokens": bad_max_tokens, "max_completion_tokens": bad_max_tokens,
                      "messages": bad_messages})
content_types = st.sampled_from([
    "application/json", "application/json", "application/json", None,
    "application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded"])
request_ids = st.one_of(st.none(), st.text(string.ascii_letters + string.digits + "-_.:",
                                           min_size=1, max_size=40))


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    from starlette.testclient import TestClient

    from specstream.server.app import ServerConfig, build_app

    llm = LLM(mode="resident", device_kv_bytes=64 << 20, max_num_seqs=8)
    config = ServerConfig(model_name=MODEL, max_body_bytes=64_000, max_queue=16, max_n=4,
                          queue_timeout_s=30)
    app = build_app(llm, config)
    try:
        with TestClient(app, raise_server_exceptions=False) as c:
            yield c
            assert_healthy(c, app.state.engine)
    finally:
        llm.close()


def post(client: Any, route: str, body: Any, ctype: str | None = "application/json",
         request_id: str | None = None) -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN stays NaN
    headers = {"content-type": ctype} if ctype else {}
    if request_id:
        headers["x-request-id"] = request_id
    r = client.post(route, content=data, headers=headers)
    check(r)
    return r


def check(r: Any) -> None:
    """The properties every answer must have."""
    assert r.status_code < 500, f"{r.request.method} {r.request.url}: {r.status_code} {r.text}"
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, r.text
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"], r.text
        assert isinstance(err["type"], str) and isinstance(err["param"], (str, type(None)))
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [ln.removeprefix("data: ") for ln in r.text.split("\n\n") if ln]
        assert events and events[-1] == "[DONE]", r.text
        for e in events[:-1]:
            chunk = json.loads(e)
            assert "choices" in chunk or set(chunk) == {"error"}, e
    elif r.request.url.path.startswith("/v1/") and r.request.method == "POST":
        body = r.json()
        assert body["choices"] and all(c["finish_reason"] for c in body["choices"]), r.text
        assert body["usage"]["completion_tokens"] <= 16 * len(body["choices"])


def assert_healthy(client: Any, engine: Any) -> None:
    assert client.get("/health").status_code == 200
    r = post(client, "/v1/completions", {"model": MODEL, "prompt": "def f(x):",
                                         "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 10  # aborts of closed jobs land between engine steps
    while engine.engine.scheduler.requests or engine.engine.kv.device.num_used:
        assert time.monotonic() < deadline, "requests or KV blocks leaked"
        time.sleep(0.02)
    assert not engine._claimed  # every job gave its request ids back


@settings(FUZZ, max_examples=100)
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.one_of(json_values, st.binary(max_size=64)), ctype=content_types)
def test_arbitrary_bodies(client: Any, route: str, body: Any, ctype: str | None) -> None:
    r = post(client, route, body, ctype)
    if ctype is None or ctype.startswith("application/json"):
        assert 400 <= r.status_code < 500, r.text  # not an OpenAI body: a client error
    else:
        assert r.status_code == 415


@settings(FUZZ, max_examples=150)
@given(body=completion_bodies, ctype=content_types, request_id=request_ids)
def test_completion_bodies(client: Any, body: dict[str, Any], ctype: str | None,
                           request_id: str | None) -> None:
    post(client, "/v1/completions", body, ctype, request_id)


@settings(FUZZ, max_examples=100)
@given(body=chat_bodies, ctype=content_types, request_id=request_ids)
def test_chat_bodies(client: Any, body: dict[str, Any], ctype: str | None,
                     request_id: str | None) -> None:
    post(client, "/v1/chat/completions", body, ctype, request_id)


@settings(FUZZ, max_examples=60)
@given(path=st.one_of(
    st.sampled_from(["/v1/models", "/health", "/metrics", "/v1/completions", "/nope",
                     "/v1/models/" + MODEL]),
    texts.map(lambda t: "/v1/models/" + urllib.parse.quote(t.encode("utf-8", "replace")))),
    method=st.sampled_from(["GET", "GET", "POST", "DELETE"]))
def test_other_routes(client: Any, path: str, method: str) -> None:
    r = client.request(method, path)
    check(r)
    if method == "GET" and path in ("/v1/models", "/health", "/metrics"):
        assert r.status_code == 200
    if path == "/metrics" and method == "GET":
        from prometheus_client.parser import text_string_to_metric_families

        assert list(text_string_to_metric_families(r.text))
