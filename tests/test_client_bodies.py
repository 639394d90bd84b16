"""The exact request bodies other projects' clients send, replayed against the server.

What an engineer points at a new server first (SGLang's ``bench_serving.py``, ``vllm bench
serve``, lm-evaluation-harness, guidellm, the ``openai`` client as applications call it) must
get 200s and the response fields that client reads (the `openai` client's cases:
``test_openai_client_params.py``). The bodies below are copied from each
client's source (named above each one); only the model name and the prompt are this test's.
Nothing is downloaded: ``bench/ecosystem_clients.py`` runs the real bench_serving.py.

One live server (the tiny model of ``test_server.py``, n-gram speculation on) for the module.
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

from test_server import ENGINE, MODEL, LiveServer, chat_model  # noqa: E402, F401

from specstream import LLM  # noqa: E402

PROMPT = "def step(self):\n    plan = self.scheduler."
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def server(chat_model: Path) -> Iterator[LiveServer]:  # noqa: F811
    live = LiveServer(LLM(chat_model, **ENGINE))
    yield live
    live.close()


@pytest.fixture(scope="module")
def tok(chat_model: Path) -> Any:  # noqa: F811
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(chat_model / "tokenizer.json"))


def post(server: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, (path, body, r.text)
    return r.json()


def post_stream(server: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``data:`` chunks of a server-sent-event stream, checked to end with ``[DONE]``."""
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        text = r.read().decode()
        assert r.status_code == 200, (path, body, text)
        assert r.headers["content-type"].startswith("text/event-stream")
    data = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert data and data[-1] == "[DONE]", text[-500:]
    return [json.loads(d) for d in data[:-1]]


def streamed_text(chunks: list[dict[str, Any]], chat: bool) -> str:
    key = "delta" if chat else None
    out = ""
    for c in chunks:
        for choice in c["choices"]:
            out += (choice[key].get("content") or "") if key else choice["text"]
    return out


# ---------------------------------------------------------------------------------------------
# SGLang bench_serving.py: sglang 0.5.9 wheel, sglang/bench_serving.py,
# async_request_openai_completions (--backend vllm / sglang-oai / lmdeploy) and
# async_request_openai_chat_completions (--backend vllm-chat / sglang-oai-chat), defaults
# (ignore_eos on, no --extra-request-body). sglang 0.5.23's sglang/benchmark/serving.py builds
# the same two bodies. Neither asks for usage (no stream_options), and both read choices[0] of
# every chunk: a chunk with no choices would fail the request (IndexError).
SGLANG_COMPLETIONS = {"model": MODEL, "prompt": PROMPT, "best_of": 1, "max_tokens": 12,
                      "stream": True, "temperature": 0.0, "ignore_eos": True}
SGLANG_CHAT = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 12, "stream": True,
               "temperature": 0.0, "ignore_eos": True}


def test_sglang_bench_serving_completions(server: LiveServer) -> None:
    chunks = post_stream(server, "/v1/completions", SGLANG_COMPLETIONS)
    assert all(c["choices"] and isinstance(c["choices"][0]["text"], str) for c in chunks)
    assert streamed_text(chunks, chat=False)  # TTFT is taken at the first non-empty text


def test_sglang_bench_serving_chat(server: LiveServer) -> None:
    chunks = post_stream(server, "/v1/chat/completions", SGLANG_CHAT)
    assert all(c["choices"] and "delta" in c["choices"][0] for c in chunks)
    assert streamed_text(chunks, chat=True)


# ---------------------------------------------------------------------------------------------
# vllm bench serve: vllm-project/vllm, vllm/benchmarks/lib/endpoint_request_func.py (commit
# 02cfb534), async_request_openai_completions (--backend openai / vllm) and
# async_request_openai_chat_completions (--backend openai-chat); "temperature": 0.0 is
# vllm/benchmarks/serve.py's default sampling_params (extra_body), "ignore_eos" its
# --ignore-eos; "logprobs" is --logprobs (None by default, sent as null). They read
# choices[0].text / choices[0].delta.content and usage.completion_tokens / prompt_tokens from
# the chunk without choices.
VLLM_COMPLETIONS = {"model": MODEL, "prompt": PROMPT, "repetition_penalty": 1.0,
                    "max_tokens": 12, "logprobs": None, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True,
                    "temperature": 0.0}
VLLM_CHAT = {"model": MODEL,
             "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
             "max_completion_tokens": 12, "stream": True,
             "stream_options": {"include_usage": True}, "ignore_eos": True,
             "temperature": 0.0}
# The same client before vllm moved it into the package: benchmarks/backend_request_func.py
# (commit 01184130, vLLM 0.7/0.8): best_of, no stream_options, chat with max_tokens.
VLLM_OLD_COMPLETIONS = {"model": MODEL, "prompt": PROMPT, "temperature": 0.0, "best_of": 1,
                        "max_tokens": 12, "logprobs": None, "stream": True}
