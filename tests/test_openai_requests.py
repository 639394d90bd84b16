"""Request validation and the SamplingParams a request becomes, without an engine: the fields
clients send at values that work here, the ones refused (each 400 naming its field), vLLM's
cross-field checks, logit_bias keys, and the --generation-config defaults."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")

from specstream import SamplingParams  # noqa: E402
from specstream.server.errors import APIError  # noqa: E402
from specstream.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from specstream.server.request_body import parse_request  # noqa: E402
from specstream.server.request_params import sampling_params  # noqa: E402

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
    ("completion", {"response_format": {"type": "xml"}}, "response_format"),
    ("completion", {"response_format": {"type": "json_object"}, "regex": "a+"}, "regex"),
    ("completion", {"structured_outputs": {"structural_tag": "t"}}, "structured_outputs"),
    ("completion", {"stream_options": {"include_usage": True}}, "stream_options"),  # no stream
    ("completion", {"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("completion", {"priority": 1}, "priority"),
    ("completion", {"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    ("completion", {"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ("completion", {"store": True}, "store"),
    ("completion", {"guided_json": 5}, "guided_json"),
    ("completion", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("completion", {"use_beam_search": True}, "use_beam_search"),
    ("completion", {"prompt_embeds": "abc"}, "prompt_embeds"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"tools": [{"type": "function", "function": {}}]}, "tools"),
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
    return sampling_params(req, prompt_len, 64, "prompt", defaults, vocab)


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
