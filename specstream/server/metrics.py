"""Server metrics: what the engine loop and the HTTP side count, exported with prometheus-client.

:class:`ServerMetrics` is the state of one engine (fed by its loop thread and its HTTP handlers;
one lock guards it, updates are a few additions). ``snapshot()`` turns it into plain data (no
objects, so a Ray replica can send it to the ingress). :class:`MetricsExporter` owns the
server's one ``CollectorRegistry``: at each scrape it renders the sum of one or more snapshots
(one in the single-process server, one per replica behind the Ray ingress), plus any extra
families the caller adds. Every series carries a ``model_name`` label, as vLLM's do.

Names follow vLLM's with a ``specstream_`` prefix (``specstream_spec_decode_num_drafts_total``
is vLLM's ``vllm:spec_decode_num_drafts``). The engine keeps cumulative totals, so counters are
exported from the latest totals by a custom collector instead of being incremented here.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from specstream.engine.request import RequestOutput

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
RATE_WINDOW_S = 10.0  # tokens/s and utilisation are averaged over this window
# the text format generate_latest writes (newer clients call it 1.0.0: the same for our names)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# (snapshot key, metric name, help) of the latency histograms
HISTOGRAMS = (
    ("ttft", "specstream_time_to_first_token_seconds",
     "Time from arrival in the engine to the first generated token."),
    ("tpot", "specstream_time_per_output_token_seconds",
     "Mean time per generated token after the first, per request."),
    ("e2e", "specstream_e2e_request_latency_seconds",
     "Time from arrival in the engine to the last token."),
)
TIERS = ("device", "host")
Sample = tuple[dict[str, str], float]  # (labels besides model_name, value)


class Histogram:
    """Bucket counts (the last one is +Inf), sum and count; cumulated when exported."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def snapshot(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sum": self.sum}


