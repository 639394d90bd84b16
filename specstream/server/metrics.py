"""Server metrics: what the engine loop and the HTTP side count.

:class:`ServerMetrics` is the state of one engine (fed by its loop thread and its HTTP handlers;
one lock guards it, updates are a few additions). ``snapshot()`` turns it into plain data (no
objects, so a Ray replica can send it to the ingress); ``exposition.merge_snapshots`` adds
several up and ``exposition.MetricsExporter`` renders them under vLLM's names (both are
importable from here too). docs/metrics.md lists every series and what it means here.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from typing import Any

from specstream.engine.request import RequestOutput
from specstream.server.exposition import (
    CONTENT_TYPE,
    FINISHED_REASONS,
    HISTOGRAMS,
    RATE_WINDOW_S,
    TIERS,
    MetricsExporter,
    histogram_buckets,
    merge_snapshots,
)

DEFAULT_MAX_MODEL_LEN = 8192  # token-count buckets of a ServerMetrics built without an engine
__all__ = ["CONTENT_TYPE", "Histogram", "MetricsExporter", "ServerMetrics", "merge_snapshots",
           "request_times"]


class Histogram:
    """Bucket counts (the last one is +Inf), sum and count; cumulated when exported."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        if times > 0:
            self.counts[bisect.bisect_left(self.buckets, value)] += times
            self.sum += value * times

    def snapshot(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sum": self.sum}


def request_times(m: dict[str, float], num_generated: int, now: float) -> dict[str, float]:
    """A finished request's phases (seconds) from ``RequestOutput.metrics`` (perf_counter
    times), by histogram key; a phase whose times the engine did not give is left out.

    queue = first scheduled - arrival, prefill = first token - first scheduled, decode = last
    token - first token, inference = last token - first scheduled, e2e = finished - arrival
    (now, without a finish time), time per output token = decode / (generated - 1).
    """
    arrival, sched = m.get("arrival_time"), m.get("first_scheduled_time")
    first, end = m.get("first_token_time"), m.get("finished_time")
    last = m.get("last_token_time", end)
    out: dict[str, float] = {}
    if arrival is not None:
        out["e2e"] = (end if end is not None else now) - arrival
        if sched is not None:
            out["queue"] = sched - arrival
    if sched is not None and first is not None:
        out["prefill"] = first - sched
    if first is not None and last is not None:
        out["decode"] = last - first
    if sched is not None and last is not None:
        out["inference"] = last - sched
    if "decode" in out:
        out["request_tpot"] = out["decode"] / (num_generated - 1) if num_generated > 1 else 0.0
    elif "tpot_s" in m:
        out["request_tpot"] = m["tpot_s"] if num_generated > 1 else 0.0
    return {k: max(0.0, v) for k, v in out.items()}


class ServerMetrics:
    """Everything one engine reports to ``/metrics``; thread-safe.

    ``max_model_len`` sets the token-count buckets (vLLM's 1-2-5 series up to it);
    ``num_speculative_tokens`` the draft positions exported from the start (vLLM's).
    """

    def __init__(self, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                 num_speculative_tokens: int = 0) -> None:
        self._lock = threading.Lock()
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.histograms = {s.key: Histogram(histogram_buckets(s.buckets, max_model_len))
                           for s in HISTOGRAMS}
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

    def on_tokens(self, new_tokens: int, ttft_s: float | None = None,
                  gap_s: float | None = None) -> None:
        """``new_tokens`` that one step gave one request: its first ones (``ttft_s``: their
        time to first token), or later ones ``gap_s`` after its previous tokens. Per token,
        the step's first waited the gap and the rest came with it (0 s)."""
        if new_tokens <= 0:
            return
        with self._lock:
            h = self.histograms
            if ttft_s is not None:
                h["ttft"].observe(max(0.0, ttft_s))
            elif gap_s is not None:
                h["itl"].observe(max(0.0, gap_s))
                h["inter_step"].observe(max(0.0, gap_s))
            h["itl"].observe(0.0, new_tokens - 1)

    def on_iteration(self, num_tokens: int) -> None:
        """One engine step's tokens (vLLM's iteration_tokens_total)."""
        if num_tokens > 0:
            with self._lock:
                self.histograms["iteration_tokens"].observe(num_tokens)

    def on_finish(self, out: RequestOutput | None, reason: str,
                  max_tokens: int | None = None) -> None:
        """One engine request ended (``out``: its last output, None when aborted or failed
        before it had one)."""
        now = time.perf_counter()
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if out is None:
                return
            h = self.histograms
            generated = len(out.outputs[0].token_ids)
            h["prompt_tokens"].observe(len(out.prompt_token_ids))
            h["generation_tokens"].observe(generated)
            if max_tokens:
                h["max_tokens"].observe(max_tokens)
            for key, value in request_times(out.metrics, generated, now).items():
                h[key].observe(value)

    def on_parent_finished(self, n: int, max_generated: int) -> None:
        """All ``n`` choices of one prompt ended; the longest generated ``max_generated``."""
        with self._lock:
            self.histograms["n"].observe(n)
            self.histograms["max_num_generation_tokens"].observe(max_generated)

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
        number is summed over engines, except those under ``"mean"`` (averaged) and
        ``"info"`` (the largest)."""
        tok_s, link_util, engine_util = self.rates()
        with self._lock:
            e = self.engine
            hits_by_tier = e.get("prefix_cache_hits_by_tier", {})
            per_pos = list(e.get("accepted_per_pos", []))
            per_pos += [0] * (self.num_speculative_tokens - len(per_pos))
            return {
                "info": {"max_model_len": self.max_model_len},
                "gauge": {
                    "requests_running": e.get("running", 0),
                    "requests_waiting": e.get("waiting", 0),
                    "requests_pending_admission": pending_admission,
                    "kv_device_used_bytes": e.get("device_kv_used_bytes", 0),
                    "kv_host_used_bytes": e.get("host_kv_used_bytes", 0),
                    "kv_device_budget_bytes": e.get("device_kv_budget_bytes", 0),
                    "shared_block_refs": e.get("shared_block_refs", 0),
                    "unique_kv_bytes": e.get("unique_kv_bytes", 0),
                    "generation_tokens_per_second": tok_s,
                },
                "mean": {"link_utilisation": link_util, "engine_utilisation": engine_util,
                         "link_bytes_per_round": e.get("link_bytes_per_round", 0.0),
                         "link_bytes_floor_per_round": e.get("link_bytes_floor_per_round", 0.0),
                         "device_kv_utilization": e.get("device_kv_utilization", 0.0),
                         "host_attention_share": e.get("host_attention_share", 0.0),
                         "host_attention_bytes_per_second":
                             e.get("host_attention_bytes_per_s", 0.0)},
                "counter": {
                    "prompt_tokens": e.get("prompt_tokens", 0),
                    "generation_tokens": e.get("generated_tokens", 0),
                    "spec_decode_num_drafts": e.get("num_drafts", 0),
                    "spec_decode_num_draft_tokens": e.get("proposed_tokens", 0),
                    "spec_decode_num_accepted_tokens": e.get("accepted_tokens", 0),
                    "spec_decode_tree_rounds": e.get("tree_rounds", 0),
                    "spec_decode_tree_nodes": e.get("tree_nodes", 0),
                    "host_attention_bytes": e.get("host_attention_bytes", 0),
                    "engine_loop_errors": self.loop_errors,
                },
                # speculative_policy auto: steps per chosen depth and per chosen node count
                "depth_chosen": {str(k): v for k, v in
                                 e.get("speculative_depth_chosen", {}).items()},
                "nodes_chosen": {str(k): v for k, v in
                                 e.get("speculative_nodes_chosen", {}).items()},
                "spec_rounds": e.get("rounds", 0),  # for the mean accepted length
                "accepted_per_pos": per_pos,
                "kv_blocks_used": {t: e.get(f"{t}_kv_blocks_used", 0) for t in TIERS},
                "kv_blocks_total": {t: e.get(f"{t}_kv_blocks_total", 0) for t in TIERS},
                # automatic prefix caching: prompt tokens looked up, found (in all, and by the
                # tier the copy came from), and the blocks the cache holds
                "prefix_cache_queries": e.get("prefix_cache_queries_total", 0),
                "prefix_cache_hits_total": e.get("prefix_cache_hits_total",
                                                 sum(hits_by_tier.values())),
                "prefix_cache_hits": {t: hits_by_tier.get(t, 0) for t in TIERS},
                "prefix_cache_blocks": {t: e.get("prefix_cache_blocks", {}).get(t, 0)
                                        for t in TIERS},
                "link_bytes": {d: e.get(f"link_bytes_{d}", 0) for d in ("h2d", "d2h")},
                "finished": {**dict.fromkeys(FINISHED_REASONS, 0), **self.finished},
                "rejected": dict(self.rejected),
                "histograms": {k: h.snapshot() for k, h in self.histograms.items()},
            }
