"""A small discrete-event simulator: tasks with dependencies on single-server resources.

Each resource (the copy stream, the compute stream, a second GPU) runs one task at a time,
non-preemptively; when it falls idle it starts the ready task with the lowest
``(priority, id)``. A task is ready once all its dependencies have finished. That is list
scheduling, which is how CUDA streams with priorities behave at kernel granularity.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Task:
    """One kernel or transfer; ``start``/``end``/``ready`` are filled in by ``run``."""

    name: str
    resource: str  # "link", "compute", "draft_gpu", ...
    duration: float
    kind: str  # "link" | "verify" | "draft" | "prefill": what the timeline colours
    group: int = 0
    round: int = 0
    priority: int = 0  # lower first; drafts run at 1 beneath verification at 0
    deps: list[int] = field(default_factory=list)
    id: int = -1
    ready: float = math.nan
    start: float = math.nan
    end: float = math.nan


class Graph:
    """Tasks in creation order; ``add`` returns the new task's id for use in ``deps``."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []

    def add(self, task: Task) -> int:
        if task.duration < 0:
            raise ValueError(f"negative duration for {task.name}")
        if any(d >= len(self.tasks) or d < 0 for d in task.deps):
            raise ValueError(f"{task.name} depends on a task not yet added")
        task.id = len(self.tasks)
        self.tasks.append(task)
        return task.id

    def run(self) -> list[Task]:
        """Simulate; returns the tasks with times set. Deterministic."""
        tasks = self.tasks
        waiting = [len(t.deps) for t in tasks]
        dependents: dict[int, list[int]] = defaultdict(list)
        for t in tasks:
            for d in t.deps:
                dependents[d].append(t.id)
        ready: dict[str, list[tuple[int, int]]] = defaultdict(list)
        busy: dict[str, bool] = defaultdict(bool)
        events: list[tuple[float, int]] = []
        now = 0.0
        for t in tasks:
            if not t.deps:
                t.ready = 0.0
                heapq.heappush(ready[t.resource], (t.priority, t.id))
        done = 0
        while True:
            for res, queue in ready.items():
                if queue and not busy[res]:
                    _, tid = heapq.heappop(queue)
                    task = tasks[tid]
                    task.start, task.end = now, now + task.duration
                    busy[res] = True
                    heapq.heappush(events, (task.end, tid))
            if not events:
                break
            now, tid = heapq.heappop(events)
            finished = [tid]
            while events and events[0][0] <= now:
                finished.append(heapq.heappop(events)[1])
            for fid in finished:
                done += 1
                busy[tasks[fid].resource] = False
                for child in dependents[fid]:
                    waiting[child] -= 1
                    if waiting[child] == 0:
                        tasks[child].ready = now
                        heapq.heappush(ready[tasks[child].resource],
                                       (tasks[child].priority, child))
        if done != len(tasks):
            raise RuntimeError("dependency cycle: some tasks never became ready")
        return tasks


def busy_time(tasks: list[Task], resource: str, t0: float, t1: float) -> float:
    """Seconds ``resource`` spent running tasks within [t0, t1]."""
    total = 0.0
    for t in tasks:
        if t.resource == resource:
            total += max(0.0, min(t.end, t1) - max(t.start, t0))
    return total
