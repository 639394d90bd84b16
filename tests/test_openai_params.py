"""vLLM's and OpenAI's request parameters over HTTP, logprob response shapes, vLLM's extra
endpoints and ``specstream serve``'s vLLM spellings.

Pure parts (logprob shapes, response bodies, streams of hand-built engine outputs, request
validation, SamplingParams mapping, CLI parsing) are tested without an engine; one live server
(the tiny random Qwen3 of ``server_helpers.py``, n-gram speculation on) and one offline ``LLM``
check the rest end to end with the ``openai`` client, against offline decoding with the same
SamplingParams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from server_helpers import CHAT_TEMPLATE, ENGINE, MODEL, LiveServer, chat_model  # noqa: E402, F401

from specstream import LLM, SamplingParams  # noqa: E402
from specstream.engine.request import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from specstream.llm import default_model_dir  # noqa: E402
from specstream.server import serving  # noqa: E402
from specstream.server.protocol import (  # noqa: E402
    LOGPROB_FLOOR,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    parse_request,
)
from specstream.tokenizer import Tokenizer  # noqa: E402

# the live server's template also reads a chat_template_kwargs variable
TEMPLATE = CHAT_TEMPLATE + "{% if greeting %}{{ greeting }}{% endif %}"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(default_model_dir("target"))  # byte-level BPE: "é" is two tokens


def position(token: int, logprob: float, others: dict[int, float]) -> dict[int, Logprob]:
    """One position's logprobs: ``token`` and ``others``, ranked by logprob."""
    every = {**others, token: logprob}
    order = sorted(every, key=lambda t: -every[t])
    return {t: Logprob(every[t], order.index(t) + 1, None) for t in every}


# ---- logprob shapes (pure) ------------------------------------------------------------------

