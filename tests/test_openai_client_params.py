"""The ``openai`` client (openai-python, as in the dev extra) with the parameters applications
send, against the server: each case gets a 200 and what it asked for; what is not built yet
stays a clear 400 naming the field.

One live server (the tiny model of ``test_server.py``, n-gram speculation on) for the module.
"""

# ruff: noqa: F811  (the tests take the imported fixtures as arguments)
from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

# the live server and tokenizer fixtures of test_client_bodies (module-scoped: one server here)
from test_client_bodies import MESSAGES, PROMPT, server, tok  # noqa: E402, F401
from test_server import MODEL, LiveServer, chat_model  # noqa: E402, F401

# The openai client (openai-python, as in the dev extra) with the parameters applications
# send, each at a typical value; vLLM's own extensions go in extra_body, as vLLM's docs show.
COMPLETIONS_CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "best_of_1": {"best_of": 1},
    "n_2": {"n": 2, "temperature": 0.8, "seed": 3},
    "stop_list": {"stop": ["\n"]},
    "stop_str": {"stop": "self"},
    "seed": {"seed": 7, "temperature": 1.0},
    "top_p": {"top_p": 0.9, "temperature": 0.7},
    "logprobs_2": {"logprobs": 2},
    "logprobs_0": {"logprobs": 0},
    "echo": {"echo": True},
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "logit_bias": {"logit_bias": {"10": -100}},
    "user": {"user": "user-1234"},
    "token_ids_prompt": {"prompt": [5, 6, 7, 8, 9, 10]},
    "batch_prompt": {"prompt": [PROMPT, "import torch\n"]},
    "repetition_penalty": {"extra_body": {"repetition_penalty": 1.1}},
    "top_k_min_p": {"temperature": 0.8, "extra_body": {"top_k": 5, "min_p": 0.1}},
    "min_tokens_stop_token_ids": {"extra_body": {"min_tokens": 4, "stop_token_ids": [0]}},
    "skip_special_tokens": {"extra_body": {"skip_special_tokens": False}},
    "include_stop_str_in_output": {"stop": ["self"],
                                   "extra_body": {"include_stop_str_in_output": True}},
}
CHAT_CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "max_completion_tokens": {"max_completion_tokens": 8, "max_tokens": None},
    "response_format_text": {"response_format": {"type": "text"}},
    "store_false": {"store": False},
    "metadata": {"metadata": {"app": "tests"}},
    "user": {"user": "user-1234"},
    "seed": {"seed": 11, "temperature": 1.0},
    "logprobs": {"logprobs": True},
    "top_logprobs": {"logprobs": True, "top_logprobs": 3},
    "penalties": {"presence_penalty": 0.3, "frequency_penalty": 0.3},
    "logit_bias": {"logit_bias": {"10": -100}},
    "n_2": {"n": 2, "temperature": 0.8},
    "stop": {"stop": ["\n", "self"]},
    "parallel_tool_calls_null": {"parallel_tool_calls": None},
    "temperature_top_p": {"temperature": 0.7, "top_p": 0.9},
    "system_and_history": {"messages": [
        {"role": "system", "content": "You complete Python."},
        {"role": "user", "content": "def main("}, {"role": "assistant", "content": "):"},
        {"role": "user", "content": PROMPT}]},
    "content_parts": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": PROMPT}, {"type": "text", "text": " more"}]}]},
    "chat_template_kwargs": {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
    "add_generation_prompt": {"extra_body": {"add_generation_prompt": True}},
    "repetition_penalty_1": {"extra_body": {"repetition_penalty": 1.0}},
    "min_p_top_k": {"temperature": 0.8, "extra_body": {"min_p": 0.05, "top_k": 10}},
    "min_tokens": {"extra_body": {"min_tokens": 3}},
    "skip_special_tokens_stop_str": {
        "stop": ["self"],
        "extra_body": {"skip_special_tokens": False, "include_stop_str_in_output": True}},
}
# What must stay a 400 that names the field.
REFUSED = [
    ("completions", {"suffix": "\n"}, "suffix"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),  # without tools
    ("chat", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
]


def completion(server: LiveServer, **kw: Any) -> Any:
    args: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    return server.client().completions.create(**(args | kw))


def chat(server: LiveServer, **kw: Any) -> Any:
    args: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    return server.client().chat.completions.create(
        **{k: v for k, v in (args | kw).items() if v is not None or k == "parallel_tool_calls"})


@pytest.mark.parametrize("case", list(COMPLETIONS_CASES))
def test_openai_completions_params(server: LiveServer, tok: Any, case: str) -> None:
    kw = COMPLETIONS_CASES[case]
    out = completion(server, **kw)
    prompts = kw.get("prompt", PROMPT)
    n_prompts = len(prompts) if isinstance(prompts, list) and isinstance(prompts[0], str) else 1
    n = kw.get("n", 1)
    assert sorted(c.index for c in out.choices) == list(range(n_prompts * n))
    for c in out.choices:
        assert isinstance(c.text, str) and c.finish_reason in ("stop", "length")
    assert 0 <= out.usage.completion_tokens <= 6 * n_prompts * n
    text = out.choices[0].text
    if case == "echo":
        assert text.startswith(PROMPT)
    if case.startswith("stop"):
        stop = kw["stop"] if isinstance(kw["stop"], list) else [kw["stop"]]
        assert not any(s in text for s in stop)
    if case == "include_stop_str_in_output" and out.choices[0].finish_reason == "stop":
        assert text.endswith("self")
    if case == "min_tokens_stop_token_ids":
        assert out.usage.completion_tokens >= 4
    if case.startswith("logprobs"):
        lp = out.choices[0].logprobs
        k = kw["logprobs"]
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset)
        assert len(lp.tokens) == out.usage.completion_tokens
        if text.isascii():  # a token may end inside a character (then "bytes:\\x..")
            assert "".join(lp.tokens) == text
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(len(t) <= k + 1 for t in lp.top_logprobs)
        if k:
            assert all(len(t) >= k for t in lp.top_logprobs)


