"""Server metrics in the Prometheus text format (no client library needed).

The engine-loop thread feeds this object (step times, finished requests, engine counters); HTTP
handlers feed rejections; ``GET /metrics`` renders it. One lock guards it all: updates are a few
additions, far cheaper than a step.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from typing import Any

from specstream.engine.request import RequestOutput

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
RATE_WINDOW_S = 10.0  # tokens/s and utilisation are averaged over this window


class Histogram:
    """Cumulative-bucket histogram, rendered as ``_bucket{le=...}``, ``_sum`` and ``_count``."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for le, c in zip((*map(str, self.buckets), "+Inf"), self.counts):
            total += c
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        lines += [f"{self.name}_sum {self.sum:.6f}", f"{self.name}_count {self.count}"]
        return lines


class ServerMetrics:
    """Everything ``/metrics`` reports; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram("specstream_time_to_first_token_seconds",
                              "Time from arrival in the engine to the first generated token.")
        self.tpot = Histogram("specstream_time_per_output_token_seconds",
                              "Mean time per generated token after the first, per request.")
        self.e2e = Histogram("specstream_e2e_request_latency_seconds",
                             "Time from arrival in the engine to the last token.")
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
                self.ttft.observe(m["ttft_s"])
            if "tpot_s" in m and len(out.outputs[0].token_ids) > 1:
                self.tpot.observe(m["tpot_s"])
            if "arrival_time" in m:
                self.e2e.observe(time.perf_counter() - m["arrival_time"])

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

    # ---- rendering ----------------------------------------------------------------------
    def rates(self) -> tuple[float, float, float]:
        """(generated tokens/s, link utilisation, engine utilisation) over the window."""
        with self._lock:
            if len(self._samples) < 2:
                return 0.0, 0.0, 0.0
            (t0, g0, l0, b0), (t1, g1, l1, b1) = self._samples[0], self._samples[-1]
        dt = max(t1 - t0, 1e-9)
        return (g1 - g0) / dt, min(1.0, (l1 - l0) / dt), min(1.0, (b1 - b0) / dt)

    def render(self, pending_admission: int) -> str:
        tok_s, link_util, engine_util = self.rates()
        with self._lock:
            e = self.engine
            out: list[str] = []

            def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
                out.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}"])
                out.extend(f"{name}{labels} {_fmt(value)}" for labels, value in samples)

            def gauge(name: str, help: str, value: float) -> None:
                metric(name, "gauge", help, [("", value)])

            gauge("specstream_requests_running", "Requests admitted and being decoded.",
                  e.get("running", 0))
            gauge("specstream_requests_waiting", "Requests in the engine waiting for KV memory.",
                  e.get("waiting", 0))
            gauge("specstream_requests_pending_admission",
                  "HTTP requests waiting to be admitted (bounded by --max-queue).",
                  pending_admission)
            gauge("specstream_kv_device_used_bytes", "Device KV bytes in use.",
                  e.get("device_kv_used_bytes", 0))
            gauge("specstream_kv_host_used_bytes", "Host KV bytes in use.",
                  e.get("host_kv_used_bytes", 0))
            gauge("specstream_kv_device_budget_bytes", "Device KV budget.",
                  e.get("device_kv_budget_bytes", 0))
            metric("specstream_prompt_tokens_total", "counter", "Prompt tokens admitted.",
                   [("", e.get("prompt_tokens", 0))])
            metric("specstream_generation_tokens_total", "counter", "Tokens generated.",
                   [("", e.get("generated_tokens", 0))])
            gauge("specstream_generation_tokens_per_second",
                  f"Generated tokens/s over the last {RATE_WINDOW_S:g} s.", tok_s)
            gauge("specstream_spec_acceptance_rate", "Accepted / proposed draft tokens.",
                  e.get("acceptance_rate", 0.0))
            gauge("specstream_spec_mean_accepted_len", "Tokens per verification round.",
                  e.get("mean_accepted_len", 0.0))
            metric("specstream_link_bytes_total", "counter", "Bytes moved over the host link.",
                   [('{direction="h2d"}', e.get("link_bytes_h2d", 0)),
                    ('{direction="d2h"}', e.get("link_bytes_d2h", 0))])
            gauge("specstream_link_utilisation",
                  f"Fraction of the last {RATE_WINDOW_S:g} s the host link was busy.", link_util)
            gauge("specstream_engine_utilisation",
                  f"Fraction of the last {RATE_WINDOW_S:g} s spent in engine steps.", engine_util)
            metric("specstream_requests_finished_total", "counter",
                   "Engine requests finished, by finish reason.",
                   [(f'{{finish_reason="{k}"}}', v) for k, v in sorted(self.finished.items())])
            metric("specstream_requests_rejected_total", "counter",
                   "HTTP requests refused by backpressure, by reason.",
                   [(f'{{reason="{k}"}}', v) for k, v in sorted(self.rejected.items())])
            metric("specstream_engine_loop_errors_total", "counter",
                   "Engine loop iterations that failed (their requests failed, the loop went on).",
                   [("", self.loop_errors)])
            for h in (self.ttft, self.tpot, self.e2e):
                out.extend(h.render())
        return "\n".join(out) + "\n"


def _fmt(value: float) -> str:
    """Integers exactly (byte counters exceed %g's precision), floats with full precision."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