class ServerMetrics:
    """Everything one engine reports to ``/metrics``; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.histograms = {key: Histogram() for key, _, _ in HISTOGRAMS}
        self.finished: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self.loop_errors = 0
        self.engine: dict[str, Any] = {}
        self.busy_s = 0.0  # wall time spent inside engine.step()
        # (time, generated tokens, link busy s, engine busy s) samples for windowed rates
        self._samples: deque[tuple[float, float, float, float]] = deque()

    # ---- updates (engine-loop thread) ---------------------------------------------------
    def on_step(self, seconds: float) -> None:
        with self._lock:
            self.busy_s += seconds

    def on_finish(self, out: RequestOutput | None, reason: str) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if out is None:
                return
            m = out.metrics
            if "ttft_s" in m:
                self.histograms["ttft"].observe(m["ttft_s"])
            if "tpot_s" in m and len(out.outputs[0].token_ids) > 1:
                self.histograms["tpot"].observe(m["tpot_s"])
            if "arrival_time" in m:
                self.histograms["e2e"].observe(time.perf_counter() - m["arrival_time"])

    def on_loop_error(self) -> None:
        with self._lock:
            self.loop_errors += 1

    def on_engine(self, engine_metrics: dict[str, Any]) -> None:
        now = time.perf_counter()
        with self._lock:
            self.engine = dict(engine_metrics)
            self._samples.append((now, float(engine_metrics.get("generated_tokens", 0)),
                                  float(engine_metrics.get("link_busy_s", 0.0)), self.busy_s))
            while len(self._samples) > 2 and now - self._samples[1][0] > RATE_WINDOW_S:
                self._samples.popleft()

    # ---- updates (HTTP side) ------------------------------------------------------------
    def on_reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    # ---- reading ------------------------------------------------------------------------
    def rates(self) -> tuple[float, float, float]:
        """(generated tokens/s, link utilisation, engine utilisation) over the window."""
        with self._lock:
            if len(self._samples) < 2:
                return 0.0, 0.0, 0.0
            (t0, g0, l0, b0), (t1, g1, l1, b1) = self._samples[0], self._samples[-1]
        dt = max(t1 - t0, 1e-9)
        return (g1 - g0) / dt, min(1.0, (l1 - l0) / dt), min(1.0, (b1 - b0) / dt)

    def snapshot(self, pending_admission: int) -> dict[str, Any]:
        """Plain data (numbers, lists, dicts) that :func:`merge_snapshots` can add up: every
        number is summed over engines, except those under ``"mean"``, which are averaged."""
        tok_s, link_util, engine_util = self.rates()
        with self._lock:
            e = self.engine
            return {
                "gauge": {
                    "requests_running": e.get("running", 0),
                    "requests_waiting": e.get("waiting", 0),
                    "requests_pending_admission": pending_admission,
                    "kv_device_used_bytes": e.get("device_kv_used_bytes", 0),
                    "kv_host_used_bytes": e.get("host_kv_used_bytes", 0),
                    "kv_device_budget_bytes": e.get("device_kv_budget_bytes", 0),
                    "generation_tokens_per_second": tok_s,
                },
                "mean": {"link_utilisation": link_util, "engine_utilisation": engine_util,
                         "link_bytes_per_round": e.get("link_bytes_per_round", 0.0),
                         "link_bytes_floor_per_round": e.get("link_bytes_floor_per_round", 0.0),
                         "device_kv_utilization": e.get("device_kv_utilization", 0.0)},
                "counter": {
                    "prompt_tokens": e.get("prompt_tokens", 0),
                    "generation_tokens": e.get("generated_tokens", 0),
                    "spec_decode_num_drafts": e.get("num_drafts", 0),
                    "spec_decode_num_draft_tokens": e.get("proposed_tokens", 0),
                    "spec_decode_num_accepted_tokens": e.get("accepted_tokens", 0),
                    "spec_decode_tree_rounds": e.get("tree_rounds", 0),
                    "spec_decode_tree_nodes": e.get("tree_nodes", 0),
                    "engine_loop_errors": self.loop_errors,
                },
                # speculative_policy auto: steps per chosen depth and per chosen node count
                "depth_chosen": {str(k): v for k, v in
                                 e.get("speculative_depth_chosen", {}).items()},
                "nodes_chosen": {str(k): v for k, v in
                                 e.get("speculative_nodes_chosen", {}).items()},
                "spec_rounds": e.get("rounds", 0),  # for the mean accepted length
                "accepted_per_pos": list(e.get("accepted_per_pos", [])),
                "kv_blocks_used": {t: e.get(f"{t}_kv_blocks_used", 0) for t in TIERS},
                "kv_blocks_total": {t: e.get(f"{t}_kv_blocks_total", 0) for t in TIERS},
                # automatic prefix caching: prompt tokens looked up, found (by the tier the
                # copy came from), and the blocks the cache holds
                "prefix_cache_queries": e.get("prefix_cache_queries_total", 0),
                "prefix_cache_hits": {t: e.get("prefix_cache_hits_by_tier", {}).get(t, 0)
                                      for t in TIERS},
                "prefix_cache_blocks": {t: e.get("prefix_cache_blocks", {}).get(t, 0)
                                        for t in TIERS},
                "link_bytes": {d: e.get(f"link_bytes_{d}", 0) for d in ("h2d", "d2h")},
                "finished": dict(self.finished),
                "rejected": dict(self.rejected),
                "histograms": {k: h.snapshot() for k, h in self.histograms.items()},
            }


def merge_snapshots(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Snapshots of several engines as one: numbers summed (lists element by element, dicts key
    by key), those under ``"mean"`` averaged."""
    merged = _sum(snapshots)
    merged["mean"] = {k: v / len(snapshots) for k, v in merged["mean"].items()}
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

    def family(self, kind: str, name: str, help: str, samples: Iterable[Sample]) -> Metric:
        """A gauge or counter family whose samples get the ``model_name`` label first."""
        cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        fam: Metric | None = None
        for labels, value in samples:
            if fam is None:
                fam = cls(name, help, labels=["model_name", *labels])
            fam.add_metric([self.model_name, *labels.values()], value)
        return fam if fam is not None else cls(name, help, labels=["model_name"])

    def _families(self, m: dict[str, Any]) -> Iterator[Metric]:
        gauge, counter = m["gauge"], m["counter"]

        def one(kind: str, name: str, help: str, value: float) -> Metric:
            return self.family(kind, name, help, [({}, value)])

        yield one("gauge", "specstream_requests_running", "Requests admitted and being decoded.",
                  gauge["requests_running"])
        yield one("gauge", "specstream_requests_waiting",
                  "Requests in the engine waiting for KV memory or a batch slot.",
                  gauge["requests_waiting"])
        yield one("gauge", "specstream_requests_pending_admission",
                  "HTTP requests waiting to be admitted (bounded by --max-queue).",
                  gauge["requests_pending_admission"])
        used, total = m["kv_blocks_used"], m["kv_blocks_total"]
        yield self.family("gauge", "specstream_kv_cache_blocks_used", "KV blocks in use, by tier.",
                          [({"tier": t}, used[t]) for t in TIERS])
        yield self.family("gauge", "specstream_kv_cache_blocks_total", "KV blocks, by tier.",
                          [({"tier": t}, total[t]) for t in TIERS])
        yield self.family("gauge", "specstream_kv_cache_usage_perc",
                          "Fraction of KV blocks in use, by tier (1 = full).",
                          [({"tier": t}, used[t] / total[t] if total[t] else 0.0)
                           for t in TIERS])
        yield one("counter", "specstream_prefix_cache_queries",
                  "Prompt tokens looked up in the prefix cache.", m["prefix_cache_queries"])
        yield self.family("counter", "specstream_prefix_cache_hits",
                          "Prompt tokens found in the prefix cache (not prefilled), by the tier "
                          "their copy came from.",
                          [({"tier": t}, m["prefix_cache_hits"][t]) for t in TIERS])
        yield self.family("gauge", "specstream_prefix_cache_blocks",
                          "KV blocks the prefix cache holds (they yield to requests), by tier.",
                          [({"tier": t}, m["prefix_cache_blocks"][t]) for t in TIERS])
        yield one("gauge", "specstream_kv_device_used_bytes", "Device KV bytes in use.",
                  gauge["kv_device_used_bytes"])
        yield one("gauge", "specstream_kv_host_used_bytes", "Host KV bytes in use.",
                  gauge["kv_host_used_bytes"])
        yield one("gauge", "specstream_kv_device_budget_bytes", "Device KV budget.",
                  gauge["kv_device_budget_bytes"])
        yield one("counter", "specstream_prompt_tokens", "Prompt tokens admitted.",
                  counter["prompt_tokens"])
        yield one("counter", "specstream_generation_tokens", "Tokens generated.",
                  counter["generation_tokens"])
        yield one("gauge", "specstream_generation_tokens_per_second",
                  f"Generated tokens/s over the last {RATE_WINDOW_S:g} s.",
                  gauge["generation_tokens_per_second"])
        yield from self._spec_families(m)
        yield self.family("counter", "specstream_link_bytes", "Bytes moved over the host link.",
                          [({"direction": d}, v) for d, v in m["link_bytes"].items()])
        for key in ("link_utilisation", "engine_utilisation"):
            what = "the host link was busy" if key.startswith("link") else "spent in engine steps"
            yield one("gauge", f"specstream_{key}",
                      f"Fraction of the last {RATE_WINDOW_S:g} s {what}.", m["mean"][key])
        for key, help in (
            ("link_bytes_per_round", "History bytes moved to the device per decode round, "
                                     "since start."),
            ("link_bytes_floor_per_round", "History bytes per decode round that cannot be "
                                           "resident given the device KV budget, since start."),
            ("device_kv_utilization", "Fraction of device KV blocks holding history, "
                                      "time-averaged since start."),
        ):
            yield one("gauge", f"specstream_{key}", help, m["mean"][key])
        yield self.family("counter", "specstream_requests_finished",
                          "Engine requests finished, by finish reason.",
                          [({"finish_reason": k}, v) for k, v in sorted(m["finished"].items())])
        yield self.family("counter", "specstream_requests_rejected",
                          "HTTP requests refused by backpressure, by reason.",
                          [({"reason": k}, v) for k, v in sorted(m["rejected"].items())])
        yield one("counter", "specstream_engine_loop_errors",
                  "Engine loop iterations that failed (their requests failed; the loop went on).",
                  counter["engine_loop_errors"])
        for key, name, help in HISTOGRAMS:
            h = m["histograms"][key]
            fam = HistogramMetricFamily(name, help, labels=["model_name"])
            cumulative, total = [], 0
            for le, c in zip((*map(str, LATENCY_BUCKETS), "+Inf"), h["counts"]):
                total += c
                cumulative.append((le, total))
            fam.add_metric([self.model_name], cumulative, sum_value=h["sum"])
            yield fam

    def _spec_families(self, m: dict[str, Any]) -> Iterator[Metric]:
        counter = m["counter"]
        drafts, proposed = (counter["spec_decode_num_drafts"],
                            counter["spec_decode_num_draft_tokens"])
        accepted, rounds = counter["spec_decode_num_accepted_tokens"], m["spec_rounds"]
        for name, help, value in (
            ("num_drafts", "Verification rounds that checked draft tokens (per request).",
             drafts),
            ("num_draft_tokens", "Draft tokens proposed.", proposed),
            ("num_accepted_tokens", "Draft tokens accepted.", accepted),
        ):
            yield self.family("counter", f"specstream_spec_decode_{name}", help, [({}, value)])
        for name, help in (
            ("tree_rounds", "Verification rounds (per request) that checked a token tree."),
            ("tree_nodes", "Draft tokens verified as token-tree nodes."),
        ):
            yield self.family("counter", f"specstream_spec_decode_{name}", help,
                              [({}, counter[f"spec_decode_{name}"])])
        yield self.family("counter", "specstream_spec_decode_depth_chosen",
                          "Steps by the draft depth speculative_policy=auto chose (0: none).",
                          [({"depth": k}, v) for k, v in sorted(m["depth_chosen"].items(),
                                                                key=lambda kv: int(kv[0]))])
        yield self.family("counter", "specstream_spec_decode_nodes_chosen",
                          "Steps by the draft nodes per request speculative_policy=auto chose "
                          "(a chain: its depth; a tree: its node budget).",
                          [({"nodes": k}, v) for k, v in sorted(m["nodes_chosen"].items(),
                                                                key=lambda kv: int(kv[0]))])
        yield self.family("counter", "specstream_spec_decode_num_accepted_tokens_per_pos",
                          "Accepted draft tokens by position in the draft (0 = first).",
                          [({"position": str(i)}, v)
                           for i, v in enumerate(m["accepted_per_pos"])])
        yield self.family("gauge", "specstream_spec_acceptance_rate",
                          "Accepted / proposed draft tokens, since start.",
                          [({}, accepted / proposed if proposed else 0.0)])
        yield self.family("gauge", "specstream_spec_mean_accepted_len",
                          "Tokens per verification round (accepted drafts + 1), since start.",
                          [({}, (accepted + rounds) / rounds if rounds else 0.0)])
