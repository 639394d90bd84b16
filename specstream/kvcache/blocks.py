"""The manager's data: one request's blocks in both tiers, restore chunks, and the block copies
of prefix-cache hits. Pure Python, no tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specstream.kvcache.prefix_cache import Entry


class CopyKind(str, enum.Enum):
    """Where a whole-block copy of a step goes: within the tier the mode keeps history in
    (prefix-cache hits), or a shared block's device copy (``shared_device.py``)."""

    HOST_TO_HOST = "h2h"
    DEVICE_TO_DEVICE = "d2d"
    HOST_TO_DEVICE = "h2d"


# A block copy the worker makes at the start of a step: kind, source block, destination block.
BlockCopy = tuple[CopyKind, int, int]


@dataclass
class SeqBlocks:
    # host copies of blocks 0 .. len(host_blocks) - 1
    host_blocks: list[int] = field(default_factory=list)
    # device copies of blocks first .. first + len(device_blocks) - 1 (the newest)
    device_blocks: list[int] = field(default_factory=list)
    first: int = 0
    num_tokens: int = 0  # tokens whose KV is stored
    # (device block, host block) copies planned and not completed: blocks len(host_blocks) ..
    # len(host_blocks) + len(moving) - 1, still on the device
    moving: list[tuple[int, int]] = field(default_factory=list)
    # device blocks receiving blocks first - len(promoting) .. first - 1 during a step
    promoting: list[int] = field(default_factory=list)
    # `fill`: device blocks the scheduler gave the request (None: no limit)
    target: int | None = None
    # prefix sharing: the cache entries of host blocks the request references, by block index
    # (the cache owns those blocks), how many of them it adopted at admission (the others it
    # wrote itself, counted in its reservation), the blocks offered to the cache so far and
    # the last one's key (the parent of the next one's: keys are not recomputed)
    refs: dict[int, Entry] = field(default_factory=dict)
    adopted: int = 0
    offered: int = 0
    offered_key: int | None = None

    @property
    def droppable(self) -> int:
        """Device blocks with a host copy (the window's oldest), which may leave at no cost."""
        return max(0, len(self.host_blocks) - self.first)


@dataclass(frozen=True)
class RestoreChunk:
    """A run of host blocks restored together: tokens [start, start + num_tokens)."""

    host_blocks: tuple[int, ...]
    start: int
    num_tokens: int
