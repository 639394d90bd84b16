"""``/metrics`` under vLLM's names: what vLLM's own Grafana dashboard queries is there with its
labels, the buckets are vLLM's, and the request histograms count what the requests did.

The loop's bookkeeping (inter-token latency per token, request phases, n) is driven with
hand-built outputs through ``AsyncEngine._dispatch``; the rest against a live server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from test_server import ENGINE, MODEL, PROMPTS, LiveServer, chat_model  # noqa: E402,F401

from specstream import LLM, CompletionOutput, RequestOutput, SamplingParams  # noqa: E402
from specstream.server.async_engine import AsyncEngine, _Pending, _with_parents  # noqa: E402
from specstream.server.exposition import build_1_2_5_buckets  # noqa: E402
from specstream.server.metrics import MetricsExporter, ServerMetrics  # noqa: E402

# The PromQL of vLLM's Grafana dashboard, one expression per series it reads (the P50/P90/P95
# quantiles repeat the P99's). From vllm-project/vllm
# examples/observability/prometheus_grafana/grafana.json as docs.vllm.ai/en/latest shows it
# (the dashboard moved there from examples/online_serving/prometheus_grafana/).
DASHBOARD = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket'
    '{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket'
    '{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:inter_token_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(vllm:inter_token_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:request_time_per_output_token_seconds_bucket'
    '{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:request_time_per_output_token_seconds_sum{model_name="$model_name"}'
    '[$__rate_interval])\n/\nrate(vllm:request_time_per_output_token_seconds_count'
    '{model_name="$model_name"}[$__rate_interval])',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket'
    '{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}'
    '[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}'
    '[$__rate_interval]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}'
    '[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}'
    '[$__rate_interval])',
]
# The same dashboard at examples/online_serving/prometheus_grafana/grafana.json (vLLM commit
# 004f771f3a6b49597546b05c7d83686d1e121fa0), which copies of it in use still query: the
# inter-token panel under its pre-0.11 name, the cache panel under vllm:gpu_cache_usage_perc.
DASHBOARD_BEFORE_0_11 = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket'
    '{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:time_per_output_token_seconds_sum{model_name="$model_name"}[$__rate_interval])'
    '\n/\nrate(vllm:time_per_output_token_seconds_count{model_name="$model_name"}'
    '[$__rate_interval])',
    'vllm:gpu_cache_usage_perc{model_name="$model_name"}',
]
# Its model_name variable: label_values({__name__=~"vllm:.*"},model_name)
# vLLM's buckets (vllm/v1/metrics/loggers.py, PrometheusStatLogger)
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                                40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def dashboard_series(exprs: list[str]) -> dict[str, set[str]]:
    """The series the expressions read, each with the labels they need on it: the matchers'
    and the ``by (...)`` grouping's."""
    out: dict[str, set[str]] = {}
    for expr in exprs:
        by = {lab.strip() for grp in re.findall(r"by\s*\(([^)]*)\)", expr)
              for lab in grp.split(",") if lab.strip()}
        for name, matchers in re.findall(r"(vllm:[A-Za-z0-9_:]+)(\{[^}]*\})?", expr):
            need = set(re.findall(r"([A-Za-z_]+)\s*=~?", matchers)) | by
            out.setdefault(name, set()).update(need)
    return out


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a /metrics text: (name, labels, value); the text must parse."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples]


def value(ss: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for n, lab, v in ss if n == name and labels.items() <= lab.items())


def les(ss: list[tuple[str, dict[str, str], float]], name: str) -> list[float]:
    return [float(lab["le"]) for n, lab, _ in ss if n == f"{name}_bucket" and lab["le"] != "+Inf"]


