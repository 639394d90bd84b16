"""vLLM's and OpenAI's request parameters end to end: one live server (the tiny random Qwen3
of ``server_helpers.py``, n-gram speculation on, a --chat-template that reads a
chat_template_kwargs variable, prompt-token details on) driven with the ``openai`` client,
against an offline ``LLM`` decoding with the same SamplingParams; vLLM's extra endpoints.

The parts without an engine are in ``test_openai_requests.py`` (validation, SamplingParams),
``test_openai_responses.py`` (logprob shapes, bodies, streams) and ``test_serve_cli.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from server_helpers import (  # noqa: E402
    ENGINE,
    GREETING_TEMPLATE,
    MODEL,
    LiveServer,
    chat_model,  # noqa: F401
)

from specstream import LLM, SamplingParams  # noqa: E402
from specstream.engine.request import RequestOutput  # noqa: E402


@pytest.fixture(scope="module")
def live(chat_model: Path) -> Iterator[LiveServer]:  # noqa: F811
    server = LiveServer(LLM(chat_model, **ENGINE), chat_template=GREETING_TEMPLATE,
                        enable_prompt_tokens_details=True)
    yield server
    server.close()


@pytest.fixture(scope="module")
def offline(chat_model: Path) -> Iterator[LLM]:  # noqa: F811
    llm = LLM(chat_model, **ENGINE)
    yield llm
    llm.close()


PROMPT = "def step(self):"


def offline_out(llm: LLM, prompt: Any, **params: Any) -> Any:
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def engine_out(llm: LLM, ids: list[int], **params: Any) -> RequestOutput:
    """The engine's own final output (with its prompt logprobs)."""
    rid = llm.engine.add_request(ids, SamplingParams(**params))
    while True:
        for out in llm.engine.step():
            if out.request_id == rid and out.finished:
                return out


@pytest.mark.parametrize("extra, changes", [
    ({"presence_penalty": 1.5}, True), ({"frequency_penalty": 1.5}, True),
    ({"repetition_penalty": 1.5}, True), ({"min_tokens": 6}, False),
    ({"min_p": 0.3, "temperature": 1.0, "seed": 11}, False),
])
def test_sampling_fields_reach_the_engine(live: LiveServer, offline: LLM, extra: dict[str, Any],
                                          changes: bool) -> None:
    """Each field changes the output exactly as SamplingParams does offline (greedy unless
    seeded), through the openai client's own arguments or extra_body."""
    kw = {"temperature": 0.0, **extra}
    own = {k: kw.pop(k) for k in ("presence_penalty", "frequency_penalty", "seed",
                                  "temperature") if k in kw}
    got = live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                           best_of=1, user="u", extra_body=kw, **own)
    want = offline_out(offline, PROMPT, max_tokens=12, **{**own, **kw})
    assert got.choices[0].text == want.outputs[0].text
    if changes:  # the field did something: the random model's text changes once it repeats
        # a token (the chat model is trained on this repository's sources, so whether its
        # first 12 tokens repeat one changes with them; 48 tokens always have)
        plain = offline_out(offline, PROMPT, max_tokens=48, temperature=0.0).outputs[0]
        assert len(set(plain.token_ids)) < len(plain.token_ids)
        longer = offline_out(offline, PROMPT, max_tokens=48, **{**own, **kw}).outputs[0]
        assert longer.token_ids != plain.token_ids, extra


def test_logit_bias_and_stop_token_ids(live: LiveServer, offline: LLM) -> None:
    plain = offline_out(offline, PROMPT, max_tokens=8, temperature=0.0).outputs[0]
    first = plain.token_ids[0]
    client = live.client()
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    logit_bias={str(first): -100})
    ids = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    logit_bias={str(first): -100}, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True})
    assert ids.choices[0].logprobs.tokens[0] != f"token_id:{first}"
    assert got.choices[0].text == offline_out(offline, PROMPT, max_tokens=8, temperature=0.0,
                                              logit_bias={first: -100}).outputs[0].text
    stop_at = plain.token_ids[3]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"stop_token_ids": [stop_at]})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop_at  # vLLM's field


