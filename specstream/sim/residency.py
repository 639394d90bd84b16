"""The ``fill`` residency: how the device memory left over is shared among running requests.

The device keeps the newest history of every running request, as much as fits; the host holds
every request's full history (write-through), so only the older remainder of each request
crosses the link in a round. The share is fair by water-filling: a level s such that request i
keeps min(context_i, max(floor_i, s)) tokens and the kept tokens add up to the capacity. A
request needing less than the level keeps all of its KV, the others split the rest equally, and
nobody drops below its floor (its resident tail). Shared by ``memory.plan`` (the datacenter
model) and ``replay`` (the bench's engine replay).
"""

from __future__ import annotations

from collections.abc import Sequence


def waterfill(capacity: float, needs: Sequence[float],
              floors: Sequence[float] | None = None) -> float:
    """The level s at which sum_i min(needs[i], max(floors[i], s)) equals ``capacity``.

    max(needs) when everything fits; 0 when even the floors alone fill the capacity (then each
    request keeps its floor and the caller's memory check decides whether that fits at all)."""
    lows = list(floors) if floors is not None else [0.0] * len(needs)
    if len(lows) != len(needs) or any(f > n for f, n in zip(lows, needs, strict=True)):
        raise ValueError("one floor per need, none above its need")
    if sum(needs) <= capacity:
        return max(needs, default=0.0)
    kept = float(sum(lows))
    if kept >= capacity:
        return 0.0
    # kept(s) is piecewise linear: its slope is the number of requests with floor < s < need
    events = sorted([(f, 1) for f, n in zip(lows, needs, strict=True) if f < n]
                    + [(n, -1) for f, n in zip(lows, needs, strict=True) if f < n])
    slope, level = 0, events[0][0]
    for point, delta in events:
        grown = kept + slope * (point - level)
        if slope > 0 and grown >= capacity:
            return level + (capacity - kept) / slope
        kept, level, slope = grown, point, slope + delta
    return level  # not reached: the needs exceed the capacity


def kept_tokens(needs: Sequence[float], floors: Sequence[float], level: float) -> list[float]:
    """Tokens each request keeps on the device at a water-filling level."""
    return [min(n, max(f, level)) for n, f in zip(needs, floors, strict=True)]


def history_capacity(free: float, total: float, restore_fraction: float = 0.0) -> float:
    """Bytes of history the device may keep resident.

    ``free``: device bytes left after weights, draft KV and staging; ``total``: the batch's
    history bytes; ``restore_fraction``: share of the non-resident history that must also fit
    on the device while it is restored (full-restore modes: two layers of the step's history,
    2 / layers; 0 when it streams through a fixed staging ring). Solves R + f (total - R) =
    free for R."""
    if restore_fraction >= 1.0:
        return total if free >= total else 0.0
    return max(0.0, (free - restore_fraction * total) / (1.0 - restore_fraction))
