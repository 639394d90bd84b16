"""Ray Serve scale-out on a local Ray cluster: 2 CPU engine replicas behind one ingress.

Driven through Serve's HTTP proxy on a loopback port with ``openai`` and ``httpx``. The last
test kills a replica while streams run on it, so it runs last and the module shuts Ray down.
The parts that need no cluster are in ``test_ray_ingress.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from server_helpers import (  # noqa: E402
    ENGINE,
    MODEL,
    PROMPTS,
    chat_model,  # noqa: F401
    greedy,
    parse_metrics,
)

from specstream import LLM, SamplingParams  # noqa: E402
from specstream.server.ray_serve import APP_NAME, REPLICA_HEADER, serve_parser  # noqa: E402

TIMEOUT = httpx.Timeout(120.0)


class RayServer:
    """A local Ray cluster running ``specstream serve --ray --replicas 2`` on a loopback port."""

    def __init__(self, model: Path) -> None:
        import ray
        from ray import serve

        from specstream.server.ray_serve import build_ray_app

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}"
        args = serve_parser().parse_args([
            "--ray", "--replicas", "2", "--model", str(model), "--served-model-name", MODEL,
            "--replica-cpus", "1", "--ingress-cpus", "0.5", "--port", str(self.port),
            "--device-kv-bytes", str(ENGINE["device_kv_bytes"]),
            "--block-size", str(ENGINE["block_size"]),
            "--max-prefill-tokens", str(ENGINE["max_prefill_tokens"]),
            "--proposer", "ngram", "-q", str(ENGINE["num_speculative_tokens"]),
            "--routing-stats-period", "0.5",
        ])
        # 4 logical CPUs on however many cores: 2 replicas + the ingress fit
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_DEDUP_LOGS": "0"}})
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        serve.run(build_ray_app(args), name=APP_NAME, route_prefix="/")
        self.engines = serve.get_deployment_handle("SpecStreamEngine", APP_NAME)

    def client(self) -> Any:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0,
                             timeout=120)

    def replicas(self) -> list[dict[str, Any]]:
        return self.engines.broadcast("info").results(timeout_s=60)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=TIMEOUT).text)

    def close(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def cluster(chat_model: Path) -> Iterator[RayServer]:  # noqa: F811
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.serve")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        ray.shutdown()
    server = RayServer(chat_model)
    yield server
    server.close()


@pytest.fixture(scope="module")
def offline(chat_model: Path) -> Iterator[LLM]:  # noqa: F811
    llm = LLM(chat_model, **ENGINE)
    yield llm
    llm.close()


def test_completions_and_streaming_chat_equal_offline(cluster: RayServer, offline: LLM) -> None:
    client = cluster.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    ref = greedy(offline, PROMPTS[:4], 12)
    for prompt, r in zip(PROMPTS[:4], ref):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                        temperature=0)
        assert out.choices[0].text == r.text and out.choices[0].finish_reason == r.finish_reason
        assert out.usage.completion_tokens == len(r.token_ids)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat_ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10),
                            use_tqdm=False)[0].outputs[0]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == len(chat_ref.token_ids)
    with pytest.raises(openai.NotFoundError):  # errors are the single-process server's
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    r = httpx.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                           "max_tokens": "5"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # the replicas' vocabulary bounds logit_bias keys at the ingress, as on one server
    vocab = offline.engine.model_config.vocab_size
    r = httpx.post(cluster.url + "/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 2, "logit_bias": {str(vocab): 1.0}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_requests_spread_over_both_replicas(cluster: RayServer, offline: LLM) -> None:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(16)]
    ref = [r.text for r in greedy(offline, prompts, 8)]

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, str]:
        r = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.headers[REPLICA_HEADER]

    async def main() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=TIMEOUT) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    assert [text for text, _ in results] == ref
    ids = {r["replica"] for r in cluster.replicas()}
    assert len(ids) == 2 and {replica for _, replica in results} == ids
    m = cluster.metrics()
    for rid in ids:
        assert m[f'specstream:ray_replica_requests_finished_total{{replica="{rid}"}}'] > 0
        assert m[f'specstream:ray_requests_routed_total{{replica="{rid}"}}'] > 0
    assert m["specstream:ray_replicas"] == 2
    per_replica = sum(m[f'specstream:ray_replica_requests_finished_total{{replica="{r}"}}']
                      for r in ids)
    assert m['vllm:request_success_total{finished_reason="length"}'] \
        + m.get('vllm:request_success_total{finished_reason="stop"}', 0) == per_replica
    assert httpx.get(cluster.url + "/health").json() == {"status": "ok", "replicas": 2}


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int,
                  log: dict[str, Any]) -> None:
    """Stream a completion, recording its replica, text and any error event in ``log``."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        log.update(replica=r.headers[REPLICA_HEADER], text="", error=None, done=False)
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                log["done"] = True
                return
            event = json.loads(line[6:])
            if "error" in event:
                log["error"] = event["error"]
            else:
                log["text"] += event["choices"][0]["text"]