def test_completion_logprobs_equal_offline(live: LiveServer, offline: LLM) -> None:
    got = live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=10,
                                           temperature=0, logprobs=3)
    want = offline_out(offline, PROMPT, max_tokens=10, temperature=0.0, logprobs=3).outputs[0]
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(want.token_ids)
    assert lp.token_logprobs == pytest.approx([p[t].logprob for t, p in
                                               zip(want.token_ids, want.logprobs)], abs=1e-5)
    for top, logprob in zip(lp.top_logprobs, lp.token_logprobs):
        assert 1 <= len(top) <= 4  # 3 and the token (texts may coincide)
        assert max(top.values()) == pytest.approx(logprob, abs=1e-6)  # greedy: the top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    zero = live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                            temperature=0, logprobs=0)
    assert all(v is not None for v in zero.choices[0].logprobs.token_logprobs)  # not ignored
    assert all(len(t) == 1 for t in zero.choices[0].logprobs.top_logprobs)


def test_lm_eval_loglikelihood_request(live: LiveServer, offline: LLM) -> None:
    """lm-evaluation-harness's local-completions loglikelihood body: token ids, echo,
    logprobs 1, max_tokens 1; it reads token_logprobs[ctxlen:-1] and top_logprobs."""
    ids = offline.tokenizer.encode(PROMPT + " return x")
    body = {"model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    r = httpx.post(live.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    want = engine_out(offline, ids, max_tokens=1, temperature=0.0, logprobs=1,
                      prompt_logprobs=1)
    prompt_lps = [p[t].logprob for t, p in zip(ids[1:], want.prompt_logprobs[1:])]
    assert lp["token_logprobs"][1: len(ids)] == pytest.approx(prompt_lps, abs=1e-5)
    assert all(len(t) in (1, 2) for t in lp["top_logprobs"][1:])
    only = httpx.post(live.url + "/v1/completions", json={**body, "max_tokens": 0}).json()
    assert only["choices"][0]["text"] == offline.tokenizer.decode(ids, skip_special_tokens=False)
    assert len(only["choices"][0]["logprobs"]["tokens"]) == len(ids)
    assert only["usage"]["completion_tokens"] == 0


def test_completion_stream_logprobs_join_to_the_response(live: LiveServer) -> None:
    client = live.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2)
    text = client.completions.create(**kw).choices[0].text
    # a stop string from the text's second half (not across a character's halves)
    stop = next(text[i: i + 2] for i in range(len(text) // 2, len(text) - 1)
                if "\ufffd" not in text[i: i + 2])
    whole = client.completions.create(**kw, stop=[stop]).choices[0]
    chunks = list(client.completions.create(**kw, stop=[stop], stream=True,
                                            stream_options={"include_usage": True,
                                                            "continuous_usage_stats": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    for key in ("tokens", "token_logprobs", "text_offset"):
        joined = sum((getattr(c.choices[0].logprobs, key) for c in chunks if c.choices), [])
        want = getattr(whole.logprobs, key)
        # logprobs of two runs: equal to float rounding (rounds may verify other positions)
        assert joined == (pytest.approx(want, abs=1e-5) if key == "token_logprobs" else want)
    assert all(c.usage is not None for c in chunks)  # continuous usage stats
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        len(whole.logprobs.tokens)


def test_chat_logprobs_stream_and_no_op_fields(live: LiveServer, offline: LLM) -> None:
    messages = [{"role": "user", "content": "hi"}]
    kw: dict[str, Any] = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                              logprobs=True, top_logprobs=2, seed=5, user="u", store=False,
                              response_format={"type": "text"}, metadata={"app": "test"},
                              parallel_tool_calls=False, tool_choice="none", tools=[],
                              service_tier="auto", frequency_penalty=0.0, presence_penalty=0.0)
    whole = live.client().chat.completions.create(**kw).choices[0]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=8, logprobs=2),
                        use_tqdm=False)[0].outputs[0]
    assert whole.message.content == want.text
    content = whole.logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [p[t].logprob for t, p in zip(want.token_ids, want.logprobs)], abs=1e-5)
    assert all(len(c.top_logprobs) == 2 and c.bytes is not None for c in content)
    chunks = list(live.client().chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True,
                                           "continuous_usage_stats": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content or chunks[0].choices[0].finish_reason
    streamed = [c for ch in chunks if ch.choices for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert all(ch.usage is not None for ch in chunks)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0  # enabled on this server


def test_chat_template_kwargs_and_continue_final_message(live: LiveServer) -> None:
    def count(**extra: Any) -> int:
        r = httpx.post(live.url + "/tokenize", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra})
        assert r.status_code == 200, r.text
        return r.json()["count"]

    plain = count()
    assert count(chat_template_kwargs={"greeting": "Hello there"}) > plain  # the --chat-template
    usage = live.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_body={"chat_template_kwargs": {"greeting": "Hello there"}}).usage
    assert usage.prompt_tokens == count(chat_template_kwargs={"greeting": "Hello there"})
    assert count(add_generation_prompt=False) < plain
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    r = httpx.post(live.url + "/tokenize", json={"messages": msgs, "continue_final_message": True,
                                                 "add_generation_prompt": False})
    text = httpx.post(live.url + "/detokenize", json={"tokens": r.json()["tokens"]}).json()
    assert text["prompt"].endswith("assistant\nSure")
    echo = live.client().chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=3, temperature=0,
        extra_body={"echo": True, "continue_final_message": True,
                    "add_generation_prompt": False})
    assert echo.choices[0].message.content.startswith("Sure")


