"""The OpenAI-compatible server, started for real on a loopback port and driven with ``openai``.

The fixtures (a tiny random Qwen3 with a trained byte-level BPE tokenizer and chat template,
and a uvicorn server in a background thread) live in ``server_helpers.py``; they are imported
here, and re-exported for the tests that import them from this module
(``test_vllm_metrics.py``, ``test_client_bodies.py``, ``test_bench_multiturn.py``).
"""

from __future__ import annotations

import asyncio
import json
import sys
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
    MODEL,
    PROMPTS,
    LiveServer,
    build_chat_model,
    chat_model,
    greedy,
    parse_metrics,
)

from specstream import LLM, SamplingParams  # noqa: E402

__all__ = ["ENGINE", "MODEL", "PROMPTS", "LiveServer", "build_chat_model", "chat_model"]


@pytest.fixture(scope="module")
def server(chat_model: Path) -> Iterator[LiveServer]:
    live = LiveServer(LLM(chat_model, **ENGINE), max_body_bytes=20_000)
    yield live
    live.close()


@pytest.fixture(scope="module")
def offline(chat_model: Path) -> Iterator[LLM]:
    llm = LLM(chat_model, **ENGINE)
    yield llm
    llm.close()


def test_models_health_metrics(server: LiveServer) -> None:
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    # a prompt with most of the vocabulary in it, so that n-gram lookup (n >= 1) finds the
    # generated tokens there and drafts whatever the random model says (the model and its
    # tokenizer are trained on this repository's sources; the example prompt is a snapshot of
    # them that does not move when the sources do)
    text = (Path(__file__).parents[1] / "examples" / "long_prompt.txt").read_text()
    server.client().completions.create(model=MODEL, prompt=text[:2000], max_tokens=24,
                                       temperature=0)
    r = httpx.get(server.url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    m = parse_metrics(r.text)  # valid Prometheus text, every series labelled with the model
    for name in ("vllm:num_requests_running", "specstream:kv_host_used_bytes",
                 "specstream:generation_tokens_per_second", "specstream:spec_acceptance_rate",
                 "specstream:spec_mean_accepted_len", "specstream:link_utilisation",
                 'specstream:link_bytes_total{direction="h2d"}',
                 'specstream:link_bytes_total{direction="d2h"}',
                 'vllm:time_to_first_token_seconds_bucket{le="+Inf"}',
                 "specstream:link_bytes_per_round", "specstream:link_bytes_floor_per_round",
                 "specstream:device_kv_utilization", "specstream:spec_decode_tree_nodes_total",
                 "specstream:spec_decode_tree_rounds_total"):
        assert name in m, name
    assert 0 < m["specstream:device_kv_utilization"] <= 1  # the request's KV sat there
    assert m["specstream:link_bytes_per_round"] >= 0
    # finished by length or by eos: the random model's choice (its tokenizer is trained on
    # this repository's sources, so it changes with them)
    assert sum(v for k, v in m.items()
               if k.startswith("vllm:request_success_total{finished_reason=")) >= 1
    for tier in ("device", "host"):
        used = m[f'specstream:kv_cache_blocks_used{{tier="{tier}"}}']
        total = m[f'specstream:kv_cache_blocks_total{{tier="{tier}"}}']
        assert m[f'specstream:kv_cache_usage_perc{{tier="{tier}"}}'] == (
            used / total if total else 0.0)
    assert m['specstream:kv_cache_blocks_total{tier="device"}'] > 0
    # n-gram speculation (q = 3) ran: vLLM's spec-decode counters, per position too
    drafts = m["vllm:spec_decode_num_drafts_total"]
    proposed = m["vllm:spec_decode_num_draft_tokens_total"]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    per_pos = [m[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}']
               for i in range(3)]
    assert 0 < drafts <= proposed <= 3 * drafts and accepted <= proposed
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert m["specstream:spec_acceptance_rate"] == pytest.approx(accepted / proposed)


def test_completions_equal_offline_greedy(server: LiveServer, offline: LLM) -> None:
    ref = greedy(offline, PROMPTS[:4], 12)
    client = server.client()
    for prompt, r in zip(PROMPTS[:4], ref):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                        temperature=0)
        assert out.choices[0].text == r.text and out.choices[0].finish_reason == r.finish_reason
        assert out.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
        assert out.usage.completion_tokens == len(r.token_ids)
    # token-id prompts and a batch of prompts: one choice per prompt, in order
    ids = offline.tokenizer.encode(PROMPTS[0])
    batch = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=12,
                                      temperature=0)
    assert [c.text for c in batch.choices] == [ref[0].text, ref[0].text]


def test_chat_stream_and_usage(server: LiveServer, offline: LLM) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0, max_tokens=10)
    ref = offline.chat(messages, params, use_tqdm=False)[0].outputs[0]
    client = server.client()
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                         temperature=0)
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_strings(server: LiveServer, offline: LLM) -> None:
    full = greedy(offline, [PROMPTS[1]], 24)[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert len(stop) == 2
    want = full[: full.index(stop)]
    client = server.client()
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24,
                                    temperature=0, stop=[stop])
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24,
                                            temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_and_seed(server: LiveServer) -> None:
    client = server.client()
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, seed=7, n=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # seeds seed+i: the choices differ
    assert 3 <= a.usage.completion_tokens <= 3 * 8  # all choices count, the prompt once
    assert a.usage.prompt_tokens == len(server.llm.tokenizer.encode(PROMPTS[2]))


