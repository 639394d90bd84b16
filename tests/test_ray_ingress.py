"""Ray Serve scale-out without a Ray cluster: routing ranks, the replicas' metrics summed into
one exposition, the flags the replicas and the ingress get, the ingress's retry policy against
fake replicas, and the ingress's app over them. ``test_ray_serve.py`` runs a real local
cluster."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from server_helpers import MODEL, parse_metrics  # noqa: E402

from specstream import CompletionOutput, RequestOutput, SamplingParams  # noqa: E402
from specstream.llm import default_model_dir  # noqa: E402
from specstream.server.metrics import MetricsExporter, ServerMetrics  # noqa: E402
from specstream.server.ray_serve import (  # noqa: E402
    OpenAIIngress,
    ReplicaPool,
    ingress_config,
    pool_metrics,
    rank_by_free_host_kv,
    replica_llm_kwargs,
    replica_resources,
    serve_parser,
)
from specstream.tokenizer import Tokenizer  # noqa: E402


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


def test_tensor_parallel_replicas_reserve_a_packed_group() -> None:
    one = replica_resources(serve_parser().parse_args(["--ray", "--replica-cpus", "2"]))
    assert one == {"ray_actor_options": {"num_cpus": 2.0, "num_gpus": 0.0}}
    args = serve_parser().parse_args(["--ray", "--replica-cpus", "2", "-tp", "2"])
    tp = replica_resources(args)
    assert tp["placement_group_bundles"] == [{"CPU": 2.0}, {"CPU": 2.0}]
    assert tp["placement_group_strategy"] == "STRICT_PACK"
    assert replica_llm_kwargs(args)["tensor_parallel_size"] == 2
    gpu = replica_resources(serve_parser().parse_args(["--ray", "-tp", "4", "--device", "cuda"]))
    assert gpu["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0}] * 4


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
        pool.abort([r[0] for r in requests])  # as serving.collect and stream.stream do when done
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


# ---- the ingress's app over fake replicas ---------------------------------------------------
class FakeEngines(FakeReplicas):
    """The engine deployment's handle as the ingress uses it: ``info`` and ``generate``."""

    def __init__(self, plans: list[tuple[str, int | None]], info: dict[str, Any]) -> None:
        super().__init__(plans)
        self.info = self._Info(info)

    class _Info:
        def __init__(self, info: dict[str, Any]) -> None:
            self.value = info

        async def remote(self) -> dict[str, Any]:
            return self.value


def test_the_ingress_takes_the_servers_options_and_the_replicas_vocabulary(
        tmp_path: Path) -> None:
    """``serve --ray`` with --chat-template, --generation-config and
    --enable-prompt-tokens-details: the ingress's app renders chats with the template, fills
    unset sampling fields from generation_config.json, reports cached prompt tokens, and
    refuses a logit_bias key outside the replicas' vocabulary, as the single-process server
    does (none of it reached the ingress before)."""
    model = default_model_dir("target")
    tok = Tokenizer(model)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.5, "top_k": 7, "max_new_tokens": 3}))
    template = "<<{{ messages[0]['content'] }}>>"
    (tmp_path / "t.jinja").write_text(template)
    args = serve_parser().parse_args([
        "--ray", "--served-model-name", MODEL, "--chat-template", str(tmp_path / "t.jinja"),
        "--generation-config", str(tmp_path), "--enable-prompt-tokens-details"])
    config = ingress_config(args, str(model))
    vocab = 1000  # the replicas' model's, not the tokenizer's (4096)
    engines = FakeEngines([("a", None), ("a", None)], {"max_model_len": 64, "vocab_size": vocab})
    ingress = OpenAIIngress.__new__(OpenAIIngress)

    completion = {"model": MODEL, "prompt": [5, 6, 7], "logit_bias": {str(vocab - 1): 1.0}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    bad_bias = {**completion, "logit_bias": {str(vocab): 1.0}}

    async def main() -> list[httpx.Response]:
        await ingress.__init__(engines, config, str(model), 2)  # Serve awaits it so
        transport = httpx.ASGITransport(app=ingress.__serve_build_asgi_app__())
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            return [await client.post("/v1/completions", json=completion),
                    await client.post("/v1/chat/completions", json=chat),
                    await client.post("/v1/completions", json=bad_bias),
                    await client.get("/tokenizer_info")]

    completed, chatted, refused, info = asyncio.run(main())
    assert completed.status_code == 200, completed.text
    params = engines.calls[0][0][2]
    assert (params.temperature, params.top_k, params.max_tokens) == (0.5, 7, 3)
    assert params.logit_bias == {vocab - 1: 1.0}
    assert completed.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert chatted.status_code == 200, chatted.text
    assert engines.calls[1][0][1] == tok.encode("<<hi>>", add_special_tokens=False)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias"
    assert "outside the vocabulary" in refused.json()["error"]["message"]
    assert len(engines.calls) == 2  # the refused request reached no replica
    assert info.json()["chat_template"] == template
