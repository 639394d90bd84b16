"""How many blocks of each request stay on the device: the offload policy (``tail`` or
``fill``, see manager.py) and ``fill``'s water-filled shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specstream.options import Residency


@dataclass(frozen=True)
class OffloadPolicy:
    offload: bool  # False: everything stays on the device (resident mode)
    resident_tail_tokens: int = 512
    offload_after_tokens: int = 8192
    chunk_tokens: int = 2048
    residency: Residency = Residency.FILL  # see the module docstring

    def __post_init__(self) -> None:
        object.__setattr__(self, "residency", Residency.parse("residency", self.residency))

    @property
    def fill(self) -> bool:
        return self.offload and self.residency is Residency.FILL


def residency_targets(floors: list[int], caps: list[int], capacity: int,
                      cost: Callable[[list[int]], int] | None = None) -> list[int]:
    """Equal shares of ``capacity`` device blocks, by water-filling: request ``i`` gets
    ``max(floors[i], min(level, caps[i]))`` for the highest ``level`` whose total (plus
    ``cost(targets)``, the room the targets leave others needing) fits. A request that needs
    less than the level keeps all it needs; the rest share what is left equally. The floors
    always hold (admission made room for them)."""
    def targets(level: int) -> list[int]:
        return [max(f, min(level, c)) for f, c in zip(floors, caps)]

    def fits(level: int) -> bool:
        t = targets(level)
        return sum(t) + (cost(t) if cost is not None else 0) <= capacity

    lo, hi = 0, max(caps, default=0)
    if fits(hi):
        return targets(hi)
    while lo < hi:  # the highest level that fits (level 0 gives the floors)
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return targets(lo)
