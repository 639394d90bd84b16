"""``/metrics``: metric snapshots rendered as Prometheus text, under vLLM's names.

Every series vLLM's v1 engine exports that has a meaning here keeps vLLM's name (``vllm:``
prefix), labels (``model_name`` and ``engine``; ``finished_reason`` on ``request_success``) and
histogram buckets, so a dashboard built for vLLM works unchanged; what only this engine has
(both KV tiers, the link, residency, host attention, the draft shapes chosen) is under
``specstream:`` with the same labels. The buckets are vLLM's (``vllm/v1/metrics/loggers.py``,
``PrometheusStatLogger``); docs/metrics.md says what each series means here.

:class:`MetricsExporter` owns the server's one ``CollectorRegistry``: at each scrape it renders
the sum of one or more snapshots (``ServerMetrics.snapshot``: one in the single-process server,
one per replica behind the Ray ingress), plus any extra families the caller adds. The engine
keeps cumulative totals, so counters are exported from the latest totals by a custom collector
instead of being incremented here. Summed replicas render as one engine, ``engine="0"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

# vLLM's buckets: time to first token (1 ms to 2560 s), per-token latencies (10 ms to 80 s),
# request phases (0.3 s to 7680 s), tokens per engine step, and the n parameter
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
RATE_WINDOW_S = 10.0  # tokens/s and utilisation are averaged over this window
TIERS = ("device", "host")
# vLLM's finish reasons that exist here (its "repetition" does not); all are exported from 0
FINISHED_REASONS = ("stop", "length", "abort", "error")
# the text format generate_latest writes (newer clients call it 1.0.0: the same for our names)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE = "0"  # vLLM's engine label: one engine here (the Ray ingress sums its replicas)
Sample = tuple[dict[str, str], float]  # (labels besides model_name and engine, value)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(frozen=True)
class HistogramSpec:
    """One exported histogram: its snapshot key, name, help and buckets."""

    key: str
    name: str
    help: str
    # "ttft", "token", "request", "length" (1-2-5 up to max_model_len), "iteration" or "n"
    buckets: str


HISTOGRAMS = (
    HistogramSpec("ttft", "vllm:time_to_first_token_seconds",
                  "Histogram of time to first token in seconds (from arrival in the engine).",
                  "ttft"),
    HistogramSpec("itl", "vllm:inter_token_latency_seconds",
                  "Histogram of inter-token latency in seconds. Here one observation per "
                  "generated token after a request's first: the time since the request's "
                  "previous token was produced. A speculative round delivers several tokens at "
                  "once: its first token counts the time since the previous round, the others "
                  "0 (so the sum is the decode time and the mean the time per output token).",
                  "token"),
    HistogramSpec("request_tpot", "vllm:request_time_per_output_token_seconds",
                  "Histogram of time_per_output_token_seconds per request: decode time / "
                  "(generated tokens - 1); 0 for a request of one token.", "token"),
    HistogramSpec("e2e", "vllm:e2e_request_latency_seconds",
                  "Histogram of e2e request latency in seconds.", "request"),
    HistogramSpec("queue", "vllm:request_queue_time_seconds",
                  "Histogram of time spent in WAITING phase for request.", "request"),
    HistogramSpec("inference", "vllm:request_inference_time_seconds",
                  "Histogram of time spent in RUNNING phase for request.", "request"),
    HistogramSpec("prefill", "vllm:request_prefill_time_seconds",
                  "Histogram of time spent in PREFILL phase for request.", "request"),
    HistogramSpec("decode", "vllm:request_decode_time_seconds",
                  "Histogram of time spent in DECODE phase for request.", "request"),
    HistogramSpec("prompt_tokens", "vllm:request_prompt_tokens",
                  "Number of prefill tokens processed (per request, prefix-cache hits "
                  "included).", "length"),
    HistogramSpec("generation_tokens", "vllm:request_generation_tokens",
                  "Number of generation tokens processed (per request).", "length"),
    HistogramSpec("max_num_generation_tokens", "vllm:request_max_num_generation_tokens",
                  "Histogram of maximum number of requested generation tokens (per prompt: "
                  "the most any of its n choices generated).", "length"),
    HistogramSpec("max_tokens", "vllm:request_params_max_tokens",
                  "Histogram of the max_tokens request parameter.", "length"),
    HistogramSpec("n", "vllm:request_params_n", "Histogram of the n request parameter.", "n"),
    HistogramSpec("iteration_tokens", "vllm:iteration_tokens_total",
                  "Histogram of number of tokens per engine_step (the prompts of requests whose "
                  "first token came in the step, plus the tokens generated).", "iteration"),
    HistogramSpec("inter_step", "specstream:inter_step_latency_seconds",
                  "One observation per request per step that gave it tokens after its first: "
                  "the time since its previous tokens (vLLM's own inter-token semantics, one "
                  "per iteration; vllm:inter_token_latency_seconds counts per token).", "token"),
)
# Older vLLM dashboards query this name for the inter-token histogram (vLLM renamed it in 0.11)
ITL_ALIAS = ("vllm:time_per_output_token_seconds",
             "Deprecated name of vllm:inter_token_latency_seconds (the same observations).")


def histogram_buckets(kind: str, max_model_len: int) -> tuple[float, ...]:
    """The bucket bounds of a :class:`HistogramSpec` kind."""
    if kind == "length":
        return build_1_2_5_buckets(max_model_len)
    return {"ttft": TTFT_BUCKETS, "token": TOKEN_LATENCY_BUCKETS,
            "request": REQUEST_LATENCY_BUCKETS, "iteration": ITERATION_TOKEN_BUCKETS,
            "n": N_BUCKETS}[kind]


def merge_snapshots(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Snapshots of several engines as one: numbers summed (lists element by element, dicts key
    by key), those under ``"mean"`` averaged and those under ``"info"`` the largest (replicas
    of one deployment share them, so their histograms have the same buckets)."""
    merged = _sum(snapshots)
    merged["mean"] = {k: v / len(snapshots) for k, v in merged["mean"].items()}
    merged["info"] = {k: max(s["info"][k] for s in snapshots if k in s.get("info", {}))
                      for k in merged.get("info", {})}
    return merged


