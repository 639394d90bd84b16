"""Round tracing: spans per lane (link, verify, draft, waits), Chrome trace JSON and a PNG.

Disabled tracers cost one attribute check per span. Timestamps are ``time.perf_counter``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LANES = ("link h2d", "link d2h", "verify", "draft", "wait")


@dataclass(frozen=True)
class Span:
    lane: str
    name: str
    start: float
    end: float
    args: dict[str, Any] | None = None


class Tracer:
    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.spans: list[Span] = []
        self.t0 = time.perf_counter()

    def add(self, lane: str, name: str, start: float, end: float, **args: object) -> None:
        if self.enabled:
            self.spans.append(Span(lane, name, start, end, args or None))

    @contextmanager
    def span(self, lane: str, name: str, **args: object) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append(Span(lane, name, start, time.perf_counter(), args or None))

    def to_chrome(self, path: str | Path) -> None:
        """Chrome trace event JSON (open in Perfetto or chrome://tracing)."""
        lanes = {lane: i for i, lane in enumerate(LANES)}
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": lane}}
            for lane, i in lanes.items()
        ]
        for s in sorted(self.spans, key=lambda s: s.start):
            tid = lanes.setdefault(s.lane, len(lanes))
            events.append({
                "ph": "X", "name": s.name, "pid": 0, "tid": tid,
                "ts": (s.start - self.t0) * 1e6, "dur": max(0.0, s.end - s.start) * 1e6,
                "args": s.args or {},
            })
        Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))

    def to_png(self, path: str | Path, rounds: int = 4, title: str = "") -> None:
        """A timeline of the first ``rounds`` decode rounds, one lane per stream."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        marks = sorted(s.start for s in self.spans if s.lane == "round")
        if not marks:
            return
        # steady-state decode: the middle of the run, away from prefill and the drain
        first = max(0, len(marks) // 2 - rounds // 2)
        lo = marks[first]
        hi = marks[first + rounds] if first + rounds < len(marks) else max(
            s.end for s in self.spans)
        colors = {"link h2d": "tab:blue", "link d2h": "tab:cyan", "verify": "tab:green",
                  "draft": "tab:orange", "wait": "tab:red"}
        fig, ax = plt.subplots(figsize=(12, 3.2))
        for i, lane in enumerate(LANES):
            bars = [((s.start - lo) * 1e3, (s.end - s.start) * 1e3) for s in self.spans
                    if s.lane == lane and s.end > lo and s.start < hi]
            ax.broken_barh(bars, (i - 0.4, 0.8), color=colors[lane])
        for m in marks:
            if lo <= m <= hi:
                ax.axvline((m - lo) * 1e3, color="k", lw=0.6, ls=":")
        ax.set_yticks(range(len(LANES)), LANES)
        ax.set_xlabel("ms (dotted lines: decode round starts)")
        ax.set_title(title or "SpecStream rounds")
        ax.set_xlim(0, (hi - lo) * 1e3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