def test_32_concurrent_streams_equal_offline(server: LiveServer, offline: LLM) -> None:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    ref = [r.text for r in greedy(offline, prompts, 8)]
    client = server.async_client()

    async def one(prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(main()) == ref
    assert server.engine.engine.kv.device.num_used == 0
    assert server.engine.engine.stats.proposed_tokens > 0  # speculation was exercised


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"prompt": "x"}, 400, "model"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": 5}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": list(range(5, 2100))}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "foo": 1}, 400, "foo"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),  # 0..20 are served
    ({"model": MODEL, "prompt": [99999]}, 400, None),
    ({"model": MODEL, "prompt": "x" * 30_000}, 413, None),
    # lone surrogates are valid JSON escapes but not Unicode (were a plain-text 500)
    ({"model": MODEL, "prompt": "def \ud800"}, 400, "prompt"),
    ({"model": MODEL, "prompt": ["ok", "\udfff"]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "stop": ["\ud800"]}, 400, "stop"),
    ({"model": "\ud800", "prompt": "x"}, 400, "model"),
    # more completions than --max-queue could ever hold: not "busy" (was a 429)
    ({"model": MODEL, "prompt": ["x"] * 20, "n": 16}, 400, "n"),
    # out of the engine's 64-bit range (seeds were an overflow error)
    ({"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "seed"),
    ({"model": MODEL, "prompt": "x", "seed": -2**63 - 1}, 400, "seed"),
    ({"model": MODEL, "prompt": "x", "top_k": 2**63}, 400, "top_k"),
    # not JSON, though Python's json module reads them (were 400s by luck, or 500s)
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, None),
    (b'{"model": "tiny", "prompt": "x", "top_p": 1e999}', 400, None),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None),
    (b"[" * 15_000, 400, None),
], ids=lambda v: repr(v[:24]) + "..." if isinstance(v, bytes) and len(v) > 60 else None)
def test_bad_input_gets_openai_error(server: LiveServer, body: Any, status: int,
                                     param: str | None) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/completions", content=data,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    ok = server.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert len(ok.choices) == 1  # the server keeps serving


def test_bad_chat_and_unknown_route(server: LiveServer) -> None:
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "hi \ud800"}]}))
    err = r.json()["error"]  # was a 400 with the tokenizer's raw message
    assert r.status_code == 400 and err["param"] == "messages" and "Unicode" in err["message"]
    chunked = httpx.post(server.url + "/v1/completions", content=iter([b"{" + b" " * 15_000] * 2))
    assert chunked.status_code == 413  # no Content-Length: counted as it arrives
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=[
            {"role": "user", "content": "hi"}])


def test_content_type(server: LiveServer) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        for route in ("/v1/completions", "/v1/chat/completions"):
            r = httpx.post(server.url + route, content=body, headers={"content-type": ctype})
            assert r.status_code == 415, (ctype, r.text)  # was served as JSON
            assert r.json()["error"]["code"] == "unsupported_media_type"
    for ctype in (None, "application/json; charset=utf-8", "Application/JSON"):
        headers = {"content-type": ctype} if ctype else {}  # none at all: read as JSON
        r = httpx.post(server.url + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"], (ctype, r.text)


def test_serve_load_bench_runs_against_the_server(server: LiveServer, tmp_path: Path) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["serve_load"] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    out = tmp_path / "load.json"
    rc = bench.main(["--base-url", server.url, "--model", MODEL, "--tokenizer", "none",
                     "--vocab-size", "500", "--concurrency", "4", "--num-requests", "12",
                     "--prompt-len", "20", "--output-len", "4", "--json", str(out)])
    record = json.loads(out.read_text())
    assert rc == 0 and (record["sent"], record["completed"], record["failed"]) == (12, 12, 0)
    assert record["output_throughput"] > 0 and record["ttft_ms"]["p50"] > 0
    assert record["tpot_ms"]["p99"] >= record["tpot_ms"]["p50"] > 0
    assert record["server"]["generation_tokens_total"] >= 12  # read from the labelled /metrics


def test_depth_chosen_and_tree_counters_are_exported() -> None:
    from specstream.server.metrics import MetricsExporter, ServerMetrics

    sm = ServerMetrics()
    sm.on_engine({"speculative_depth_chosen": {0: 5, 4: 2, 12: 1}, "tree_rounds": 3,
                  "tree_nodes": 24, "speculative_nodes_chosen": {0: 5, 16: 3}})
    text = MetricsExporter("m").render([sm.snapshot(0)]).decode()
    m = parse_metrics(text, model="m")
    assert [m[f'specstream:spec_decode_depth_chosen_total{{depth="{d}"}}']
            for d in (0, 4, 12)] == [5, 2, 1]
    assert [m[f'specstream:spec_decode_nodes_chosen_total{{nodes="{n}"}}']
            for n in (0, 16)] == [5, 3]
    assert m["specstream:spec_decode_tree_rounds_total"] == 3
    assert m["specstream:spec_decode_tree_nodes_total"] == 24
