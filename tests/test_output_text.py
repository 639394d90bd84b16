"""The output text as vLLM builds it: grown a token at a time (each step decodes only what its
tokens add), stop strings and stop tokens with ``stop_reason`` and
``include_stop_str_in_output``, ``skip_special_tokens``; on the embedded pair's tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from specstream.engine.llm_engine import LLMEngine
from specstream.llm import LLM
from specstream.sampling_params import SamplingParams
from specstream.tokenizer import Tokenizer

PROMPT = "def schedule(self, requests):\n    "


@pytest.fixture(scope="module")
def llm():
    llm = LLM(mode="specstream", num_speculative_tokens=3, device_kv_bytes=int(4e7))
    yield llm
    llm.close()


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[Any]:
    """Every output the engine reports for one request, step by step."""
    rid = engine.add_request(prompt, params)
    seen = []
    while engine.has_unfinished():
        seen += [o for o in engine.step() if o.request_id == rid]
    return seen


def test_text_grows_incrementally_and_ends_as_a_whole_decode(llm, monkeypatch):
    engine = llm.engine
    decode, decoded = Tokenizer.decode, [0]

    def counting(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        decoded[0] += len(ids)  # the token ids every decode is given
        return decode(self, ids, skip_special_tokens)

    monkeypatch.setattr(Tokenizer, "decode", counting)
    outs = _run(engine, llm.encode(PROMPT), SamplingParams(temperature=0, max_tokens=96,
                                                            ignore_eos=True))
    monkeypatch.undo()
    final = outs[-1].outputs[0]
    assert outs[-1].finished and len(final.token_ids) == 96
    assert final.text == engine.tokenizer.decode(final.token_ids)
    texts = [o.outputs[0].text for o in outs]
    assert len(set(texts)) > 10  # it grew over many steps
    assert all(final.text.startswith(t) for t in texts)
    # the whole output is decoded once, at the end, not at every step (96 x 96 / 2 ids before)
    assert decoded[0] == 96


def test_stop_strings_cut_the_text_and_say_why(llm):
    ids = llm.encode(PROMPT)
    full = _run(llm.engine, ids, SamplingParams(temperature=0, max_tokens=64,
                                                ignore_eos=True))[-1].outputs[0]
    stop = full.text[20:24]
    assert stop and stop in full.text
    at = full.text.find(stop)
    out = _run(llm.engine, ids, SamplingParams(temperature=0, max_tokens=64, stop=[stop, "@@@"],
                                               ignore_eos=True))[-1].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:at]
    kept = _run(llm.engine, ids, SamplingParams(
        temperature=0, max_tokens=64, stop=stop, ignore_eos=True,
        include_stop_str_in_output=True))[-1].outputs[0]
    assert kept.text == full.text[: at + len(stop)] and kept.stop_reason == stop
    # min_tokens: a stop string does not end the request before that many tokens
    late = _run(llm.engine, ids, SamplingParams(temperature=0, max_tokens=64, stop=stop,
                                                ignore_eos=True, min_tokens=len(full.token_ids)))
    assert late[-1].outputs[0].finish_reason == "length"


def test_a_stop_token_ends_without_its_text(llm):
    ids = llm.encode(PROMPT)
    full = _run(llm.engine, ids, SamplingParams(temperature=0, max_tokens=32,
                                                ignore_eos=True))[-1].outputs[0]
    tok = full.token_ids[5]
    first = full.token_ids.index(tok)
    out = _run(llm.engine, ids, SamplingParams(temperature=0, max_tokens=32,
                                               stop_token_ids=[tok]))[-1].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tok
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.text == llm.tokenizer.decode(full.token_ids[:first])
    kept = _run(llm.engine, ids, SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[tok],
                                                include_stop_str_in_output=True))[-1].outputs[0]
    assert kept.text == llm.tokenizer.decode(full.token_ids[: first + 1])


def test_skip_special_tokens(llm):
    """A special token forced by logit_bias (<|im_start|>, id 1) shows only when asked for."""
    ids = llm.encode(PROMPT)
    forced = dict(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={1: 100.0})
    hidden = _run(llm.engine, ids, SamplingParams(**forced))[-1].outputs[0]
    shown = _run(llm.engine, ids, SamplingParams(**forced, skip_special_tokens=False))
    assert hidden.token_ids == [1] * 6 and hidden.text == ""
    assert shown[-1].outputs[0].text == "<|im_start|>" * 6
    assert all(o.outputs[0].text in {"<|im_start|>" * k for k in range(7)} for o in shown)


def test_best_of_must_equal_n() -> None:
    assert SamplingParams(n=2, best_of=2).best_of == 2
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=1, best_of=3)


@pytest.mark.parametrize("bad", [
    dict(presence_penalty=2.5), dict(frequency_penalty=-3.0), dict(repetition_penalty=0.0),
    dict(min_p=1.5), dict(min_tokens=20, max_tokens=10), dict(logprobs=-1),
    dict(logit_bias={-1: 1.0}), dict(logit_bias={3: float("inf")}), dict(stop_token_ids=[-2]),
])
def test_out_of_range_parameters_are_refused(bad) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)