def test_killing_a_replica_loses_no_request_that_had_not_started(
        cluster: RayServer, offline: LLM) -> None:
    import ray

    actors = {r["replica"]: r["actor_name"] for r in cluster.replicas()}
    short = [f"{PROMPTS[i % len(PROMPTS)]} short {i}" for i in range(10)]
    short_ref = [r.text for r in greedy(offline, short, 8)]
    long_logs: list[dict[str, Any]] = [{} for _ in range(6)]
    running: list[bool] = []  # per long stream: still streaming when the replica was killed

    async def main() -> tuple[str, list[Any]]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=TIMEOUT) as client:
            longs = [asyncio.create_task(_stream(client, f"{PROMPTS[i]} long", 1500, log))
                     for i, log in enumerate(long_logs)]
            for _ in range(600):  # until every long stream has produced text
                if all(log.get("text") for log in long_logs):
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail(f"long streams did not start: {long_logs}")
            # the replica with the most long streams still running
            by_replica = [log["replica"] for log in long_logs if not log.get("done")]
            by_replica = by_replica or [log["replica"] for log in long_logs]
            victim = max(set(by_replica), key=by_replica.count)

            def post(prompt: str) -> asyncio.Task[httpx.Response]:
                return asyncio.create_task(client.post("/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}))

            # requests that have not started yet: half sent just before the kill, half just
            # after it (before Serve's controller has noticed)
            shorts = [post(p) for p in short[:5]]
            await asyncio.sleep(0.05)
            # a fast engine may finish a long stream before the kill: only those still running
            # must end with the error
            running.extend(not log.get("done") for log in long_logs)
            ray.kill(ray.get_actor(actors[victim], namespace="serve"), no_restart=True)
            shorts += [post(p) for p in short[5:]]
            answers = await asyncio.gather(*shorts)
            # streams on the victim end with an error event; the survivor's keep streaming
            await asyncio.wait_for(asyncio.gather(
                *(t for t, log in zip(longs, long_logs) if log["replica"] == victim)), 60)
            survivors = [log for log in long_logs if log["replica"] != victim]
            before = [len(log["text"]) for log in survivors]
            await asyncio.sleep(0.5)
            assert all(len(log["text"]) > b or log["done"] for log, b in zip(survivors, before))
            for t in longs:
                t.cancel()
            await asyncio.gather(*longs, return_exceptions=True)
            return victim, answers

    victim, answers = asyncio.run(main())
    assert [a.status_code for a in answers] == [200] * len(short), [a.text for a in answers]
    assert [a.json()["choices"][0]["text"] for a in answers] == short_ref
    assert any(r for r, log in zip(running, long_logs) if log["replica"] == victim)
    for log, was_running in zip(long_logs, running):
        if log["replica"] == victim and was_running:
            assert log["error"] is not None and log["done"], log  # the error, then [DONE]
            assert f"replica {victim} failed" in log["error"]["message"]
            assert log["error"]["type"] == "server_error"
        else:
            assert log["error"] is None
    m = cluster.metrics()
    failed_on = {k for k, v in m.items() if k.startswith("specstream:ray_replica_fail") and v}
    assert failed_on == {f'specstream:ray_replica_failures_total{{replica="{victim}"}}'}
    assert m["specstream:ray_retries_total"] <= len(short)
