"""Drafting in the compute gaps that transfers leave, under a round-slowdown budget.

While verification waits for a chunk still crossing the link, the device's compute is idle; the
gap filler runs one draft forward (for the *other* group of requests) at a time there. A draft
step is indivisible and may last longer than one chunk's transfer, so what decides whether it is
free is the link, not the awaited chunk: the step starts only if the copies already issued keep
the link busy until it ends (``link_busy_until``, from the link-rate estimate), give or take the
remaining budget. Meanwhile landed chunks simply wait in their staging buffers, and verification
catches up on them after the step; the deeper the staging ring, the longer the step that fits.
At most ``budget`` (default 5%) of the verification time so far may be lost to draft steps that
outlasted the issued copies (link idle, or verification kept waiting at the end of the round).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from specstream.engine.trace import Tracer
from specstream.spec.proposer import ProposeJob


class GapFiller:
    def __init__(self, job: ProposeJob, tracer: Tracer, budget: float = 0.05) -> None:
        self.job, self.tracer, self.budget = job, tracer, budget
        self.start = time.perf_counter()
        self.step_ema: float | None = None
        self.overrun_s = 0.0  # verification delay caused by draft steps (estimated)
        self.draft_s = 0.0  # draft time spent inside gaps
        self.steps = 0

    def _run_step(self) -> float:
        t0 = time.perf_counter()
        self.job.step()
        t1 = time.perf_counter()
        dt = t1 - t0
        self.step_ema = dt if self.step_ema is None else 0.7 * self.step_ema + 0.3 * dt
        self.draft_s += dt
        self.steps += 1
        self.tracer.add("draft", "draft step (gap)", t0, t1)
        return t1

    def fill(self, landed: Callable[[], bool], link_busy_until: float) -> None:
        """Run draft steps while the awaited chunk is in flight and the copies issued so far
        keep the link busy (expected until ``link_busy_until``) for the whole step."""
        while not self.job.done and not landed():
            now = time.perf_counter()
            slack = self.budget * (now - self.start) - self.overrun_s
            est = self.step_ema if self.step_ema is not None else 0.0
            if now + est > link_busy_until + slack:
                return
            end = self._run_step()
            self.overrun_s += max(0.0, end - max(link_busy_until, now))

    def finish(self) -> float:
        """Finish the remaining draft steps sequentially; returns the time it took."""
        t0 = time.perf_counter()
        while not self.job.done:
            self._run_step()
        return time.perf_counter() - t0
