"""Ray Serve scale-out on a local Ray cluster: 2 CPU engine replicas behind one ingress.

Driven through Serve's HTTP proxy on a loopback port with ``openai`` and ``httpx``. The last
test kills a replica while streams run on it, so it runs last and the module shuts Ray down.
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

from specstream import LLM, CompletionOutput, RequestOutput, SamplingParams  # noqa: E402
from specstream.server.metrics import MetricsExporter, ServerMetrics  # noqa: E402
from specstream.server.ray_serve import (  # noqa: E402
    APP_NAME,
    REPLICA_HEADER,
    ReplicaPool,
    pool_metrics,
    rank_by_free_host_kv,
    replica_llm_kwargs,
    serve_parser,
)

TIMEOUT = httpx.Timeout(120.0)


def test_ranking_prefers_most_free_host_kv() -> None:
    free = {"a": 100.0, "b": 95.0, "c": 10.0, "d": 50.0}
    assert rank_by_free_host_kv(free, slack=10.0) == [["a", "b"], ["d", "c"]]
    assert rank_by_free_host_kv(free, slack=0.0) == [["a"], ["b", "d", "c"]]
    # a replica without stats yet is new, hence empty: it ranks first
    assert rank_by_free_host_kv({"a": 5.0, "new": float("inf")}, 1.0) == [["new"], ["a"]]
    assert rank_by_free_host_kv({"a": 0.0, "b": 0.0}, 0.0) == [["a", "b"]]  # no host tier


def replica_snapshot(proposed: int, accepted: int, per_pos: list[int], finished: dict[str, int],
                     kv: tuple[int, int], link_util: float) -> dict[str, Any]:
    m = ServerMetrics()
    m.on_engine({"num_drafts": proposed // 2, "proposed_tokens": proposed,
                 "accepted_tokens": accepted, "rounds": proposed // 2,
                 "accepted_per_pos": per_pos, "device_kv_blocks_used": kv[0],
                 "device_kv_blocks_total": kv[1], "link_bytes_h2d": 2**40 + 1})
    for reason, n in finished.items():
        for _ in range(n):
            m.on_finish(None, reason)
    m.histograms["ttft"].observe(0.02)
    snap = m.snapshot(pending_admission=1)
    snap["mean"]["link_utilisation"] = link_util
    return snap


def test_replica_metrics_are_summed_into_one_exposition() -> None:
    one = replica_snapshot(10, 4, [3, 1], {"stop": 2}, (5, 10), 0.5)
    two = replica_snapshot(20, 12, [8, 3, 1], {"stop": 1, "length": 4}, (15, 30), 0.7)
    pool = ReplicaPool(FakeReplicas([]), max_retries=2,  # type: ignore[arg-type]
                       admit_timeout_s=1.0)
    pool.routed = {"r1": 3, "r2": 5}
    exporter = MetricsExporter(MODEL)
    snaps = [{"replica": "r1", "host_kv_free_bytes": 7, "running": 1, "finished": 2},
             {"replica": "r2", "host_kv_free_bytes": 9, "running": 0, "finished": 5}]
    m = parse_metrics(exporter.render([one, two], pool_metrics(exporter, pool, snaps)).decode())
    assert m["vllm:spec_decode_num_draft_tokens_total"] == 30
    assert m["vllm:spec_decode_num_accepted_tokens_total"] == 16
    # positions only one replica has stay, sums per position
    assert [m[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}']
            for i in range(3)] == [11, 4, 1]
    assert m["specstream:spec_acceptance_rate"] == pytest.approx(16 / 30)  # of the sums
    assert m['specstream:kv_cache_usage_perc{tier="device"}'] == pytest.approx(20 / 40)
    assert m["vllm:kv_cache_usage_perc"] == pytest.approx(20 / 40)
    assert m['specstream:link_bytes_total{direction="h2d"}'] == 2 * (2**40 + 1)  # exact
    assert m['vllm:request_success_total{finished_reason="stop"}'] == 3
    assert m['vllm:request_success_total{finished_reason="length"}'] == 4
    assert m["specstream:link_utilisation"] == pytest.approx(0.6)  # ratios: averaged
    assert m["specstream:requests_pending_admission"] == 2
    assert m["vllm:time_to_first_token_seconds_count"] == 2
    assert m["specstream:ray_replicas"] == 2
    assert m['specstream:ray_requests_routed_total{replica="r2"}'] == 5
    assert m['specstream:ray_replica_requests_finished_total{replica="r1"}'] == 2
    # no replica answered: the ingress's own series still render
    assert parse_metrics(exporter.render([], pool_metrics(exporter, pool, [])).decode())[
        "specstream:ray_replicas"] == 0


def test_speculative_config_reaches_the_replicas(tmp_path: Path) -> None:
    args = serve_parser().parse_args([
        "--ray", "--speculative-config",
        json.dumps({"method": "draft_model", "model": str(tmp_path / "draft"),
                    "num_speculative_tokens": 3})])
    kw = replica_llm_kwargs(args)
    assert (kw["proposer"], kw["num_speculative_tokens"]) == ("draft", 3)
    assert kw["draft_model"] == str((tmp_path / "draft").resolve())
    ngram = replica_llm_kwargs(serve_parser().parse_args([
        "--ray", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']))
    assert (ngram["proposer"], ngram["draft_model"]) == ("ngram", None)
    with pytest.raises(ValueError, match="-q says 5"):
        replica_llm_kwargs(serve_parser().parse_args([
            "--ray", "-q", "5", "--speculative-config", '{"method": "ngram", '
                                                         '"num_speculative_tokens": 2}']))


# ---- the ingress's retry policy, against fake replicas (no Ray needed) ----------------------
class FakeStream:
    """A replica's response stream: ``items``, or a death after ``fail_after`` of them."""

    def __init__(self, items: list[Any], fail_after: int | None) -> None:
        self.items, self.fail_after, self.i, self.cancelled = items, fail_after, 0, False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Any:
        await asyncio.sleep(0.01)
        if self.cancelled:
            raise RuntimeError("RequestCancelledError")
        if self.fail_after is not None and self.i >= self.fail_after:
            raise RuntimeError("ActorDiedError: the actor died unexpectedly")
        if self.i >= len(self.items):
            raise StopAsyncIteration
        self.i += 1
        return self.items[self.i - 1]

    def cancel(self) -> None:
        self.cancelled = True


