"""The ``fill`` residency at datacenter scale, with the engine's own share rule.

The device keeps the newest history of every running request, as much as fits; the host holds
every request's full history (write-through), so only the older remainder crosses the link in a
round. How the room is shared is the engine's ``kvcache.manager.residency_targets`` (what the
scheduler's ``_rebalance`` calls before every step): equal shares by water-filling, a request
needing less than the level keeps all of its KV, nobody drops below its floor (its resident
tail), and the room that restoring the rest takes (restore modes: two layers of it) is counted
against the capacity. The simulator calls it in tokens instead of blocks (a block of one token:
the datacenter model does not round to blocks) and turns the targets into the level that
``SimPolicy.cold_tokens`` reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specstream.kvcache.residency import residency_targets


def fill_targets(free_tokens: float, needs: Sequence[float], floors: Sequence[float],
                 restore_fraction: float = 0.0) -> list[int]:
    """Tokens each request keeps on the device: ``residency_targets`` over ``free_tokens`` of
    room, with ``restore_fraction`` of the history that does not stay counted against it."""
    caps = [int(math.ceil(n)) for n in needs]
    lows = [min(int(math.ceil(f)), c) for f, c in zip(floors, caps, strict=True)]
    total = sum(caps)

    def room(targets: list[int]) -> int:
        return math.ceil(restore_fraction * (total - sum(targets)))

    return residency_targets(lows, caps, max(0, int(free_tokens)),
                             room if restore_fraction > 0 else None)


def fill_level(targets: Sequence[int], needs: Sequence[float],
               floors: Sequence[float] | None = None) -> float:
    """The common level of a fill: the share of the requests kept above their floor and under
    what they need (the largest need when everyone keeps everything; 0 when nobody is above
    its floor)."""
    lows = floors if floors is not None else [0.0] * len(needs)
    if all(t >= math.ceil(n) for t, n in zip(targets, needs, strict=True)):
        return float(max(needs, default=0.0))
    level = [t for t, f, n in zip(targets, lows, needs, strict=True) if f < t < math.ceil(n)]
    return float(max(level, default=0))
