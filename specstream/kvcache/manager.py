"""Offload manager: which KV blocks of which request live where. Pure Python, no tensors.

Every request's KV is a list of fixed-size blocks. The oldest full blocks may live in the host
tier (``host_blocks``); the newest tokens, where new KV is written, live in device blocks (the
resident tail, ``device_blocks``). Token ``t`` of a request is in ``host_blocks[t // B]`` when
``t < host_tokens``, else in ``device_blocks[(t - host_tokens) // B]``.

The manager plans movements; the transfer handler performs them:
- ``plan_writeback``: once a request passes ``offload_after_tokens``, tail blocks beyond the
  resident-tail budget are assigned host blocks (device to host copies, ``moving``). Until
  ``complete_writeback`` they stay the head of the device tail (attended there while the copies
  run); then they join the host history and their device blocks are freed.
- ``restore_chunks``: the host history cut into chunks of ``chunk_tokens`` for one step (the
  worker restores each chunk layer by layer).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


class OutOfBlocks(RuntimeError):
    """A tier has no free block for an allocation the caller should have checked."""


class BlockAllocator:
    """Free list of block ids of one tier, with usage peak."""

    def __init__(self, num_blocks: int, tier: str) -> None:
        if num_blocks < 0:
            raise ValueError(f"{tier} tier: num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tier = tier
        self._free: list[int] = list(range(num_blocks))  # sorted
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """``n`` blocks, consecutive ids when possible (continuing ``after`` first): a request's
        consecutive blocks of one layer are one contiguous view for attention."""
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


@dataclass
class SeqBlocks:
    host_blocks: list[int] = field(default_factory=list)
    device_blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens whose KV is stored (host + device)
    # (device block, host block) copies planned and not completed: the first len(moving)
    # device blocks, on their way to the host
    moving: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class RestoreChunk:
    """A run of host blocks restored together: tokens [start, start + num_tokens)."""

    host_blocks: tuple[int, ...]
    start: int
    num_tokens: int


@dataclass(frozen=True)
class OffloadPolicy:
    offload: bool  # False: everything stays on the device (resident mode)
    resident_tail_tokens: int = 512
    offload_after_tokens: int = 8192
    chunk_tokens: int = 2048


class KVManager:
    """Block bookkeeping for both tiers."""

    def __init__(
        self, block_size: int, num_device_blocks: int, num_host_blocks: int, policy: OffloadPolicy
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if policy.offload and policy.chunk_tokens % block_size:
            raise ValueError(
                f"chunk_tokens ({policy.chunk_tokens}) must be a multiple of "
                f"block_size ({block_size})"
            )
        self.block_size = block_size
        self.policy = policy
        self.device = BlockAllocator(num_device_blocks, "device")
        self.host = BlockAllocator(num_host_blocks, "host")
        self.seqs: dict[str, SeqBlocks] = {}

    # ---- queries ------------------------------------------------------------------------
    def host_tokens(self, rid: str) -> int:
        return len(self.seqs[rid].host_blocks) * self.block_size

    def num_tokens(self, rid: str) -> int:
        return self.seqs[rid].num_tokens if rid in self.seqs else 0

    def device_blocks_needed(self, rid: str, num_new: int) -> int:
        """Extra device blocks needed to append ``num_new`` tokens."""
        seq = self.seqs.get(rid) or SeqBlocks()
        tail = seq.num_tokens - len(seq.host_blocks) * self.block_size + num_new
        return max(0, -(-tail // self.block_size) - len(seq.device_blocks))

    def host_blocks_needed(self, total_tokens: int) -> int:
        """Host blocks a request of ``total_tokens`` tokens eventually occupies (worst case)."""
        if not self.policy.offload:
            return 0
        keep = self.policy.resident_tail_tokens
        return max(0, (total_tokens - keep) // self.block_size)

    def device_slots(self, rid: str, start: int, num: int) -> list[tuple[int, int]]:
        """(device block, offset) of tokens [start, start + num), which must be in the tail."""
        seq = self.seqs[rid]
        base = len(seq.host_blocks) * self.block_size
        out = []
        for t in range(start, start + num):
            rel = t - base
            if rel < 0:
                raise ValueError(f"token {t} of {rid} is in the host tier")
            out.append((seq.device_blocks[rel // self.block_size], rel % self.block_size))
        return out

    # ---- allocation ---------------------------------------------------------------------
    def allocate(self, rid: str, num_new: int) -> None:
        """Reserve device blocks so ``num_new`` more tokens can be written."""
        seq = self.seqs.setdefault(rid, SeqBlocks())
        need = self.device_blocks_needed(rid, num_new)
        last = seq.device_blocks[-1] if seq.device_blocks else None
        seq.device_blocks.extend(self.device.allocate(need, after=last))

    def commit(self, rid: str, num_tokens: int) -> None:
        """Set the stored token count (after a step; smaller = roll back rejected drafts)."""
        seq = self.seqs[rid]
        host_tokens = len(seq.host_blocks) * self.block_size
        if num_tokens < host_tokens:
            raise ValueError(f"{rid}: cannot roll back into the host tier")
        seq.num_tokens = num_tokens
        if not self.policy.offload:
            return  # resident requests keep the blocks reserved at admission
        keep = -(-(num_tokens - host_tokens) // self.block_size)
        if len(seq.device_blocks) > keep:
            self.device.free(seq.device_blocks[keep:])
            del seq.device_blocks[keep:]

    def free(self, rid: str) -> None:
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self.device.free(seq.device_blocks)
            self.host.free(seq.host_blocks + [h for _, h in seq.moving])

    # ---- movement plans -----------------------------------------------------------------
    def plan_writeback(self, rid: str) -> list[tuple[int, int]]:
        """(device block, host block) pairs to copy device to host (none while an earlier
        write-back of the request is still moving).

        Only full blocks move, and the tail keeps at least ``resident_tail_tokens`` tokens. The
        blocks stay the head of the device tail until ``complete_writeback``.
        """
        seq = self.seqs[rid]
        p = self.policy
        if not p.offload or seq.moving or seq.num_tokens <= p.offload_after_tokens:
            return []
        tail_tokens = seq.num_tokens - len(seq.host_blocks) * self.block_size
        movable = (tail_tokens - p.resident_tail_tokens) // self.block_size
        movable = min(movable, self.host.num_free)
        if movable <= 0:
            return []
        seq.moving = list(zip(seq.device_blocks[:movable], self.host.allocate(movable)))
        return list(seq.moving)

    def complete_writeback(self, rid: str) -> None:
        """The copies of ``rid``'s moving blocks landed: they join its host history and their
        device blocks are freed."""
        seq = self.seqs[rid]
        n = len(seq.moving)
        self.device.free(seq.device_blocks[:n])
        del seq.device_blocks[:n]
        seq.host_blocks.extend(h for _, h in seq.moving)
        seq.moving = []

    def restore_chunks(self, rid: str) -> list[RestoreChunk]:
        """The host history of ``rid`` in chunks of at most ``chunk_tokens`` tokens."""
        seq = self.seqs.get(rid)
        if seq is None or not seq.host_blocks:
            return []
        per_chunk = max(1, self.policy.chunk_tokens // self.block_size)
        out = []
        for i in range(0, len(seq.host_blocks), per_chunk):
            blocks = tuple(seq.host_blocks[i : i + per_chunk])
            out.append(RestoreChunk(blocks, i * self.block_size, len(blocks) * self.block_size))
        return out
