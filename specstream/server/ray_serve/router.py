"""Which replica a job goes to: the one with the most free host KV, then the shortest queue."""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Hashable
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)


def rank_by_free_host_kv(free: dict[K, float], slack: float) -> list[list[K]]:
    """Replicas in preference ranks: those within ``slack`` bytes of the most free host KV,
    then the rest. Unknown (``inf``, no stats yet: a new, empty replica) counts as most free.
    """
    if not free:
        return []
    best = max(free.values())
    top = [k for k, v in free.items() if v >= best - slack]
    rest = sorted((k for k in free if k not in top), key=lambda k: -free[k])
    return [top, rest] if rest else [top]


@functools.cache
def _router_class() -> type:
    from ray.serve.request_router import FIFOMixin, RequestRouter

    class FreeHostKVRouter(FIFOMixin, RequestRouter):
        """Prefer replicas with the most free host KV; in a rank Serve picks the shortest queue.

        ``slack_fraction`` of the largest host tier is the margin within which replicas count
        as equally free (stats are up to one routing-stats period old).
        """

        def initialize_state(self, slack_fraction: float = 0.1, **kwargs: Any) -> None:
            self.slack_fraction = slack_fraction

        async def choose_replicas(self, candidate_replicas: list[Any],
                                  pending_request: Any = None) -> list[list[Any]]:
            stats = {r: r.routing_stats or {} for r in candidate_replicas}
            free = {r: float(s.get("host_kv_free_bytes", math.inf)) for r, s in stats.items()}
            total = max((float(s.get("host_kv_total_bytes", 0)) for s in stats.values()),
                        default=0.0)
            ranks = rank_by_free_host_kv(free, self.slack_fraction * total)
            random.shuffle(ranks[0])  # Serve takes the first of equal queues: spread ties
            return ranks

    FreeHostKVRouter.__module__ = __name__
    return FreeHostKVRouter


# Serve imports the router class by this path (``RequestRouterConfig.request_router_class``).
ROUTER_PATH = f"{__name__}.FreeHostKVRouter"


def __getattr__(name: str) -> Any:
    """``FreeHostKVRouter`` (which Serve imports by path) is built on first use, so importing
    this module for the CLI flags does not import Ray."""
    if name == "FreeHostKVRouter":
        return _router_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
