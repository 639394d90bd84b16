"""What ``bench/serve_load.py`` reports: each request's :class:`Result`, and the run's
:class:`Summary` (throughput, TTFT / TPOT / end-to-end percentiles, TTFT by turn, failures by
message, the server's gauges and its prefix cache over the run), printed and written as JSON.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Result:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    error: str | None = None
    text: str = ""  # the streamed completion
    turn: int | None = None  # --workload multiturn: the turn's index in its conversation (0-based)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class Summary:
    sent: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests/s
    output_throughput: float  # generated tokens/s
    total_token_throughput: float  # (prompt + generated) tokens/s
    ttft_ms: dict[str, float] = field(default_factory=dict)
    tpot_ms: dict[str, float] = field(default_factory=dict)
    latency_ms: dict[str, float] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    server: dict[str, float] = field(default_factory=dict)
    # --workload multiturn: TTFT by turn ("1", "2", ...); the server's prefix cache over the run
    ttft_ms_by_turn: dict[str, dict[str, float]] = field(default_factory=dict)
    prefix_cache: dict[str, float] = field(default_factory=dict)


def prefix_cache(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The server's prefix cache over the run: prompt tokens looked up and found (by tier),
    the hit rate, and the blocks it holds at the end (empty if the server has none)."""
    if not any(k.startswith("prefix_cache_") for k in after):
        return {}

    def delta(k: str) -> float:
        return after.get(k, 0.0) - before.get(k, 0.0)

    # counters: `prefix_cache_queries_total`, `prefix_cache_hits_total:<tier>` (or unlabelled)
    out = {"queries": sum(delta(k) for k in after if k.startswith("prefix_cache_queries"))}
    hits = {k.partition(":")[2] or "all": delta(k) for k in after
            if k.startswith("prefix_cache_hits")}
    out.update({f"hits_{t}": v for t, v in hits.items() if t != "all"})
    out["hits"] = sum(hits.values())
    out["hit_rate"] = out["hits"] / out["queries"] if out["queries"] else 0.0
    out.update({f"blocks_{k.split(':', 1)[1]}": v for k, v in after.items()
                if k.startswith("prefix_cache_blocks:")})
    return out


def summarize(results: list[Result], duration: float, server: dict[str, float],
              before: dict[str, float] | None = None) -> Summary:
    ok = [r for r in results if r.ok]

    def pct(values: list[float]) -> dict[str, float]:
        if not values:
            return {}
        a = np.array(values) * 1000
        return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
                "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}

    out_tokens = sum(r.output_tokens for r in ok)
    return Summary(
        sent=len(results), completed=len(ok), failed=len(results) - len(ok),
        duration_s=duration, request_throughput=len(ok) / duration,
        output_throughput=out_tokens / duration,
        total_token_throughput=(out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        ttft_ms=pct([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=pct([r.tpot_s for r in ok if r.tpot_s is not None]),
        latency_ms=pct([r.latency_s for r in ok]),
        errors=dict(Counter(r.error for r in results if not r.ok and r.error)),
        server=server,
        ttft_ms_by_turn={str(t + 1): pct([r.ttft_s for r in ok
                                          if r.turn == t and r.ttft_s is not None])
                         for t in sorted({r.turn for r in ok if r.turn is not None})},
        prefix_cache=prefix_cache(before or {}, server),
    )


def print_summary(s: Summary) -> None:
    print(f"requests: {s.sent} sent, {s.completed} completed, {s.failed} failed "
          f"in {s.duration_s:.1f} s")
    print(f"throughput: {s.request_throughput:.2f} req/s, {s.output_throughput:.1f} output "
          f"tok/s, {s.total_token_throughput:.1f} total tok/s")
    for name, d in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("E2E", s.latency_ms),
                    *((f"TTFT turn {t}", d) for t, d in s.ttft_ms_by_turn.items())):
        if d:
            print(f"{name:5s} ms: " + "  ".join(f"{k} {v:.1f}" for k, v in d.items()))
    if s.prefix_cache:
        print("prefix cache: " + "  ".join(f"{k} {v:.3g}" if isinstance(v, float) and v < 1
                                           else f"{k} {v:.0f}"
                                           for k, v in s.prefix_cache.items()))
    for msg, n in s.errors.items():
        print(f"error x{n}: {msg}")
    if s.server:
        print("server: " + "  ".join(f"{k} {v:.6g}" if v < 1e6 else f"{k} {v:.0f}"
                                     for k, v in s.server.items()))
