"""One tier's free list of block ids (consecutive ids when it can), with its usage peak."""

from __future__ import annotations

import bisect

from specstream.kvcache.prefix_cache import PrefixCache


class OutOfBlocks(RuntimeError):
    """A tier has no free block for an allocation the caller should have checked."""


class BlockAllocator:
    """Free list of block ids of one tier, with usage peak. Blocks the prefix cache holds
    (``cache``) count as free: an allocation that needs them takes them back."""

    def __init__(self, num_blocks: int, tier: str, cache: PrefixCache | None = None) -> None:
        if num_blocks < 0:
            raise ValueError(f"{tier} tier: num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tier = tier
        self.cache = cache
        self._free: list[int] = list(range(num_blocks))  # sorted
        self.peak_used = 0

    @property
    def num_cached(self) -> int:
        """Blocks the prefix cache holds in this tier."""
        return self.cache.num_blocks(self.tier) if self.cache is not None else 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free ones and cached ones not pinned."""
        spare = self.cache.num_reclaimable(self.tier) if self.cache is not None else 0
        return len(self._free) + spare

    @property
    def num_used(self) -> int:
        """Blocks requests hold: their own and cached ones they reference or a planned copy
        reads (pinned); the cache's others not counted."""
        spare = self.cache.num_reclaimable(self.tier) if self.cache is not None else 0
        return self.num_blocks - len(self._free) - spare

    def note_peak(self) -> None:
        """Count the usage peak after pins changed what is in use."""
        self.peak_used = max(self.peak_used, self.num_used)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """``n`` blocks, consecutive ids when possible (continuing ``after`` first): a request's
        consecutive blocks of one layer are one contiguous view for attention."""
        if n > len(self._free) and self.cache is not None:
            self.free(self.cache.reclaim(self.tier, n - len(self._free)))
        free = self._free
        if n > len(free):
            raise OutOfBlocks(f"{self.tier} tier: need {n} blocks, {len(free)} free")
        if n == 0:
            return []
        start = self._run_start(n, after)
        if start is None:
            blocks, self._free = free[:n], free[n:]
        else:
            blocks = free[start : start + n]
            del free[start : start + n]
        self.peak_used = max(self.peak_used, self.num_used)
        return blocks

    def _run_start(self, n: int, after: int | None) -> int | None:
        free = self._free
        if after is not None:
            i = bisect.bisect_left(free, after + 1)
            if i + n <= len(free) and free[i] == after + 1 and free[i + n - 1] == after + n:
                return i
        for i in range(len(free) - n + 1):
            if free[i + n - 1] - free[i] == n - 1:
                return i
        return None

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            bisect.insort(self._free, b)