def test_completion_logprobs_shape(tok: Tokenizer) -> None:
    ids = tok.encode("ab cd", add_special_tokens=False)
    positions: list[Any] = [None] + [position(t, -0.5 * (j + 1), {7: -0.1, 8: -3.0})
                                     for j, t in enumerate(ids[1:])]
    positions[-1] = position(ids[-1], -math.inf, {7: -0.1})  # -inf is not JSON
    out, end = completion_logprobs(ids, positions, 1, TokenNames(tok), offset=10)
    texts = [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert out["tokens"] == texts
    assert out["token_logprobs"][0] is None and out["top_logprobs"][0] is None  # first prompt
    assert out["token_logprobs"][1:] == [-0.5 * (j + 1) for j in range(len(ids) - 2)] + \
        [LOGPROB_FLOOR]
    # the one most likely token (7) and the token itself, by text
    assert out["top_logprobs"][1] == {tok.decode([7]): -0.1, texts[1]: -0.5}
    assert out["text_offset"][0] == 10 and end == 10 + sum(map(len, texts))
    assert [b - a for a, b in zip(out["text_offset"], out["text_offset"][1:])] == \
        [len(t) for t in texts[:-1]]
    json.dumps(out, allow_nan=False)  # valid JSON: no -inf left
    # two tokens of one text (both halves of a character read "\ufffd"): the likelier stays
    halves = tok.encode("é", add_special_tokens=False)
    same, _ = completion_logprobs(halves[:1], [position(halves[0], -0.5, {halves[1]: -0.2})], 2,
                                  TokenNames(tok))
    assert same["top_logprobs"] == [{"\ufffd": -0.2}]
    as_ids, _ = completion_logprobs(ids, positions, 0, TokenNames(tok, as_ids=True))
    assert as_ids["tokens"] == [f"token_id:{t}" for t in ids]
    assert as_ids["top_logprobs"][1] == {f"token_id:{ids[1]}": -0.5}  # logprobs 0: itself


def test_chat_logprobs_shape(tok: Tokenizer) -> None:
    ids = tok.encode("é!", add_special_tokens=False)
    assert len(ids) == 3  # two byte tokens for é
    positions = [position(t, -1.0, {5: -0.2, 6: -0.7, 9: -4.0}) for t in ids]
    content = chat_logprobs(ids, positions, 2, TokenNames(tok))
    assert [c["logprob"] for c in content] == [-1.0] * 3
    # the bytes of the two halves join to é's UTF-8 (their text alone is "\ufffd")
    assert content[0]["bytes"] + content[1]["bytes"] == list("é".encode())
    assert content[0]["token"] == "\ufffd"
    for c in content:
        assert [t["logprob"] for t in c["top_logprobs"]] == [-0.2, -0.7]
        assert set(c) == {"token", "logprob", "bytes", "top_logprobs"}
        assert all(set(t) == {"token", "logprob", "bytes"} for t in c["top_logprobs"])
    assert chat_logprobs(ids, positions, 0, TokenNames(tok))[0]["top_logprobs"] == []


def test_logprobs_missing_from_the_engine_stay_null(tok: Tokenizer) -> None:
    out, _ = completion_logprobs([5, 6], None, 2, TokenNames(tok))
    assert out["token_logprobs"] == [None, None] and len(out["tokens"]) == 2


# ---- response bodies and streams of hand-built engine outputs (pure) -------------------------

class FakeEngine:
    def __init__(self) -> None:
        self.aborted: list[list[str]] = []

    def abort(self, ids: list[str]) -> None:
        self.aborted.append(ids)


def job_for(req_body: dict[str, Any], tok: Tokenizer, prompt: list[int], cached: bool = False,
            request_ids: tuple[str, ...] = ("r-0",)) -> serving.Job:
    cls = ChatCompletionRequest if "messages" in req_body else CompletionRequest
    req = parse_request(cls, {"model": "m", **req_body})
    kind = "chat" if cls is ChatCompletionRequest else "completion"
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    job = serving.new_job(kind, "m", [prompt], [None], req.n, stops,
                          serving.render(req, tok, cached), req.stream and req.include_usage,
                          "r")
    job.request_ids = list(request_ids)
    return job


def outputs(tok: Tokenizer, prompt: list[int], ids: list[int], final_text: str,
            stop_reason: str | None, rid: str = "r-0") -> list[RequestOutput]:
    """The engine's cumulative outputs, one token more each step (the last one finished)."""
    lps = [position(t, -0.1 * (j + 1), {10: -0.05}) for j, t in enumerate(ids)]
    prompt_lps = [None] + [position(t, -2.0, {10: -0.05}) for t in prompt[1:]]
    outs = []
    for k in range(1, len(ids) + 1):
        done = k == len(ids)
        comp = CompletionOutput(0, final_text if done else tok.decode(ids[:k]), ids[:k],
                                "stop" if done else None, logprobs=lps[:k],
                                stop_reason=stop_reason if done else None)
        outs.append(RequestOutput(rid, None, prompt, [comp], done, prompt_logprobs=prompt_lps,
                                  num_cached_tokens=2))
    return outs


def run_stream(job: serving.Job, outs: list[RequestOutput]) -> list[dict[str, Any]]:
    async def main() -> list[str]:
        async def produce() -> None:
            for o in outs:
                job.outputs.put_nowait(o)
                await asyncio.sleep(0)  # the stream takes each output on its own

        task = asyncio.ensure_future(produce())
        events = [e async for e in serving.stream(FakeEngine(), job)]  # type: ignore[arg-type]
        await task
        return events

    events = asyncio.run(main())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_stream_deltas_carry_the_logprobs_of_their_text(tok: Tokenizer) -> None:
    """Held-back text (a stop string's start, half of é) keeps its tokens' logprobs for the
    delta that releases it: none lost, none twice, and every delta's tokens decode to the
    text sent so far."""
    prompt = tok.encode("x =", add_special_tokens=False)
    ids = tok.encode(" ab é cd!!", add_special_tokens=False)  # ..., " c", "d", "!", "!"
    full = tok.decode(ids)
    final = full[: full.index("d!!")]  # the engine cuts the stop string off
    job = job_for({"prompt": "x", "logprobs": 1, "stream": True, "stop": ["d!!"],
                   "return_tokens_as_token_ids": True}, tok, prompt)
    chunks = run_stream(job, outputs(tok, prompt, ids, final, "d!!"))
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == final
    assert "\ufffd" not in "".join(texts)  # never half a character
    sent_ids: list[int] = []
    for c in chunks[:-1]:
        lp = c["choices"][0]["logprobs"]
        sent_ids += [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        assert tok.decode(sent_ids) == "".join(texts[: chunks.index(c) + 1])
    last = chunks[-1]["choices"][0]
    sent_ids += [int(t.removeprefix("token_id:")) for t in last["logprobs"]["tokens"]]
    assert sent_ids == ids  # every token once, in order (the stop string's too)
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "d!!")
    assert all(c["choices"][0]["stop_reason"] is None for c in chunks[:-1])
    # the streamed logprobs join to the non-streamed ones, text offsets included
    body = serving.response_body(job, [outputs(tok, prompt, ids, final, "d!!")[-1]])
    whole = body["choices"][0]["logprobs"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((c["choices"][0]["logprobs"][key] for c in chunks), []) == whole[key], key


def test_chat_stream_role_comes_with_the_first_text(tok: Tokenizer) -> None:
    prompt = tok.encode("q", add_special_tokens=False)
    ids = tok.encode("é and more", add_special_tokens=False)
    job = job_for({"messages": [{"role": "user", "content": "q"}], "stream": True,
                   "logprobs": True, "top_logprobs": 1,
                   "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                  tok, prompt)
    outs = outputs(tok, prompt, ids, tok.decode(ids), None)
    chunks = run_stream(job, outs)
    first = chunks[0]["choices"][0]
    # the first output is half of é: nothing is sent until the character is whole
    assert first["delta"] == {"role": "assistant", "content": "é"}
    assert [c["token"] for c in first["logprobs"]["content"]] == ["\ufffd", "\ufffd"]
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:-1])
    assert "".join(c["choices"][0]["delta"].get("content", "")
                   for c in chunks[:-1]) == tok.decode(ids)
    # continuous_usage_stats: usage on every chunk, growing; then the usual last usage chunk
    used = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert used == sorted(used) and used[-1] == len(ids) and used[0] == 2
    assert all(c["usage"]["prompt_tokens"] == len(prompt) for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(ids)
    n_lp = sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks[:-1])
    assert n_lp == len(ids)


def test_completion_body_echo_and_cached_tokens(tok: Tokenizer) -> None:
    prompt = tok.encode("x = 1", add_special_tokens=False)
    ids = tok.encode(" + 2", add_special_tokens=False)
    final = outputs(tok, prompt, ids, tok.decode(ids), None)[-1]
    job = job_for({"prompt": "x", "logprobs": 0, "echo": True, "max_tokens": 3}, tok, prompt,
                  cached=True)
    choice = serving.response_body(job, [final])["choices"][0]
    assert choice["text"] == tok.decode(prompt, skip_special_tokens=False) + tok.decode(ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1: len(prompt)] == [-2.0] * (len(prompt) - 1)
    assert lp["token_logprobs"][len(prompt):] == [-0.1 * (j + 1) for j in range(len(ids))]
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])  # logprobs 0: the token alone
    body = serving.response_body(job, [final])
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    # echo with max_tokens 0: the prompt alone (the one generated token dropped)
    job = job_for({"prompt": "x", "logprobs": 1, "echo": True, "max_tokens": 0}, tok, prompt)
    body = serving.response_body(job, [final])
    choice = body["choices"][0]
    assert choice["text"] == tok.decode(prompt, skip_special_tokens=False)
    assert len(choice["logprobs"]["tokens"]) == len(prompt)
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
    assert "prompt_tokens_details" not in body["usage"]  # not enabled


