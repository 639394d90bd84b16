"""The server under faults: cancelled streams, a failed KV transfer, backpressure, API keys,
reused request ids, a failed engine-loop iteration, extreme seeds.

An offloading mode (``stream``, small blocks and thresholds) keeps the host tier in use, so a
leak on either tier shows up in ``engine.kv.{device,host}.num_used``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from server_helpers import MODEL, LiveServer, chat_model  # noqa: E402, F401

from specstream import LLM, SamplingParams  # noqa: E402

OFFLOAD = dict(mode="stream", device_kv_bytes=1_000_000, host_kv_bytes=20_000_000, block_size=16,
               chunk_tokens=64, resident_tail_tokens=32, offload_after_tokens=64,
               max_prefill_tokens=64)


def token_prompts(n: int, length: int = 150) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 400 + 5 for j in range(length + 10 * i)] for i in range(n)]


@pytest.fixture(scope="module")
def offload_server(chat_model: Path) -> Iterator[LiveServer]:  # noqa: F811
    live = LiveServer(LLM(chat_model, **OFFLOAD))
    yield live
    live.close()


def wait_for(cond: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_cancelling_half_the_streams_leaks_no_blocks(offload_server: LiveServer) -> None:
    kv = offload_server.engine.engine.kv
    base = (kv.device.num_used, kv.host.num_used)
    prompts = token_prompts(12)
    client = offload_server.async_client()

    async def main() -> list[Any]:
        streams = [await client.completions.create(
            model=MODEL, prompt=p, max_tokens=200, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) for p in prompts]
        firsts = [await s.__anext__() for s in streams]  # every request is in flight
        assert all(f.choices[0].finish_reason is None for f in firsts)
        for s in streams[::2]:
            await s.close()  # the client goes away mid-stream
        rest = []
        for s in streams[1::2]:
            rest.append([c.choices[0] async for c in s])
        return rest

    rest = asyncio.run(main())
    assert all(r[-1].finish_reason == "length" for r in rest)
    assert wait_for(lambda: offload_server.metric(
        'vllm:request_success_total{finished_reason="abort"}') == 6)
    assert kv.host.peak_used > 0  # the host tier was really in use
    assert wait_for(lambda: (kv.device.num_used, kv.host.num_used) == base)
    assert offload_server.engine.engine.scheduler.requests == {}


def test_transfer_failure_fails_only_its_stream(offload_server: LiveServer,
                                                chat_model: Path) -> None:  # noqa: F811
    prompts = token_prompts(4, length=120)
    ref_llm = LLM(chat_model, **OFFLOAD)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.outputs[0].text for o in ref_llm.generate(prompts, params, use_tqdm=False)]
    ref_llm.close()
    backend = offload_server.engine.engine.backend
    backend.inject_failure(lambda tag: tag == "boom-0")
    client = offload_server.async_client()

    async def one(i: int) -> str:
        headers = {"x-request-id": "boom"} if i == 1 else {}
        stream = await client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=16, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, extra_headers=headers)
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[Any]:
        return await asyncio.gather(*(one(i) for i in range(4)), return_exceptions=True)

    try:
        outs = asyncio.run(main())
    finally:
        backend.clear_failures()
    assert isinstance(outs[1], openai.APIError) and "transfer" in str(outs[1]).lower()
    assert [outs[0], outs[2], outs[3]] == [ref[0], ref[2], ref[3]]
    kv = offload_server.engine.engine.kv
    assert wait_for(lambda: kv.device.num_used == 0 and kv.host.num_used == 0)
    ok = offload_server.client().completions.create(model=MODEL, prompt=prompts[1],
                                                    max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_backpressure_and_api_key(chat_model: Path) -> None:  # noqa: F811
    live = LiveServer(LLM(chat_model, max_num_seqs=1, device_kv_bytes=4_000_000),
                      max_queue=1, queue_timeout_s=1.0, api_key="sekrit")
    try:
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="wrong").models.list()
        assert httpx.get(live.url + "/v1/models").json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(live.url + "/health").status_code == 200  # probes need no key
        client = live.client(api_key="sekrit")
        long = client.completions.create(model=MODEL, prompt="a", max_tokens=2000,
                                         temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
        next(iter(long))  # running: it holds the only batch slot

        async def queued() -> httpx.Response:
            async with httpx.AsyncClient(headers={"authorization": "Bearer sekrit"}) as c:
                return await c.post(live.url + "/v1/completions",
                                    json={"model": MODEL, "prompt": "b", "max_tokens": 2})

        async def main() -> tuple[httpx.Response, httpx.Response]:
            waiting = asyncio.create_task(queued())
            while live.engine.num_pending < 1:
                await asyncio.sleep(0.01)
            refused = await queued()  # the queue (max 1) is full
            return refused, await waiting

        refused, timed_out = asyncio.run(main())
        assert refused.status_code == 429 and "max-queue" in refused.json()["error"]["message"]
        assert timed_out.status_code == 503 and "admitted" in timed_out.json()["error"]["message"]
        long.close()
        ok = client.completions.create(model=MODEL, prompt="c", max_tokens=3)
        assert ok.choices[0].finish_reason is not None
        assert live.metric("specstream:requests_rejected_total") == 2
        kv = live.engine.engine.kv
        assert wait_for(lambda: kv.device.num_used == 0)
    finally:
        live.close()


def test_non_streaming_client_that_leaves_is_aborted(offload_server: LiveServer) -> None:
    kv = offload_server.engine.engine.kv
    name = 'vllm:request_success_total{finished_reason="abort"}'
    aborted = offload_server.metric(name)
    body = {"model": MODEL, "prompt": token_prompts(1)[0], "max_tokens": 1500,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(offload_server.url + "/v1/completions", json=body, timeout=0.5)
    assert wait_for(lambda: offload_server.metric(name) == aborted + 1)
    assert wait_for(lambda: kv.device.num_used == 0 and kv.host.num_used == 0)


def test_error_event_is_followed_by_done(offload_server: LiveServer) -> None:
    backend = offload_server.engine.engine.backend
    backend.inject_failure(lambda tag: tag == "sse-err-0")
    body = {"model": MODEL, "prompt": token_prompts(2, length=120)[1], "max_tokens": 16,
            "temperature": 0, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", offload_server.url + "/v1/completions", json=body,
                          headers={"x-request-id": "sse-err"}, timeout=30) as r:
            lines = [ln for ln in r.iter_lines() if ln]
    finally:
        backend.clear_failures()
    assert lines[-1] == "data: [DONE]"  # was missing after an error event
    err = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert err["type"] == "server_error" and "transfer" in err["message"].lower()


def test_a_reused_request_id_is_refused_and_leaves_the_first_alone(
        chat_model: Path) -> None:  # noqa: F811
    # one batch slot: "held" runs, "queued" waits for admission; both ids are in flight
    live = LiveServer(LLM(chat_model, max_num_seqs=1, device_kv_bytes=4_000_000))
    try:
        client = live.client(timeout=20)
        held = client.completions.create(
            model=MODEL, prompt="a", max_tokens=1000, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            extra_headers={"x-request-id": "held"})
        chunks = iter(held)
        next(chunks)

        def post(request_id: str) -> httpx.Response:
            return httpx.post(live.url + "/v1/completions", timeout=20,
                              json={"model": MODEL, "prompt": "b", "max_tokens": 4,
                                    "temperature": 0}, headers={"x-request-id": request_id})

        async def main() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
            queued = asyncio.create_task(asyncio.to_thread(post, "queued"))
            while live.engine.num_pending < 1:
                await asyncio.sleep(0.01)
            again_held = await asyncio.to_thread(post, "held")
            again_queued = await asyncio.to_thread(post, "queued")
            assert live.engine.num_pending == 1  # "queued" still waits, untouched
            rest = list(chunks)  # "held" runs to its end (it was aborted, and hung)
            assert rest[-1].usage.completion_tokens == 1000
            assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
            return again_held, again_queued, await queued

        again_held, again_queued, queued = asyncio.run(main())
        for r, rid in ((again_held, "held"), (again_queued, "queued")):
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "request_id_in_use", r.text
            assert repr(rid) in err["message"] and set(err) == {"message", "type", "param",
                                                                  "code"}
        assert queued.status_code == 200 and queued.json()["id"] == "queued"
        assert queued.json()["choices"][0]["finish_reason"] == "length"
        assert post("held").status_code == 200  # once it is done, the id is free again
    finally:
        live.close()


def test_a_failed_loop_iteration_fails_its_requests_and_the_loop_goes_on(
        chat_model: Path) -> None:  # noqa: F811
    live = LiveServer(LLM(chat_model, device_kv_bytes=4_000_000))
    try:
        engine = live.engine.engine
        step, failed = engine.step, []

        def step_that_fails_once() -> list:
            outs = step()  # the request is admitted and prefilled, then its outputs are lost
            if not failed:
                failed.append(True)
                raise RuntimeError("device lost")
            return outs

        engine.step = step_that_fails_once
        r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "a"})
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "server_error"
        assert httpx.get(live.url + "/health").status_code == 200  # was 503 forever
        for _ in range(2):
            ok = live.client().completions.create(model=MODEL, prompt="a", max_tokens=3)
            assert ok.choices[0].finish_reason is not None
        assert live.metric("specstream:engine_loop_errors_total") == 1
        assert live.metric('vllm:request_success_total{finished_reason="error"}') == 1
        assert wait_for(lambda: engine.kv.device.num_used == 0)
        assert engine.scheduler.requests == {}
    finally:
        live.close()


def test_extreme_seed_with_the_draft_proposer(chat_model: Path) -> None:  # noqa: F811
    # the tiny model drafts for itself; seeds near 2**64 overflowed (seed + i, seed + 0x5EED)
    live = LiveServer(LLM(chat_model, draft_model=chat_model, proposer="draft",
                          num_speculative_tokens=2, device_kv_bytes=4_000_000))
    try:
        for n in (1, 2):
            r = httpx.post(live.url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": "def f(x):", "max_tokens": 8, "temperature": 0.8,
                "seed": 2**64 - 1, "n": n})
            assert r.status_code == 200, r.text
            assert [c["index"] for c in r.json()["choices"]] == list(range(n))
        r = httpx.post(live.url + "/v1/completions", json={
            "model": MODEL, "prompt": "x", "max_tokens": 2, "seed": 2**64})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
        assert httpx.get(live.url + "/health").status_code == 200
    finally:
        live.close()