def test_openai_completions_logit_bias_forces_a_token(server: LiveServer, tok: Any) -> None:
    tid = tok.encode("self").ids[0]
    out = completion(server, logit_bias={str(tid): 100}, max_tokens=4)
    assert out.choices[0].text == tok.decode([tid] * 4)


def test_openai_completions_stream_usage(server: LiveServer) -> None:
    chunks = list(completion(server, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_openai_chat_params(server: LiveServer, case: str) -> None:
    kw = CHAT_CASES[case]
    out = chat(server, **kw)
    n = kw.get("n", 1)
    assert sorted(c.index for c in out.choices) == list(range(n))
    for c in out.choices:
        assert c.message.role == "assistant" and isinstance(c.message.content, str)
        assert c.finish_reason in ("stop", "length")
    assert 0 <= out.usage.completion_tokens <= 8 * n
    content = out.choices[0].message.content
    if case == "stop":
        assert "\n" not in content and "self" not in content
    if case == "min_tokens":
        assert out.usage.completion_tokens >= 3
    if case in ("logprobs", "top_logprobs"):
        items = out.choices[0].logprobs.content
        assert len(items) == out.usage.completion_tokens
        if content.isascii():
            assert "".join(i.token for i in items) == content
        for i in items:
            assert i.logprob <= 0 and isinstance(i.bytes, list)
            if i.token.isascii():
                assert bytes(i.bytes) == i.token.encode()
            assert len(i.top_logprobs) == kw.get("top_logprobs", 0)
            if i.top_logprobs:
                assert i.logprob <= i.top_logprobs[0].logprob + 1e-6


def test_openai_chat_stream_usage(server: LiveServer) -> None:
    chunks = list(chat(server, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("kind,kw,field", REFUSED, ids=[f for _, _, f in REFUSED])
def test_openai_unsupported_is_a_clear_400(server: LiveServer, kind: str, kw: dict[str, Any],
                                           field: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        (completion if kind == "completions" else chat)(server, **kw)
    assert err.value.status_code == 400 and field in str(err.value)