def test_chat_body_echo_prefix_and_logprobs(tok: Tokenizer) -> None:
    ids = tok.encode(" world", add_special_tokens=False)
    final = outputs(tok, [1, 2], ids, tok.decode(ids), None)[-1]
    job = job_for({"messages": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "Hello"}],
                   "echo": True, "continue_final_message": True, "logprobs": True}, tok, [1, 2])
    choice = serving.response_body(job, [final])["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello world"}
    assert len(choice["logprobs"]["content"]) == len(ids)  # the echo has none
    assert choice["stop_reason"] is None


# ---- request validation and SamplingParams (pure) --------------------------------------------

ACCEPTED = {  # what applications and benchmark clients send, at values that work here
    "best_of": 1, "response_format": {"type": "text"}, "store": False, "user": "u",
    "metadata": {"k": "v"}, "service_tier": "auto", "priority": 0, "repetition_penalty": 1.0,
    "min_p": 0.0, "top_k": -1, "min_tokens": 0, "stop_token_ids": [], "ignore_eos": False,
    "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False, "truncate_prompt_tokens": None, "request_id": "abc",
    "seed": 3, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {},
    "use_beam_search": False, "length_penalty": 1.0, "bad_words": [],
}
CHAT_ACCEPTED = {"tools": [], "tool_choice": "none", "parallel_tool_calls": False,
                 "add_generation_prompt": True, "chat_template_kwargs": {"x": 1},
                 "modalities": ["text"], "prompt_cache_key": "k", "documents": None,
                 "top_logprobs": 0, "logprobs": False, "max_completion_tokens": 3}