def test_refusals_over_http(live: LiveServer) -> None:
    client = live.client()
    cases = [
        (client.chat.completions.create, dict(messages=[{"role": "user", "content": "x"}],
                                              response_format={"type": "xml"}),
         "response_format"),
        (client.chat.completions.create, dict(
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
        (client.completions.create, dict(prompt="x", n=2, best_of=3), "best_of"),
        (client.completions.create, dict(prompt="x", suffix="y"), "suffix"),
    ]
    for create, kw, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            create(model=MODEL, max_tokens=2, **kw)
        assert err.value.body["param"] == param, err.value.body


@pytest.mark.parametrize("body", [
    # vllm bench serve (openai backend)
    {"prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": 4, "logprobs": None,
     "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True},
    # SGLang's bench_serving with --backend vllm
    {"prompt": PROMPT, "temperature": 0.0, "best_of": 1, "max_tokens": 4, "stream": True,
     "stream_options": {"include_usage": True}, "ignore_eos": True},
    # guidellm
    {"prompt": PROMPT, "max_tokens": 4, "stream": True, "ignore_eos": True,
     "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    # vllm bench serve (openai-chat backend)
    {"messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
     "temperature": 0.0, "max_completion_tokens": 4, "stream": True,
     "stream_options": {"include_usage": True}},
], ids=["vllm-bench", "sglang-bench", "guidellm", "vllm-bench-chat"])
def test_benchmark_client_bodies(live: LiveServer, body: dict[str, Any]) -> None:
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(live.url + route, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and 1 <= last["usage"]["completion_tokens"] <= 4
    if body.get("ignore_eos"):
        assert last["usage"]["completion_tokens"] == 4


def test_vllm_endpoints(live: LiveServer, offline: LLM) -> None:
    assert httpx.get(live.url + "/version").json()["version"]
    assert httpx.get(live.url + "/ping").status_code == 200
    assert httpx.post(live.url + "/ping").status_code == 200
    tok = offline.tokenizer
    r = httpx.post(live.url + "/tokenize", json={"model": MODEL, "prompt": PROMPT,
                                                 "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == offline.engine.max_model_len
    assert r["token_strs"] == [tok.token_str(t) for t in r["tokens"]]
    assert httpx.post(live.url + "/tokenize", json={"prompt": "x"}).json()["token_strs"] is None
    back = httpx.post(live.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    for route, body, status in (("/tokenize", {"model": "other", "prompt": "x"}, 404),
                                ("/detokenize", {"tokens": [10**6]}, 400),
                                ("/tokenize", {"prompt": 5}, 400)):
        r = httpx.post(live.url + route, json=body)
        assert r.status_code == status and "error" in r.json(), r.text
    # what lm-evaluation-harness's remote tokenizer reads (check_remote_tokenizer_support)
    info = httpx.get(live.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["chat_template"] == GREETING_TEMPLATE
    assert "tokenizer_class" in info
    probe = httpx.post(live.url + "/tokenize", json={"prompt": info["eos_token"],
                                                     "add_special_tokens": False}).json()
    assert probe["tokens"] == [tok.eos_token_id]  # how it finds eos_token_id