# ---- the loop's bookkeeping, with hand-built outputs ----------------------------------------
def stub_engine(max_model_len: int = 512) -> AsyncEngine:
    """An AsyncEngine whose engine is a stand-in: only ``_dispatch`` and ``_abort`` run."""
    engine = SimpleNamespace(max_model_len=max_model_len, scheduler=SimpleNamespace(requests={}),
                             abort_request=lambda rid: None)
    llm = SimpleNamespace(engine=engine, config=SimpleNamespace(q=3))
    return AsyncEngine(llm)  # type: ignore[arg-type]


def pending(rid: str, prompt: list[int], params: SamplingParams) -> _Pending:
    return _Pending(rid, prompt, params, asyncio.Queue())


def output(rid: str, prompt: list[int], num_tokens: int, finish: str | None,
           **times: float) -> RequestOutput:
    comp = CompletionOutput(0, "", list(range(num_tokens)), finish)
    return RequestOutput(rid, None, prompt, [comp], finish is not None, dict(times))


def test_each_token_is_one_inter_token_latency_and_a_round_shares_one_wait() -> None:
    eng = stub_engine()
    prompt = [7] * 10
    eng._live["r"] = _with_parents([pending("r", prompt, SamplingParams(max_tokens=8))])[0]
    t = dict(arrival_time=0.0, first_scheduled_time=0.1)
    eng._dispatch([output("r", prompt, 1, None, **t, first_token_time=0.5, last_token_time=0.5,
                          ttft_s=0.5)], now=9.0)
    # a speculative round: three tokens at once, 0.2 s after the first
    eng._dispatch([output("r", prompt, 4, None, **t, first_token_time=0.5, last_token_time=0.7)],
                  now=9.1)
    eng._dispatch([output("r", prompt, 5, "length", **t, first_token_time=0.5,
                          last_token_time=1.0, finished_time=1.0)], now=9.2)
    h = eng.metrics.histograms
    # per token after the first: 0.2 (the round's first), 0, 0 (came with it), 0.3
    assert sum(h["itl"].counts) == 4 and h["itl"].sum == pytest.approx(0.5)
    assert h["itl"].counts[0] == 2  # the two that came with the round's first: le=0.01
    # one per step, as vLLM observes it
    assert sum(h["inter_step"].counts) == 2 and h["inter_step"].sum == pytest.approx(0.5)
    assert (sum(h["ttft"].counts), h["ttft"].sum) == (1, 0.5)
    # tokens per step: the prompt with the first token, then what each step generated
    assert sum(h["iteration_tokens"].counts) == 3 and h["iteration_tokens"].sum == 11 + 3 + 1
    phases = {"queue": 0.1, "prefill": 0.4, "decode": 0.5, "inference": 0.9, "e2e": 1.0,
              "request_tpot": 0.5 / 4}
    for key, seconds in phases.items():
        assert sum(h[key].counts) == 1 and h[key].sum == pytest.approx(seconds), key
    assert (h["prompt_tokens"].sum, h["generation_tokens"].sum, h["max_tokens"].sum) == (10, 5, 8)
    assert (h["n"].sum, h["max_num_generation_tokens"].sum) == (1, 5)
    assert eng.metrics.finished == {"length": 1}
    assert eng._live == {}


def test_without_the_engines_phase_times_those_are_left_out() -> None:
    eng = stub_engine()
    prompt = [3, 4]
    eng._live["r"] = _with_parents([pending("r", prompt, SamplingParams(max_tokens=4))])[0]
    arrival = time.perf_counter() - 2.0
    eng._dispatch([output("r", prompt, 1, None, arrival_time=arrival, ttft_s=0.25)], now=5.0)
    eng._dispatch([output("r", prompt, 3, "stop", arrival_time=arrival, ttft_s=0.25,
                          tpot_s=0.125)], now=5.5)
    h = eng.metrics.histograms
    # the step's own clock stands in for the token times
    assert sum(h["itl"].counts) == 2 and h["itl"].sum == pytest.approx(0.5)
    for key in ("queue", "prefill", "decode", "inference"):
        assert sum(h[key].counts) == 0, key
    assert h["request_tpot"].sum == 0.125
    assert sum(h["e2e"].counts) == 1 and 2.0 <= h["e2e"].sum < 60.0