def _sum(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, dict):
        keys = dict.fromkeys(k for v in values for k in v)  # union, in first-seen order
        return {k: _sum([v[k] for v in values if k in v]) for k in keys}
    if isinstance(first, list):
        width = max(len(v) for v in values)
        return [sum(v[i] for v in values if i < len(v)) for i in range(width)]
    return sum(values)


class MetricsExporter:
    """The server's one ``CollectorRegistry`` and its renderer, shared by the single-process
    server (one snapshot) and the Ray ingress (one per replica, plus its own families)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._snapshots: list[dict[str, Any]] = []
        self._extra: list[Metric] = []
        self.registry.register(self)

    def render(self, snapshots: list[dict[str, Any]], extra: Iterable[Metric] = ()) -> bytes:
        """The Prometheus text of ``snapshots`` summed, then ``extra``."""
        self._snapshots, self._extra = snapshots, list(extra)
        try:
            return generate_latest(self.registry)
        finally:
            self._snapshots, self._extra = [], []

    def describe(self) -> list[Metric]:
        return []  # names are only known at a scrape; nothing to check for clashes

    def collect(self) -> Iterator[Metric]:
        if self._snapshots:
            yield from self._families(merge_snapshots(self._snapshots))
        yield from self._extra

    def family(self, kind: str, name: str, help: str, samples: Iterable[Sample],
               engine: bool = True) -> Metric:
        """A gauge or counter family whose samples get ``model_name`` (and, for the engine's
        series, vLLM's ``engine``) first."""
        cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        base = ["model_name", "engine"] if engine else ["model_name"]
        values = [self.model_name, ENGINE] if engine else [self.model_name]
        fam: GaugeMetricFamily | CounterMetricFamily | None = None
        for labels, value in samples:
            if fam is None:
                fam = cls(name, help, labels=[*base, *labels])
            fam.add_metric([*values, *labels.values()], value)
        return fam if fam is not None else cls(name, help, labels=base)

    def histogram(self, name: str, help: str, buckets: tuple[float, ...],
                  h: dict[str, Any]) -> Metric:
        """A histogram family from a ``Histogram.snapshot()`` (counts per bucket, +Inf last),
        its bounds written as prometheus-client writes them (``le="1.0"``)."""
        fam = HistogramMetricFamily(name, help, labels=["model_name", "engine"])
        cumulative, total = [], 0
        for le, c in zip((*map(floatToGoString, buckets), "+Inf"), h["counts"]):
            total += c
            cumulative.append((le, total))
        fam.add_metric([self.model_name, ENGINE], cumulative, sum_value=h["sum"])
        return fam

    def _families(self, m: dict[str, Any]) -> Iterator[Metric]:
        yield from self._vllm_families(m)
        max_len = m["info"]["max_model_len"]
        for spec in HISTOGRAMS:
            yield self.histogram(spec.name, spec.help, histogram_buckets(spec.buckets, max_len),
                                 m["histograms"][spec.key])
        yield self.histogram(*ITL_ALIAS, histogram_buckets("token", max_len),
                             m["histograms"]["itl"])
        yield from self._engine_families(m)
        yield from self._spec_families(m)

    def _one(self, kind: str, name: str, help: str, value: float) -> Metric:
        return self.family(kind, name, help, [({}, value)])

    def _vllm_families(self, m: dict[str, Any]) -> Iterator[Metric]:
        """vLLM's gauges and counters (its histograms are in HISTOGRAMS)."""
        gauge, counter, one = m["gauge"], m["counter"], self._one
        used, total = m["kv_blocks_used"]["device"], m["kv_blocks_total"]["device"]
        usage = used / total if total else 0.0
        yield one("gauge", "vllm:num_requests_running",
                  "Number of requests in model execution batches.", gauge["requests_running"])
        yield one("gauge", "vllm:num_requests_waiting",
                  "Number of requests waiting to be processed.", gauge["requests_waiting"])
        yield one("gauge", "vllm:kv_cache_usage_perc",
                  "KV-cache usage. 1 means 100 percent usage (the device tier; both tiers: "
                  "specstream:kv_cache_usage_perc).", usage)
        yield one("gauge", "vllm:gpu_cache_usage_perc",
                  "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use "
                  "vllm:kv_cache_usage_perc instead (older vLLM dashboards query this).", usage)
        queries, hits = m["prefix_cache_queries"], m["prefix_cache_hits_total"]
        yield one("counter", "vllm:prefix_cache_queries",
                  "Prefix cache queries, in terms of number of queried tokens.", queries)
        yield one("counter", "vllm:prefix_cache_hits",
                  "Prefix cache hits, in terms of number of cached tokens (either tier; by "
                  "tier: specstream:prefix_cache_hits).", hits)
        yield one("counter", "vllm:num_preemptions",
                  "Cumulative number of preemption from the engine (always 0: an admitted "
                  "request holds the KV blocks it can ever need).", 0)
        prompt = counter["prompt_tokens"]
        yield one("counter", "vllm:prompt_tokens", "Number of prefill tokens processed.", prompt)
        yield self.family("counter", "vllm:prompt_tokens_by_source",
                          "Number of prompt tokens by source.",
                          [({"source": "local_compute"}, max(0, prompt - hits)),
                           ({"source": "local_cache_hit"}, hits),
                           ({"source": "external_kv_transfer"}, 0)])
        yield one("counter", "vllm:prompt_tokens_cached",
                  "Number of cached prompt tokens (local + external).", hits)
        yield one("counter", "vllm:generation_tokens", "Number of generation tokens processed.",
                  counter["generation_tokens"])
        yield self.family("counter", "vllm:request_success",
                          "Count of successfully processed requests (every finished engine "
                          "request, by why it finished).",
                          [({"finished_reason": k}, v) for k, v in m["finished"].items()])
        for name, help in (("num_drafts", "Number of spec decoding drafts."),
                           ("num_draft_tokens", "Number of draft tokens."),
                           ("num_accepted_tokens", "Number of accepted tokens.")):
            yield one("counter", f"vllm:spec_decode_{name}", help, counter[f"spec_decode_{name}"])
        yield self.family("counter", "vllm:spec_decode_num_accepted_tokens_per_pos",
                          "Accepted tokens per draft position (a token tree's: per depth).",
                          [({"position": str(i)}, v)
                           for i, v in enumerate(m["accepted_per_pos"])])

    def _engine_families(self, m: dict[str, Any]) -> Iterator[Metric]:
        """This engine's own series: both KV tiers, the link, residency, host attention."""
        gauge, counter, mean, one = m["gauge"], m["counter"], m["mean"], self._one
        yield one("gauge", "specstream:requests_pending_admission",
                  "HTTP requests waiting to be admitted (bounded by --max-queue).",
                  gauge["requests_pending_admission"])
        used, total = m["kv_blocks_used"], m["kv_blocks_total"]
        yield self.family("gauge", "specstream:kv_cache_blocks_used",
                          "KV blocks in use, by tier.", [({"tier": t}, used[t]) for t in TIERS])
        yield self.family("gauge", "specstream:kv_cache_blocks_total", "KV blocks, by tier.",
                          [({"tier": t}, total[t]) for t in TIERS])
        yield self.family("gauge", "specstream:kv_cache_usage_perc",
                          "Fraction of KV blocks in use, by tier (1 = full).",
                          [({"tier": t}, used[t] / total[t] if total[t] else 0.0)
                           for t in TIERS])
        yield self.family("counter", "specstream:prefix_cache_hits",
                          "Prompt tokens found in the prefix cache (not prefilled), by the tier "
                          "their copy came from.",
                          [({"tier": t}, m["prefix_cache_hits"][t]) for t in TIERS])
        yield self.family("gauge", "specstream:prefix_cache_blocks",
                          "KV blocks the prefix cache holds (they yield to requests), by tier.",
                          [({"tier": t}, m["prefix_cache_blocks"][t]) for t in TIERS])
        for key, help in (("kv_device_used_bytes", "Device KV bytes in use."),
                          ("kv_host_used_bytes", "Host KV bytes in use."),
                          ("kv_device_budget_bytes", "Device KV budget."),
                          ("shared_block_refs", "References to KV blocks that two or more "
                           "running requests share (prefix sharing)."),
                          ("unique_kv_bytes", "Running requests' KV bytes, a shared block "
                           "counted once.")):
            yield one("gauge", f"specstream:{key}", help, gauge[key])
        yield one("gauge", "specstream:generation_tokens_per_second",
                  f"Generated tokens/s over the last {RATE_WINDOW_S:g} s.",
                  gauge["generation_tokens_per_second"])
        yield self.family("counter", "specstream:link_bytes", "Bytes moved over the host link.",
                          [({"direction": d}, v) for d, v in m["link_bytes"].items()])
        for key in ("link_utilisation", "engine_utilisation"):
            what = "the host link was busy" if key.startswith("link") else "spent in engine steps"
            yield one("gauge", f"specstream:{key}",
                      f"Fraction of the last {RATE_WINDOW_S:g} s {what}.", mean[key])
        for key, help in (
            ("link_bytes_per_round", "History bytes moved to the device per decode round, "
                                     "since start."),
            ("link_bytes_floor_per_round", "History bytes per decode round that cannot be "
                                           "resident given the device KV budget, since start."),
            ("device_kv_utilization", "Fraction of device KV blocks holding history, "
                                      "time-averaged since start."),
            ("host_attention_share", "Share of the cold history the last step attended on the "
                                     "host CPU (host attention)."),
            ("host_attention_bytes_per_second", "Host attention's measured rate, KV bytes "
                                                "attended per second of its workers' time."),
        ):
            yield one("gauge", f"specstream:{key}", help, mean[key])
        yield one("counter", "specstream:host_attention_bytes",
                  "KV bytes of cold history attended on the host CPU.",
                  counter["host_attention_bytes"])
        yield self.family("counter", "specstream:requests_rejected",
                          "HTTP requests refused by backpressure, by reason.",
                          [({"reason": k}, v) for k, v in sorted(m["rejected"].items())])
        yield one("counter", "specstream:engine_loop_errors",
                  "Engine loop iterations that failed (their requests failed; the loop went on).",
                  counter["engine_loop_errors"])

    def _spec_families(self, m: dict[str, Any]) -> Iterator[Metric]:
        """Speculation this engine has beyond vLLM's counters: trees and the shapes chosen."""
        counter, one = m["counter"], self._one
        proposed = counter["spec_decode_num_draft_tokens"]
        accepted, rounds = counter["spec_decode_num_accepted_tokens"], m["spec_rounds"]
        yield one("counter", "specstream:spec_decode_tree_rounds",
                  "Verification rounds (per request) that checked a token tree.",
                  counter["spec_decode_tree_rounds"])
        yield one("counter", "specstream:spec_decode_tree_nodes",
                  "Draft tokens verified as token-tree nodes.", counter["spec_decode_tree_nodes"])
        yield self.family("counter", "specstream:spec_decode_depth_chosen",
                          "Steps by the draft depth speculative_policy=auto chose (0: none).",
                          [({"depth": k}, v) for k, v in sorted(m["depth_chosen"].items(),
                                                                key=lambda kv: int(kv[0]))])
        yield self.family("counter", "specstream:spec_decode_nodes_chosen",
                          "Steps by the draft nodes per request speculative_policy=auto chose "
                          "(a chain: its depth; a tree: its node budget).",
                          [({"nodes": k}, v) for k, v in sorted(m["nodes_chosen"].items(),
                                                                key=lambda kv: int(kv[0]))])
        yield one("gauge", "specstream:spec_acceptance_rate",
                  "Accepted / proposed draft tokens, since start.",
                  accepted / proposed if proposed else 0.0)
        yield one("gauge", "specstream:spec_mean_accepted_len",
                  "Tokens per verification round (accepted drafts + 1), since start.",
                  (accepted + rounds) / rounds if rounds else 0.0)