class FakeReplicas:
    """Stands in for the engine deployment's handle; call k goes to ``plans[k]``:
    (replica id, items it yields before dying, or None to finish)."""

    def __init__(self, plans: list[tuple[str, int | None]]) -> None:
        self.plans, self.calls = plans, []  # type: list[tuple[str, int | None]], list[list[Any]]
        self.generate = self

    def options(self, **kw: Any) -> FakeReplicas:
        return self

    def remote(self, todo: list[Any]) -> FakeStream:
        replica, fail_after = self.plans[len(self.calls)]
        self.calls.append(todo)
        items: list[Any] = [("admitted", replica)]
        for k in (1, 2, 3):  # cumulative outputs; the first sub-request is done first
            items.append([RequestOutput(rid, None, ids, [CompletionOutput(
                0, replica * k, list(range(k)), "length" if k == 2 + min(i, 1) else None)],
                k == 2 + min(i, 1)) for i, (rid, ids, _) in enumerate(todo) if k <= 2 + min(i, 1)])
        return FakeStream(items, fail_after)


def run_job(plans: list[tuple[str, int | None]], subs: int = 1, restartable: bool = False,
            ) -> tuple[ReplicaPool, FakeReplicas, dict[str, RequestOutput]]:
    """One job through a ReplicaPool; the last output of each sub-request."""
    handle = FakeReplicas(plans)
    pool = ReplicaPool(handle, max_retries=2, admit_timeout_s=5.0)  # type: ignore[arg-type]
    requests = [(f"job-{i}", [1, 2, 3], SamplingParams(max_tokens=3)) for i in range(subs)]

    async def main() -> dict[str, RequestOutput]:
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        await pool.add(requests, outputs)
        pool.job([r[0] for r in requests]).restartable = restartable
        last: dict[str, RequestOutput] = {}
        while len([o for o in last.values() if o.finished]) < subs:
            out = await asyncio.wait_for(outputs.get(), 5)
            last[out.request_id] = out
        pool.abort([r[0] for r in requests])  # as serving.collect/stream do when done
        await asyncio.sleep(0.05)
        return last

    return pool, handle, asyncio.run(main())


def test_a_job_whose_replica_dies_before_admitting_goes_to_another() -> None:
    pool, handle, last = run_job([("a", 0), ("b", None)])
    assert len(handle.calls) == 2 and last["job-0"].outputs[0].text == "bb"
    assert pool.routed == {"b": 1} and pool.reroutes == 1 and pool.failures == {}
    assert not pool.jobs


def test_a_stream_that_had_produced_tokens_gets_a_clear_error() -> None:
    pool, handle, last = run_job([("a", 2), ("b", None)])  # admitted, one output, dead
    out = last["job-0"].outputs[0]
    assert out.finish_reason == "error" and "replica a failed" in (out.error or "")
    assert len(handle.calls) == 1 and pool.failures == {"a": 1} and pool.retries == 0


def test_a_non_streaming_job_is_rerun_for_its_unfinished_subrequests() -> None:
    # replica a dies after two outputs: job-0 had finished there, job-1 had not
    pool, handle, last = run_job([("a", 3), ("b", None)], subs=2, restartable=True)
    assert {rid: o.outputs[0].text for rid, o in last.items()} == {"job-0": "aa",
                                                                   "job-1": "bb"}
    assert [[r[0] for r in call] for call in handle.calls] == [["job-0", "job-1"], ["job-1"]]
    assert pool.retries == 1 and pool.failures == {"a": 1} and pool.routed == {"a": 1, "b": 1}


def test_closing_a_finished_job_is_not_a_failure() -> None:
    pool, handle, last = run_job([("a", None)])
    assert last["job-0"].outputs[0].text == "aa" and len(handle.calls) == 1
    assert pool.failures == {} and pool.retries == 0 and not pool.jobs


# ---- a real local Ray cluster --------------------------------------------------------------
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
