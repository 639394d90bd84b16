"""OpenAI's response shapes without an engine: logprobs (completions, chat, prompt), response
bodies and server-sent event streams built from hand-made engine outputs, and the tokenizer
pieces they rely on (token bytes, continue_final_message)."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest

pytest.importorskip("fastapi")

from specstream.engine.request import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from specstream.llm import default_model_dir  # noqa: E402
from specstream.server import serving  # noqa: E402
from specstream.server.logprob_shapes import (  # noqa: E402
    LOGPROB_FLOOR,
    TokenNames,
    chat_logprobs,
    completion_logprobs,
)
from specstream.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from specstream.server.request_body import parse_request  # noqa: E402
from specstream.server.request_params import render  # noqa: E402
from specstream.server.responses import response_body  # noqa: E402
from specstream.server.stream import stream  # noqa: E402
from specstream.tokenizer import Tokenizer  # noqa: E402


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
                          render(req, tok, cached), req.stream and req.include_usage,
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
        events = [e async for e in stream(FakeEngine(), job)]  # type: ignore[arg-type]
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
    body = response_body(job, [outputs(tok, prompt, ids, final, "d!!")[-1]])
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
    choice = response_body(job, [final])["choices"][0]
    assert choice["text"] == tok.decode(prompt, skip_special_tokens=False) + tok.decode(ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1: len(prompt)] == [-2.0] * (len(prompt) - 1)
    assert lp["token_logprobs"][len(prompt):] == [-0.1 * (j + 1) for j in range(len(ids))]
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])  # logprobs 0: the token alone
    body = response_body(job, [final])
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    # echo with max_tokens 0: the prompt alone (the one generated token dropped)
    job = job_for({"prompt": "x", "logprobs": 1, "echo": True, "max_tokens": 0}, tok, prompt)
    body = response_body(job, [final])
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
    choice = response_body(job, [final])["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello world"}
    assert len(choice["logprobs"]["content"]) == len(ids)  # the echo has none
    assert choice["stop_reason"] is None


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