VLLM_OLD_CHAT = {"model": MODEL,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
                 "temperature": 0.0, "max_tokens": 12, "stream": True}


def usage_chunk(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    tail = [c for c in chunks if not c["choices"]]
    assert len(tail) == 1 and tail[0] is chunks[-1], "one usage chunk, last"
    return tail[0]["usage"]


def test_vllm_bench_serve_completions(server: LiveServer, tok: Any) -> None:
    chunks = post_stream(server, "/v1/completions", VLLM_COMPLETIONS)
    assert streamed_text(chunks, chat=False)
    usage = usage_chunk(chunks)
    assert usage["completion_tokens"] == 12  # ignore_eos: exactly max_tokens
    assert usage["prompt_tokens"] == len(tok.encode(PROMPT).ids)


def test_vllm_bench_serve_chat(server: LiveServer) -> None:
    chunks = post_stream(server, "/v1/chat/completions", VLLM_CHAT)
    assert all("delta" in ch for c in chunks for ch in c["choices"])
    # its TTFT is the first chunk with choices: a role-only chunk sent before the engine has
    # produced anything would make it a few milliseconds
    assert chunks[0]["choices"][0]["delta"].get("content"), "role sent before any content"
    assert streamed_text(chunks, chat=True)
    assert usage_chunk(chunks)["completion_tokens"] == 12


@pytest.mark.parametrize("path,body", [("/v1/completions", VLLM_OLD_COMPLETIONS),
                                       ("/v1/chat/completions", VLLM_OLD_CHAT)],
                         ids=["completions", "chat"])
def test_vllm_benchmarks_old_client(server: LiveServer, path: str, body: dict[str, Any]) -> None:
    chunks = post_stream(server, path, body)
    # it reads choices[0] of every chunk: no usage chunk unless asked for
    assert all(c["choices"] for c in chunks)
    assert streamed_text(chunks, chat="messages" in body)


def test_vllm_bench_serve_tokenizer_alignment(server: LiveServer, tok: Any) -> None:
    # vllm/benchmarks/serve.py, _align_prompts_to_server_tokenizer (commit 009e6d4a)
    ids = post(server, "/tokenize", {"model": MODEL, "prompt": PROMPT,
                                     "add_special_tokens": False})["tokens"]
    assert ids == tok.encode(PROMPT).ids
    text = post(server, "/detokenize", {"model": MODEL, "tokens": ids[:5]})["prompt"]
    assert text == tok.decode(ids[:5])


# ---------------------------------------------------------------------------------------------
# lm-evaluation-harness 0.4.13, lm_eval/models/openai_completions.py, LocalCompletionsAPI
# (--model local-completions; tokenized_requests=True, so prompts are token ids, batched).
# Loglikelihood (multiple choice): _create_payload(generate=False); parse_logprobs reads, per
# choice sorted by index, logprobs.token_logprobs[ctxlen:-1] and logprobs.top_logprobs[ctxlen:-1]
# (is_greedy: each token's logprob is the max of its top_logprobs dict).
LM_EVAL_LOGLIKELIHOOD = {"model": MODEL, "prompt": None, "temperature": 0, "max_tokens": 1,
                         "logprobs": 1, "seed": 1234, "echo": True}
# generate_until: _create_payload(generate=True), max_gen_toks 256 by default (16 here), the
# task's `until` plus the tokenizer's eos string as stop; parse_generations reads choices[].text.
LM_EVAL_GENERATE = {"prompt": None, "model": MODEL, "max_tokens": 16, "temperature": 0,
                    "stop": ["\n\n", "<|endoftext|>"], "seed": 1234}
# --model local-chat-completions (LocalChatCompletion._create_payload, --apply_chat_template,
# batch 1): reads choices[].message.content by choices[].index.
LM_EVAL_CHAT = {"messages": MESSAGES, "model": MODEL, "max_tokens": 16, "temperature": 0,
                "stop": ["\n\n", "<|endoftext|>"], "seed": 1234}
# lm-evaluation-harness 0.3.0, lm_eval/models/gpt3.py, GPT3LM._loglikelihood_tokens (sent with
# openai<1 as engine=..., here as model): echo with max_tokens 0 scores the prompt alone,
# logprobs=10; get_result reads token_logprobs[ctxlen:] and the argmax of top_logprobs[i].
LM_EVAL_03_LOGLIKELIHOOD = {"model": MODEL, "prompt": None, "echo": True, "max_tokens": 0,
                            "temperature": 0.0, "logprobs": 10}


def check_echo_logprobs(choice: dict[str, Any], prompt_ids: list[int], generated: int,
                        top: int, tok: Any) -> None:
    lp = choice["logprobs"]
    n = len(prompt_ids) + generated
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert len(lp["text_offset"]) == n and lp["text_offset"][0] == 0
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert lp["token_logprobs"][0] is None  # nothing before the first prompt token
    assert lp["tokens"][:len(prompt_ids)] == [tok.decode([t]) for t in prompt_ids]
    for value, alts in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert isinstance(value, float) and value <= 0
        assert isinstance(alts, dict) and 1 <= len(alts) <= top + 1
        assert all(v <= 0 for v in alts.values())
        assert value <= max(alts.values()) + 1e-6  # lm-eval's is_greedy compares these


def test_lm_eval_loglikelihood(server: LiveServer, tok: Any) -> None:
    batch = [tok.encode(PROMPT).ids, tok.encode("class Scheduler:\n    def").ids]
    out = post(server, "/v1/completions", dict(LM_EVAL_LOGLIKELIHOOD, prompt=batch))
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for choice, ids in zip(choices, batch):
        check_echo_logprobs(choice, ids, generated=1, top=1, tok=tok)
        ctxlen = len(ids) - 3  # the last 3 prompt tokens as the "continuation"
        cont = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        assert len(cont) == 3 and sum(cont) < 0


def test_lm_eval_loglikelihood_is_the_prompts_score(server: LiveServer, tok: Any) -> None:
    """The echoed logprobs are the model's: a continuation scores the same whatever follows."""
    ids = tok.encode(PROMPT).ids
    a = post(server, "/v1/completions", dict(LM_EVAL_LOGLIKELIHOOD, prompt=[ids]))
    b = post(server, "/v1/completions", dict(LM_EVAL_LOGLIKELIHOOD, prompt=[ids[:-2]]))
    la = a["choices"][0]["logprobs"]["token_logprobs"][1:len(ids) - 2]
    lb = b["choices"][0]["logprobs"]["token_logprobs"][1:len(ids) - 2]
    assert la == pytest.approx(lb, abs=1e-4)


def test_lm_eval_03_echo_without_generation(server: LiveServer, tok: Any) -> None:
    ids = tok.encode(PROMPT).ids
    out = post(server, "/v1/completions", dict(LM_EVAL_03_LOGLIKELIHOOD, prompt=[ids]))
    check_echo_logprobs(out["choices"][0], ids, generated=0, top=10, tok=tok)
    assert out["usage"]["completion_tokens"] == 0


def test_lm_eval_generate_until(server: LiveServer, tok: Any) -> None:
    batch = [tok.encode(PROMPT).ids, tok.encode("import torch\n").ids]
    out = post(server, "/v1/completions", dict(LM_EVAL_GENERATE, prompt=batch))
    texts = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert not any("\n\n" in t for t in texts)  # stop strings are not returned


def test_lm_eval_local_chat_completions(server: LiveServer) -> None:
    out = post(server, "/v1/chat/completions", LM_EVAL_CHAT)
    assert out["choices"][0]["index"] == 0
    assert isinstance(out["choices"][0]["message"]["content"], str)


def test_lm_eval_remote_tokenizer(server: LiveServer, tok: Any) -> None:
    # lm_eval/utils.py 0.4.13: check_remote_tokenizer_support and RemoteTokenizer, which
    # local-completions uses instead of a local tokenizer when the server has them
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and "chat_template" in info
    ids = post(server, "/tokenize", {"prompt": "test", "add_special_tokens": False})["tokens"]
    assert ids == tok.encode("test").ids
    assert post(server, "/detokenize", {"tokens": ids})["prompt"] == "test"


# ---------------------------------------------------------------------------------------------
# guidellm 0.8.1, guidellm/backends/openai/request_handlers.py: TextCompletionsRequestHandler
# and ChatCompletionsRequestHandler.format (streamed, a fixed output length, no prefix); it
# reads choices[0].text / delta.content and the usage of every chunk that has one.
GUIDELLM_COMPLETIONS = {"model": MODEL, "stream": True,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                        "max_tokens": 12, "stop": None, "ignore_eos": True, "prompt": PROMPT}
GUIDELLM_CHAT = {"model": MODEL, "stream": True,
                 "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                 "max_completion_tokens": 12, "stop": None, "ignore_eos": True,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]}


@pytest.mark.parametrize("path,body", [("/v1/completions", GUIDELLM_COMPLETIONS),
                                       ("/v1/chat/completions", GUIDELLM_CHAT)],
                         ids=["completions", "chat"])
def test_guidellm_continuous_usage(server: LiveServer, path: str, body: dict[str, Any]) -> None:
    chunks = post_stream(server, path, body)
    assert streamed_text(chunks, chat="messages" in body)
    assert all(c.get("usage") for c in chunks), "continuous_usage_stats: usage on every chunk"
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12
    assert usage_chunk(chunks)["total_tokens"] == (chunks[-1]["usage"]["prompt_tokens"] + 12)