def test_the_n_choices_of_a_prompt_count_as_one_request_for_n() -> None:
    eng = stub_engine()
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1)
    a, b = [1, 2, 3], [4, 5]
    items = _with_parents(
        [pending(f"a{i}", a, dataclasses.replace(params, seed=10 + i)) for i in range(3)]
        + [pending("b", b, params), pending("a-again", a, dataclasses.replace(params, top_k=5))])
    assert [it.parent.n for it in items] == [3, 3, 3, 1, 1]
    for it in items:
        eng._live[it.request_id] = it
    eng._dispatch([output("a0", a, 2, "stop"), output("a1", a, 6, "length"),
                   output("b", b, 1, None)], now=1.0)
    eng._abort("a2")  # the third choice's client went away
    h = eng.metrics.histograms
    assert (sum(h["n"].counts), h["n"].sum) == (1, 3)  # prompt a ended; b still runs
    assert h["max_num_generation_tokens"].sum == 6
    eng._abort("b")
    eng._abort("a-again")
    assert (sum(h["n"].counts), h["n"].sum) == (3, 5)
    assert eng.metrics.finished == {"stop": 1, "length": 1, "abort": 3}


def test_a_long_prefill_lands_in_a_bucket_and_replicas_add_up() -> None:
    one, two = ServerMetrics(max_model_len=100), ServerMetrics(max_model_len=100)
    one.on_tokens(1, ttft_s=100.0)  # long-context TTFTs: not +Inf any more
    two.on_tokens(3, gap_s=0.05)
    two.on_finish(output("x", [1] * 30, 3, "stop", arrival_time=time.perf_counter()), "stop")
    text = MetricsExporter(MODEL).render([one.snapshot(0), two.snapshot(0)]).decode()
    ss = samples(text)
    ttft = "vllm:time_to_first_token_seconds_bucket"
    assert value(ss, ttft, le="80.0") == 0 and value(ss, ttft, le="160.0") == 1
    assert les(ss, "vllm:time_to_first_token_seconds") == VLLM_TTFT_BUCKETS
    assert les(ss, "vllm:inter_token_latency_seconds") == VLLM_ITL_BUCKETS
    assert les(ss, "vllm:e2e_request_latency_seconds") == VLLM_REQUEST_LATENCY_BUCKETS
    assert les(ss, "vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)  # vLLM's docstring example
    assert value(ss, "vllm:inter_token_latency_seconds_count") == 3
    assert value(ss, "vllm:request_success_total", finished_reason="stop") == 1
    for reason in ("length", "abort", "error"):  # vLLM's reasons, there from the start
        assert ("vllm:request_success_total", reason) in {
            (n, lab.get("finished_reason")) for n, lab, _ in ss}
    # every series of the engine carries vLLM's labels; the summed replicas are one engine
    assert all(lab["model_name"] == MODEL and lab["engine"] == "0" for _, lab, _ in ss)


def test_dashboard_parsing_finds_names_and_labels() -> None:
    series = dashboard_series(DASHBOARD)
    assert series["vllm:request_success_total"] == {"model_name", "finished_reason"}
    assert series["vllm:e2e_request_latency_seconds_bucket"] == {"model_name", "le"}
    assert series["vllm:e2e_request_latency_seconds_count"] == {"model_name"}
    assert len(series) == 24


# ---- a live server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def metrics_server(chat_model: Path) -> Iterator[LiveServer]:  # noqa: F811
    live = LiveServer(LLM(chat_model, **ENGINE))
    yield live
    live.close()


@pytest.fixture(scope="module")
def run(metrics_server: LiveServer) -> dict[str, Any]:
    """Three API requests (one with n = 2), then one scrape."""
    client = metrics_server.client()
    bodies: list[dict[str, Any]] = [
        dict(prompt=PROMPTS[0], max_tokens=16, temperature=0),
        dict(prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=3, n=2),
        dict(prompt=PROMPTS[2], max_tokens=12, temperature=0),
    ]
    outs = [client.completions.create(model=MODEL, **b) for b in bodies]
    llm = metrics_server.llm
    prompt_tokens = sum(len(llm.encode(b["prompt"])) * b.get("n", 1) for b in bodies)
    generated = sum(o.usage.completion_tokens for o in outs)
    text = httpx.get(metrics_server.url + "/metrics").text
    return {"samples": samples(text), "requests": 4, "prompt_tokens": prompt_tokens,
            "generated": generated}


@pytest.mark.parametrize("exprs", [DASHBOARD, DASHBOARD_BEFORE_0_11],
                         ids=["dashboard", "dashboard-before-0.11"])
def test_every_series_vllms_dashboard_queries_is_there_with_its_labels(
        run: dict[str, Any], exprs: list[str]) -> None:
    ss = run["samples"]
    for name, labels in dashboard_series(exprs).items():
        found = [lab for n, lab, _ in ss if n == name]
        assert found, f"{name} is not on /metrics"
        assert any(labels <= lab.keys() and lab["model_name"] == MODEL for lab in found), (
            name, labels)
    reasons = {lab["finished_reason"] for n, lab, _ in ss if n == "vllm:request_success_total"}
    assert {"stop", "length"} <= reasons
    # the dashboard's model_name variable: label_values({__name__=~"vllm:.*"}, model_name)
    assert {lab["model_name"] for n, lab, _ in ss if n.startswith("vllm:")} == {MODEL}


def test_request_histograms_count_what_the_requests_did(run: dict[str, Any]) -> None:
    ss, requests, generated = run["samples"], run["requests"], run["generated"]
    count = {name: value(ss, f"vllm:{name}_count") for name in (
        "time_to_first_token_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds", "request_inference_time_seconds",
        "request_time_per_output_token_seconds", "request_prompt_tokens",
        "request_generation_tokens")}
    assert set(count.values()) == {requests}, count
    total = sum(v for n, _, v in ss if n == "vllm:request_success_total")
    assert total == requests
    assert value(ss, "vllm:request_prompt_tokens_sum") == run["prompt_tokens"]
    assert value(ss, "vllm:request_generation_tokens_sum") == generated
    assert value(ss, "vllm:generation_tokens_total") == generated
    # n: three API requests, one of them with two choices
    assert (value(ss, "vllm:request_params_n_count"), value(ss, "vllm:request_params_n_sum")) \
        == (3, 4)
    assert value(ss, "vllm:iteration_tokens_total_sum") == run["prompt_tokens"] + generated
    # every token after a request's first is one inter-token latency; their sum is the decode
    itl, step = "vllm:inter_token_latency_seconds", "specstream:inter_step_latency_seconds"
    assert value(ss, f"{itl}_count") == generated - requests
    # (the engine's token times both; within 0.1 ms, its clock read in two places)
    assert value(ss, f"{itl}_sum") == pytest.approx(
        value(ss, "vllm:request_decode_time_seconds_sum"), abs=1e-4)
    assert value(ss, f"{step}_sum") == pytest.approx(value(ss, f"{itl}_sum"), abs=1e-9)
    # a round's extra tokens wait 0: at least that many observations in the lowest bucket
    bursts = value(ss, f"{itl}_count") - value(ss, f"{step}_count")
    assert bursts >= 0 and value(ss, f"{itl}_bucket", le="0.01") >= bursts
    assert value(ss, "vllm:time_per_output_token_seconds_count") == value(ss, f"{itl}_count")
    # the phases fit in the request's time
    phases = sum(value(ss, f"vllm:request_{p}_time_seconds_sum")
                 for p in ("queue", "prefill", "decode"))
    assert phases <= value(ss, "vllm:e2e_request_latency_seconds_sum") + 1e-6