def test_accepted_fields() -> None:
    parse_request(CompletionRequest, {"model": "m", "prompt": "x", **ACCEPTED, "echo": True,
                                      "logprobs": 0, "suffix": None})
    parse_request(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": "x"}], **ACCEPTED, **CHAT_ACCEPTED})


@pytest.mark.parametrize("kind, extra, param", [
    ("completion", {"suffix": "x"}, "suffix"),
    ("completion", {"logprobs": 21}, "logprobs"),
    ("completion", {"logprobs": -1}, "logprobs"),
    ("completion", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ("completion", {"response_format": {"type": "json_object"}}, "response_format"),
    ("completion", {"stream_options": {"include_usage": True}}, "stream_options"),  # no stream
    ("completion", {"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("completion", {"priority": 1}, "priority"),
    ("completion", {"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    ("completion", {"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ("completion", {"store": True}, "store"),
    ("completion", {"guided_json": {"type": "object"}}, "guided_json"),
    ("completion", {"use_beam_search": True}, "use_beam_search"),
    ("completion", {"prompt_embeds": "abc"}, "prompt_embeds"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("chat", {"continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("chat", {"audio": {"voice": "x"}}, "audio"),
])
def test_refused_fields_name_themselves(kind: str, extra: dict[str, Any], param: str) -> None:
    if kind == "chat":
        cls: Any = ChatCompletionRequest
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
    else:
        cls, body = CompletionRequest, {"model": "m", "prompt": "x", **extra}
    with pytest.raises(APIError) as err:
        parse_request(cls, body)
    assert err.value.status == 400 and err.value.param == param, err.value.message
    text = err.value.message.lower()
    assert param in text or param.replace("_", " ") in text  # the message names it too


def params_for(body: dict[str, Any], prompt_len: int = 4, defaults: Any = None,
               vocab: int | None = 100) -> SamplingParams:
    cls = ChatCompletionRequest if "messages" in body else CompletionRequest
    req = parse_request(cls, {"model": "m", **body})
    return serving.sampling_params(req, prompt_len, 64, "prompt", defaults, vocab)


def test_sampling_params_from_requests() -> None:
    p = params_for({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -0.5,
                    "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2, "top_k": 5,
                    "logit_bias": {"7": 150, "9": -3.5}, "stop_token_ids": [4],
                    "include_stop_str_in_output": True, "skip_special_tokens": False,
                    "logprobs": 0, "best_of": 1, "seed": 1})
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.min_p, p.min_tokens, p.top_k, p.stop_token_ids) == (0.1, 2, 5, (4,))
    assert p.logit_bias == {7: 100.0, 9: -3.5}  # clamped to OpenAI's [-100, 100]
    assert p.include_stop_str_in_output and not p.skip_special_tokens
    assert p.logprobs == 0 and p.prompt_logprobs is None and p.max_tokens == 16
    # echo with logprobs: the prompt's logprobs too; echo with max_tokens 0 runs one token
    p = params_for({"prompt": "x", "echo": True, "logprobs": 2, "max_tokens": 0})
    assert (p.prompt_logprobs, p.logprobs, p.max_tokens) == (2, 2, 1)
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert params_for({**chat, "logprobs": True, "top_logprobs": 3}).logprobs == 3
    assert params_for({**chat, "logprobs": True}).logprobs == 0
    assert params_for({**chat, "top_logprobs": 0}).logprobs is None
    assert params_for(chat).max_tokens == 60  # the rest of the context
    for bias, msg in (({"x": 1.0}, "integers"), ({"100": 1.0}, "outside the vocabulary")):
        with pytest.raises(APIError) as err:
            params_for({"prompt": "x", "logit_bias": bias})
        assert err.value.param == "logit_bias" and msg in err.value.message
    for body, param in (({"prompt": "x", "best_of": 2}, "best_of"),
                        ({"prompt": "x", "presence_penalty": 3.0}, "presence_penalty"),
                        ({"prompt": "x", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
                        ({"prompt": "x", "min_p": 1.5}, "min_p")):
        with pytest.raises(APIError) as err:
            params_for(body)
        assert err.value.param == param, err.value.message


def test_generation_config_defaults_fill_unset_fields() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                "repetition_penalty": 1.1, "max_tokens": 30}
    p = params_for({"prompt": "x"}, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
        (0.6, 0.9, 20, 0.05, 1.1, 30)
    p = params_for({"prompt": "x", "temperature": 0, "top_k": 0, "max_tokens": 5},
                   defaults=defaults)  # what a request sets wins
    assert (p.temperature, p.top_k, p.max_tokens, p.top_p) == (0, 0, 5, 0.9)
    p = params_for({"messages": [{"role": "user", "content": "x"}]}, prompt_len=50,
                   defaults=defaults)
    assert p.max_tokens == 14  # the default never runs past the context


# ---- specstream serve: vLLM's spellings (pure) ----------------------------------------------

def serve_args(*argv: str) -> argparse.Namespace:
    from specstream.server.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_positional_model_and_vllm_flags(tmp_path: Path) -> None:
    from specstream.server.cli import apply_speculative_config

    args = apply_speculative_config(serve_args(str(tmp_path), "--enable-prompt-tokens-details"))
    assert args.model == str(tmp_path) and args.enable_prompt_tokens_details
    same = apply_speculative_config(serve_args(str(tmp_path), "--model", str(tmp_path)))
    assert same.model == str(tmp_path)
    with pytest.raises(ValueError, match="given twice"):
        apply_speculative_config(serve_args(str(tmp_path), "--model", str(tmp_path / "x")))
    assert serve_args().generation_config == "auto"  # vLLM's default


@pytest.mark.parametrize("config, want", [
    ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}',
     ("ngram", None, 5)),  # vLLM's documented example
    ('{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}', ("ngram", None, None)),
    ('{"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1, '
     '"max_model_len": null, "disable_by_batch_size": null, "enforce_eager": true}',
     ("draft", "d", 2)),
])
def test_speculative_config_takes_vllms_keys(config: str, want: tuple[Any, ...]) -> None:
    from specstream.server.cli import apply_speculative_config

    args = apply_speculative_config(serve_args("--speculative-config", config))
    assert (args.proposer, args.draft_model, args.num_speculative_tokens) == want


@pytest.mark.parametrize("config, message", [
    ('{"method": "ngram", "prompt_lookup_min": 2}', "prompt_lookup_min 2 cannot be honoured"),
    ('{"method": "ngram", "prompt_lookup_max": 5}', "longest earlier match of the last 1 to 4"),
    ('{"model": "d", "draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size 2"),
    ('{"model": "d", "max_model_len": 512}', "max_model_len 512 cannot be honoured"),
    ('{"model": "d", "quantization": "fp8"}', 'quantization "fp8" cannot be honoured'),
])
def test_speculative_config_says_what_it_cannot_honour(config: str, message: str) -> None:
    from specstream.server.cli import speculative_config

    with pytest.raises(argparse.ArgumentTypeError) as err:
        speculative_config(config)
    assert message in str(err.value)


def test_generation_config_and_chat_template_options(tmp_path: Path) -> None:
    from specstream.server.cli import generation_defaults, load_chat_template

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_new_tokens": 64,
         "do_sample": True, "eos_token_id": 2}))
    want = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_tokens": 64}
    assert generation_defaults("auto", str(tmp_path)) == want
    assert generation_defaults(str(tmp_path), None) == want  # DIR
    assert generation_defaults("vllm", str(tmp_path)) == {}
    assert generation_defaults("auto", str(tmp_path / "none")) == {}  # no file: no defaults
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(str(tmp_path / "none"), None)
    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match="temperature"):
        generation_defaults("auto", str(tmp_path))
    file = tmp_path / "t.jinja"
    file.write_text("{{ messages[0]['content'] }}é")
    assert load_chat_template(str(file)) == "{{ messages[0]['content'] }}é"
    assert load_chat_template("{% for m in messages %}{{ m.content }}\\n{% endfor %}") == \
        "{% for m in messages %}{{ m.content }}\n{% endfor %}"  # shell escapes, as vLLM
    with pytest.raises(ValueError, match="neither a file nor a template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_tokenizer_bytes_and_continue_final_message(tok: Tokenizer) -> None:
    text = "héllo 漢字 <|im_end|> x"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(bytes(tok.token_bytes(t)) for t in ids) == text.encode()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=False,
                                       continue_final_message=True)
    assert rendered.endswith("assistant\nSure, ")  # no end-of-turn after the last message
    assert tok.apply_chat_template(msgs[:1], chat_template="{{ a }}:{{ messages[0].content }}",
                                   a="v") == "v:hi"


# ---- end to end: the openai client against a live server -------------------------------------

@pytest.fixture(scope="module")
def live(chat_model: Path) -> Iterator[LiveServer]:  # noqa: F811
    server = LiveServer(LLM(chat_model, **ENGINE), chat_template=TEMPLATE,
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
    plain = offline_out(offline, PROMPT, max_tokens=12, temperature=0.0)
    if changes:  # the field did something (the random model's text changes)
        assert want.outputs[0].token_ids != plain.outputs[0].token_ids, extra


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
                                              response_format={"type": "json_object"}),
         "response_format"),
        (client.chat.completions.create, dict(
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
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
    assert info["eos_token"] == "<|endoftext|>" and info["chat_template"] == TEMPLATE
    assert "tokenizer_class" in info
    probe = httpx.post(live.url + "/tokenize", json={"prompt": info["eos_token"],
                                                     "add_special_tokens": False}).json()
    assert probe["tokens"] == [tok.eos_token_id]  # how it finds eos_token_id


def test_serve_passes_the_options_to_the_server(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``specstream serve MODEL --chat-template ... --generation-config auto ...`` reaches
    the engine's model and the ServerConfig (engine and uvicorn stubbed out)."""
    import uvicorn

    import specstream.server.app
    import specstream.server.cli
    from specstream.cli import main

    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "generation_config.json").write_text('{"temperature": 0.3, "max_new_tokens": 9}')
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    seen: dict[str, Any] = {}

    class Stub:
        def close(self) -> None:
            seen["closed"] = True

    def build_llm(args: argparse.Namespace) -> Stub:
        seen["model"] = args.model
        return Stub()

    monkeypatch.setattr(specstream.server.cli, "build_llm", build_llm)
    monkeypatch.setattr(specstream.server.app, "build_app",
                        lambda llm, config: seen.setdefault("config", config))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    rc = main(["serve", str(folder), "--chat-template", str(tmp_path / "t.jinja"),
               "--enable-prompt-tokens-details"])
    config = seen["config"]
    assert rc == 0 and seen["model"] == str(folder) and seen["closed"]
    assert config.model_name == "my-model" and config.chat_template == TEMPLATE
    assert dict(config.default_sampling) == {"temperature": 0.3, "max_tokens": 9}
    assert config.enable_prompt_tokens_details
    seen.clear()
    assert main(["serve", str(folder), "--generation-config", "vllm"]) == 0
    assert dict(seen["config"].default_sampling) == {} and seen["config"].chat_template is None
