"""The engine at tensor_parallel_size 2 on CPU (two gloo ranks, the second in a process the
engine starts itself): greedy output equals TP 1 in every mode, chains and trees, residency
tail and fill, host attention; each rank streams half of TP 1's history bytes; a killed rank
fails the requests in flight within seconds, with the error named."""

from __future__ import annotations

import time
from collections import Counter
from importlib.resources import files
from typing import Any

import pytest

from specstream import LLM, SamplingParams

TARGET = str(files("specstream") / "assets" / "default-target")
DRAFT = str(files("specstream") / "assets" / "default-draft")
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
STREAMED = dict(device_kv_bytes=24 << 20, residency="tail", resident_tail_tokens=128,
                offload_after_tokens=128)
FIXED = dict(speculative_policy="fixed", num_speculative_tokens=3)
SETTINGS: dict[str, dict[str, Any]] = {
    "resident": dict(mode="resident", **FIXED),
    "offload": dict(mode="offload", **STREAMED),
    "stream": dict(mode="stream", **STREAMED),
    "offload-spec": dict(mode="offload-spec", **STREAMED, **FIXED),
    "specstream": dict(mode="specstream", **STREAMED, **FIXED),
    "specstream/fill": dict(mode="specstream", device_kv_bytes=24 << 20, **FIXED),
    # a tree every round (the auto policy on the tiny pair is free to take none)
    "specstream/trees": dict(mode="specstream", **STREAMED, speculative_topk=2,
                             speculative_num_draft_tokens=8, num_speculative_tokens=4,
                             speculative_policy="fixed"),
    "specstream/host": dict(mode="specstream", **STREAMED, **FIXED, host_attention="auto"),
    "parallel-spec": dict(mode="parallel-spec", **STREAMED, **FIXED),
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from specstream.bench.workload import Workload, build_prompts
    from specstream.tokenizer import Tokenizer

    return build_prompts(Workload((700, 450, 300), 20), Tokenizer(TARGET), 4096)


def _run(setting: dict[str, Any], prompts: list[list[int]], tp: int
         ) -> tuple[list[list[int]], dict[str, Any]]:
    draft = None if setting["mode"] in ("offload", "stream") else DRAFT
    # budgets are per rank: a rank's blocks hold half the KV heads, so 1/tp of TP 1's bytes
    # gives every rank the same number of blocks and the scheduler the same plan
    setting = dict(setting, host_kv_bytes=(512 << 20) // tp)
    if "device_kv_bytes" in setting:
        setting["device_kv_bytes"] //= tp
    llm = LLM(TARGET, draft_model=draft, tensor_parallel_size=tp, **setting)
    ranks = llm.engine.ranks.procs if tp > 1 else []
    try:
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
        metrics = llm.get_metrics()
        metrics["round_history_bytes"] = [r.history_bytes for r in llm.engine.rounds]
    finally:
        llm.close()
    # a clean close stops every rank with exit code 0 (not an abort in its teardown)
    assert [p.exitcode for p in ranks] == [0] * len(ranks)
    return [o.outputs[0].token_ids for o in outs], metrics


@pytest.mark.parametrize("name", list(SETTINGS))
def test_tp2_equals_tp1(name: str, prompts: list[list[int]]) -> None:
    setting = SETTINGS[name]
    one, m1 = _run(setting, prompts, 1)
    two, m2 = _run(setting, prompts, 2)
    assert two == one
    assert all(len(t) == PARAMS.max_tokens for t in two)
    if setting.get("residency") == "tail":  # the same cold history, half the KV heads a rank
        assert m1["link_bytes_h2d"] > 0
        if name != "specstream/trees" and not setting.get("host_attention"):
            # the same plan on both: the steady rounds move exactly half the bytes; the rounds
            # right after a prefill stream what its write-backs have not yet made cold, which
            # depends on the copy thread's timing (also from one TP 1 run to the next)
            (steady1, _), = Counter(m1["round_history_bytes"]).most_common(1)
            (steady2, _), = Counter(m2["round_history_bytes"]).most_common(1)
            assert steady2 * 2 == steady1 > 0
            assert m2["link_bytes_h2d"] * 2 == pytest.approx(m1["link_bytes_h2d"], rel=0.05)
        else:  # shapes (trees) or the host's share follow measured times
            assert m2["link_bytes_h2d"] < 0.75 * m1["link_bytes_h2d"]
    if name == "specstream/trees":
        assert m2["tree_rounds"] > 0


def test_killed_rank_fails_the_requests_in_flight(prompts: list[list[int]]) -> None:
    llm = LLM(TARGET, draft_model=DRAFT, tensor_parallel_size=2, **SETTINGS["specstream"])
    try:
        ok = llm.generate(prompts[:1], PARAMS, use_tqdm=False)[0].outputs[0]
        assert ok.finish_reason == "length"
        llm.engine.ranks.procs[0].kill()
        llm.engine.ranks.procs[0].join(timeout=10)
        t0 = time.monotonic()
        outs = llm.generate(prompts[:2], PARAMS, use_tqdm=False)
        assert time.monotonic() - t0 < 30
        for o in outs:
            assert o.outputs[0].finish_reason == "error"
            assert "tensor-parallel group is broken" in o.outputs[0].error
            assert "specstream-rank-1" in o.outputs[0].error
    finally:
        llm.close()


def test_sizes_that_do_not_split() -> None:
    with pytest.raises(ValueError, match="do not split over 4 ranks"):
        LLM(TARGET, mode="resident", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(TARGET, mode="resident", tensor_parallel_size=0)


def test_server_reports_a_killed_rank(prompts: list[list[int]]) -> None:
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from server_helpers import MODEL, LiveServer

    live = LiveServer(LLM(TARGET, draft_model=DRAFT, tensor_parallel_size=2,
                          **SETTINGS["specstream"]))
    try:
        body = {"model": MODEL, "prompt": prompts[0][:200], "max_tokens": 8, "temperature": 0}
        assert httpx.post(live.url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert httpx.get(live.url + "/health").status_code == 200
        live.llm.engine.ranks.procs[0].kill()
        live.llm.engine.ranks.procs[0].join(timeout=10)
        health = httpx.get(live.url + "/health")
        assert health.status_code == 503 and "specstream-rank-1" in health.json()["error"]
        assert httpx.post(live.url + "/v1/completions", json=body, timeout=60).status_code == 503
    finally:
        live.close()


def test_hung_rank_fails_the_requests_in_flight(prompts: list[list[int]],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that stops answering (SIGSTOP: alive, silent) fails the step in flight once the
    all-reduce times out, then every later one at once; nothing hangs."""
    import os
    import signal

    monkeypatch.setenv("SPECSTREAM_RANK_TIMEOUT_S", "3")
    llm = LLM(TARGET, draft_model=DRAFT, tensor_parallel_size=2, **SETTINGS["specstream"])
    rank = llm.engine.ranks.procs[0]
    try:
        assert llm.generate(prompts[:1], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        os.kill(rank.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        outs = llm.generate(prompts[:2], PARAMS, use_tqdm=False)
        assert time.monotonic() - t0 < 20
        for o in outs:
            assert o.outputs[0].finish_reason == "error"
            assert "stopped answering" in o.outputs[0].error
        assert rank.is_alive()  # stopped, not dead: the timeout found it
        t0 = time.monotonic()
        again = llm.generate(prompts[:1], PARAMS, use_tqdm=False)[0].outputs[0]
        assert again.finish_reason == "error" and time.monotonic() - t0 < 2
    finally:
        os.kill(rank.pid, signal.SIGCONT)
        llm.close()


def test_rank_timeout_must_be_a_positive_number(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("soon", "0"):
        monkeypatch.setenv("SPECSTREAM_RANK_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="SPECSTREAM_RANK_TIMEOUT_S"):
            LLM(TARGET, mode="resident", tensor_parallel_size=2)


def test_a_shared_document_held_on_the_device_at_tp2(prompts: list[list[int]]) -> None:
    """Prefix sharing under `fill` (the shared run's device copy, placed by every rank into its
    own shard): TP 2 equals TP 1."""
    doc = prompts[0][:512]
    shared = [doc + p[:40 + 10 * i] for i, p in enumerate(prompts)]
    setting = dict(mode="specstream", device_kv_bytes=24 << 20, **FIXED)
    one, m1 = _run(setting, shared, 1)
    llm = LLM(TARGET, draft_model=DRAFT, tensor_parallel_size=2, **setting)
    held, real = [], llm.engine.scheduler.schedule

    def schedule(est: Any = None) -> Any:
        plan = real(est)
        held.append(llm.engine.kv.shared.held)
        return plan

    llm.engine.scheduler.schedule = schedule
    try:
        two = [o.outputs[0].token_ids for o in llm.generate(shared, PARAMS, use_tqdm=False)]
    finally:
        llm.close()
    assert two == one
    assert m1["prefix_cache_hits_total"] >= 512
    assert max(held) == 4  # the document's four blocks, held once for the three
    # all of it fits: at most the document crosses the link, once (its copy is taken over
    # from the first request's window where that still holds it)
    assert m1["link_bytes_h2d"] <= 4 * 786432
