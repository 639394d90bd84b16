"""Offload manager: which KV blocks of which request live where. Pure Python, no tensors.

Every request's KV is a list of fixed-size blocks, numbered from its first token. Two tiers hold
them:

- the host tier holds copies of blocks ``0 .. len(host_blocks) - 1`` (``host_blocks``): a block
  is copied there once, device to host, when it is full (write-through), so shrinking a
  request's device residency never needs a transfer;
- the device holds blocks ``first .. first + len(device_blocks) - 1`` (``device_blocks``): the
  request's newest history, where new KV is written. ``first <= len(host_blocks)``: every block
  before the device window has a host copy, and those blocks reach attention over the link each
  round (restored or streamed). Token ``t`` is read from the host when ``t < first * B``, else
  from ``device_blocks[(t - first * B) // B]``.

How many blocks a request keeps on the device is its *residency target*:

- ``tail`` (the paper's configuration): the whole request until it passes
  ``offload_after_tokens``, then its ``resident_tail_tokens`` newest tokens; a block is copied
  to the host only when it leaves the window;
- ``fill``: the scheduler shares the device blocks that staging does not need among the running
  requests (``residency_targets``), so only the history that does not fit crosses the link.

The manager plans movements; the transfer handler performs them:
- ``plan_writeback``: full blocks without a host copy get host blocks (device-to-host copies,
  ``moving``); ``complete_writeback`` records the copies and drops device blocks beyond the
  target (``settle``).
- ``plan_promotion``: a request whose target grew gets device blocks for the newest of its
  streamed blocks; the step that streams them anyway copies them into those blocks as they pass
  (no extra link bytes); ``complete_promotion`` moves the window's start back.
- ``restore_chunks``: the blocks before the device window, cut into chunks of ``chunk_tokens``.

Prefix sharing (``prefix_sharing``, offloading modes): a request's full host blocks join the
prefix cache once written back (``share_written``), and a request whose prompt starts with
cached blocks references them (``adopt_prefix``) instead of copying them: the blocks belong to
the cache, counted once in the host tier, and each request holds a reference (a pin; ``refs``).
A block two or more running requests reference (``shared_run``: the leading run of them)
streams once a round for all of them where it crosses the link (exec/stream.py): restore
chunks are cut where the run ends so that every sharer's chunks of it are the same blocks.
Under `fill` a shared run's device copy serves all its sharers (``shared_device.py``).
"""

from __future__ import annotations

from specstream.kvcache.allocator import BlockAllocator
from specstream.kvcache.blocks import BlockCopy, CopyKind, RestoreChunk, SeqBlocks
from specstream.kvcache.prefix_cache import Entry, PrefixCache
from specstream.kvcache.residency import OffloadPolicy
from specstream.kvcache.shared_device import SharedDevice

__all__ = ["BlockCopy", "CopyKind", "KVManager", "RestoreChunk", "SeqBlocks"]


class KVManager:
    """Block bookkeeping for both tiers."""

    def __init__(
        self, block_size: int, num_device_blocks: int, num_host_blocks: int, policy: OffloadPolicy,
        prefix_caching: bool = False, prefix_sharing: bool = False,
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
        self.cache = PrefixCache(block_size) if prefix_caching else None
        # references instead of copies: host-tier blocks, so offloading modes only
        self.sharing = self.cache is not None and prefix_sharing and policy.offload
        self.device = BlockAllocator(num_device_blocks, "device", self.cache)
        self.host = BlockAllocator(num_host_blocks, "host", self.cache)
        self.seqs: dict[str, SeqBlocks] = {}
        self._pinned: list[tuple[Entry, str]] = []  # cache blocks the next step copies from
        self.promoted_blocks = 0  # blocks promoted into device windows as they passed, so far
        # `fill`: one device copy of a shared run for all its sharers (shared_device.py)
        self.shared = SharedDevice(self) if self.sharing and policy.fill else None

    # ---- queries ------------------------------------------------------------------------
    def host_tokens(self, rid: str) -> int:
        """Tokens of ``rid`` read from the host tier (before its device window)."""
        return self.seqs[rid].first * self.block_size

    def num_tokens(self, rid: str) -> int:
        return self.seqs[rid].num_tokens if rid in self.seqs else 0

    def device_blocks_needed(self, rid: str, num_new: int) -> int:
        """Extra device blocks needed to append ``num_new`` tokens."""
        seq = self.seqs.get(rid) or SeqBlocks()
        tail = seq.num_tokens - seq.first * self.block_size + num_new
        return max(0, -(-tail // self.block_size) - len(seq.device_blocks))

    def host_blocks_needed(self, total_tokens: int) -> int:
        """Host blocks a request of ``total_tokens`` tokens eventually occupies (worst case:
        every full block; `tail` copies only those that leave its resident tail)."""
        if not self.policy.offload:
            return 0
        keep = 0 if self.policy.fill else self.policy.resident_tail_tokens
        return max(0, (total_tokens - keep) // self.block_size)

    def target(self, rid: str) -> int | None:
        """Device blocks ``rid`` may keep (None: all of them)."""
        seq, p = self.seqs[rid], self.policy
        if not p.offload:
            return None
        if p.fill:
            return seq.target
        if seq.num_tokens <= p.offload_after_tokens:
            return None
        # full blocks past the newest resident_tail_tokens tokens leave
        window = seq.num_tokens - seq.first * self.block_size
        return len(seq.device_blocks) - max(0, (window - p.resident_tail_tokens)
                                            // self.block_size)

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
        if num_tokens < seq.first * self.block_size:
            raise ValueError(f"{rid}: cannot roll back into the host tier")
        seq.num_tokens = num_tokens
        if not self.policy.offload:
            return  # resident requests keep the blocks reserved at admission
        keep = -(-(num_tokens - seq.first * self.block_size) // self.block_size)
        if len(seq.device_blocks) > keep:
            self.device.free(seq.device_blocks[keep:])
            del seq.device_blocks[keep:]

    def free(self, rid: str, token_ids: list[int] | None = None) -> None:
        """Release ``rid``'s blocks. With the prefix cache and the request's ``token_ids``
        (None: its KV is not to be trusted, e.g. it failed), its full blocks move into the
        cache instead (no copy); the cache frees the copies it already has."""
        seq = self.seqs.pop(rid, None)
        if seq is None:
            return
        device = list(seq.device_blocks)
        host = [b for i, b in enumerate(seq.host_blocks) if i not in seq.refs]
        if self.cache is not None and seq.refs:  # the cache owns them: drop the references
            self.cache.unpin([(e, "host") for e in seq.refs.values()])
        self.device.free(seq.promoting)
        self.host.free([h for _, h in seq.moving])  # write-backs that did not land
        if self.cache is not None and token_ids is not None:
            # the cache keeps blocks in the tier the mode keeps history in: the device in
            # resident mode, the host (where write-through put every full block) otherwise
            full = min(seq.num_tokens, len(token_ids)) // self.block_size
            on_device = [device[i - seq.first]
                         if seq.first <= i < seq.first + len(device) and not self.policy.offload
                         else None for i in range(full)]
            on_host = [seq.host_blocks[i] if i < len(seq.host_blocks) and i not in seq.refs
                       else None for i in range(full)]
            taken = {b for b in on_device if b is not None}, {b for b in on_host if b is not None}
            left_device, left_host = self.cache.insert(token_ids, on_device, on_host)
            device = [b for b in device if b not in taken[0]] + left_device
            host = [b for b in host if b not in taken[1]] + left_host
        self.device.free(device)
        self.host.free(host)
        if self.shared is not None:
            self.shared.prune()

    # ---- prefix cache -------------------------------------------------------------------
    def adopt_prefix(self, rid: str, prompt: list[int]) -> tuple[int, list[BlockCopy]]:
        """A newly admitted request whose prompt starts with cached blocks takes copies of
        them as its own KV (at least its last prompt token is left to prefill): returns the
        tokens it need not prefill and the copies the next step makes first. Offloading
        modes: host copies of host blocks (the request's cold history: it streams, or fills
        the device window by promotion, like any other); resident: device blocks."""
        if self.cache is None:
            return 0, []
        bs, p = self.block_size, self.policy
        max_blocks = (len(prompt) - 1) // bs
        seq = self.seqs.setdefault(rid, SeqBlocks())
        if seq.num_tokens or seq.host_blocks:
            return 0, []
        if self.sharing:
            return self._reference_prefix(seq, prompt, max_blocks), []
        if p.offload:
            hits = self.cache.lookup(prompt, max_blocks, tiers=("host",))
            # as many as the host tier can take without the cached copies the hits read
            while hits and 2 * len(hits) > self.host.num_free:
                hits.pop()
        else:  # resident: the blocks reserved at admission receive device copies
            hits = self.cache.lookup(prompt, min(max_blocks, len(seq.device_blocks)),
                                     tiers=("device",))
        self.cache.record(len(prompt), ["host" if p.offload else "device"] * len(hits))
        if not hits:
            return 0, []
        tier, kind = (("host", CopyKind.HOST_TO_HOST) if p.offload
                      else ("device", CopyKind.DEVICE_TO_DEVICE))
        sources = [e.block(tier) for e in hits]  # a lookup in that tier: never None
        pins = [(e, tier) for e in hits]
        self.cache.pin(pins)  # before allocating: the allocation may reclaim cached blocks
        self._pinned += pins
        if p.offload:
            dst = self.host.allocate(len(hits))
            seq.host_blocks, seq.first = dst, len(hits)
        else:
            dst = seq.device_blocks[: len(hits)]
        seq.num_tokens = len(hits) * bs
        return seq.num_tokens, [(kind, src, d) for src, d in zip(sources, dst) if src is not None]

    def _reference_prefix(self, seq: SeqBlocks, prompt: list[int], max_blocks: int) -> int:
        """Prefix sharing: the request references the cached host blocks its prompt starts
        with (no copies); returns the tokens it need not prefill."""
        assert self.cache is not None
        hits = self.cache.lookup(prompt, max_blocks, tiers=("host",))
        self.cache.record(len(prompt), ["host"] * len(hits))
        self.cache.pin([(e, "host") for e in hits])
        self.host.note_peak()
        seq.host_blocks = [e.host for e in hits if e.host is not None]
        seq.refs, seq.adopted = dict(enumerate(hits)), len(hits)
        seq.first = seq.offered = len(hits)
        seq.offered_key = hits[-1].key if hits else None
        seq.num_tokens = len(hits) * self.block_size
        return seq.num_tokens

    def prefix_hits(self, prompt: list[int]) -> list[Entry]:
        """Prefix sharing: the cached host entries a request of ``prompt`` would reference
        now (as ``adopt_prefix`` would, at least the last prompt token left to prefill)."""
        if not self.sharing or self.cache is None:
            return []
        return self.cache.lookup(prompt, (len(prompt) - 1) // self.block_size, tiers=("host",))

    def share_written(self, rid: str, token_ids: list[int]) -> int:
        """Prefix sharing: offer ``rid``'s host blocks not offered yet (full blocks of
        ``token_ids``, its prompt and output) to the cache, which takes those whose key it has
        no host copy of; returns how many it took (references the request now holds)."""
        seq = self.seqs.get(rid)
        if not self.sharing or self.cache is None or seq is None:
            return 0
        end = min(len(seq.host_blocks), len(token_ids) // self.block_size)
        if end <= seq.offered:
            return 0
        host = [None if i in seq.refs else seq.host_blocks[i] for i in range(seq.offered, end)]
        taken, seq.offered_key = self.cache.share(token_ids, host, seq.offered, seq.offered_key)
        seq.refs.update(taken)
        seq.offered = end
        return len(taken)

    def lead(self, rid: str) -> list[int]:
        """Device copies of ``rid``'s oldest shared blocks (read there, not over the link)."""
        return self.shared.lead(rid) if self.shared is not None and rid in self.seqs else []

    def shared_run(self, rid: str) -> int:
        """The leading host blocks of ``rid`` that another running request references too."""
        seq, n = self.seqs[rid], 0
        while n in seq.refs and seq.refs[n].pins["host"] > 1:
            n += 1
        return n

    def duplicate_blocks(self, rids: list[str] | None = None) -> int:
        """References beyond the first to the host blocks that the requests ``rids`` (None:
        all) share: the blocks they would hold, or move, again without sharing."""
        if not self.sharing or self.cache is None or not self.cache.extra_pins["host"]:
            return 0  # nothing is shared now (the common case, counted as pins change)
        if rids is None:
            return self.cache.extra_pins["host"]
        refs: dict[int, int] = {}
        for rid in rids:
            seq = self.seqs.get(rid)
            for e in seq.refs.values() if seq is not None else ():
                refs[e.key] = refs.get(e.key, 0) + 1
        return sum(n - 1 for n in refs.values())

    def unreserved_shared(self) -> int:
        """Host blocks the cache holds for running requests' references that no running
        request's reservation counts (those of requests that ended, or cached before)."""
        if not self.sharing or self.cache is None:
            return 0
        owned = sum(len(s.refs) - s.adopted for s in self.seqs.values())
        return len(self.cache.pinned["host"]) - owned

    def shared_block_refs(self) -> tuple[int, int]:
        """(references to host blocks two or more running requests share, those blocks)."""
        if not self.duplicate_blocks():
            return 0, 0
        refs: dict[int, int] = {}
        for seq in self.seqs.values():
            for e in seq.refs.values():
                if e.pins["host"] > 1:
                    refs[e.key] = e.pins["host"]
        return sum(refs.values()), len(refs)

    def release_pins(self) -> None:
        """The step that made the planned copies has run: their sources may be evicted."""
        if self.cache is not None:
            self.cache.unpin(self._pinned)
        self._pinned = []

    # ---- residency ----------------------------------------------------------------------
    def set_target(self, rid: str, blocks: int) -> None:
        """`fill`: the device blocks ``rid`` should keep. Blocks beyond it stay until the room
        is needed (``drop``, ``settle``): a share that dips for a step costs nothing."""
        self.seqs[rid].target = blocks

    def excess(self, rid: str) -> int:
        """Device blocks ``rid`` holds beyond its target that may leave now."""
        seq, target = self.seqs[rid], self.target(rid)
        return 0 if target is None else max(0, min(len(seq.device_blocks) - target,
                                                   seq.droppable))

    def settle(self, rid: str) -> int:
        """Drop every device block beyond the request's target (oldest first, only those with a
        host copy: no transfer); returns how many left."""
        return self.drop(rid, self.excess(rid))

    def drop(self, rid: str, num_blocks: int) -> int:
        """Drop up to ``num_blocks`` of the oldest device blocks that have a host copy."""
        seq = self.seqs[rid]
        n = min(num_blocks, seq.droppable)
        if n <= 0:
            return 0
        self.device.free(seq.device_blocks[:n])
        del seq.device_blocks[:n]
        seq.first += n
        return n

    def plan_promotion(self, rid: str, num_blocks: int) -> list[int]:
        """Device blocks for the newest ``num_blocks`` blocks before the window (a step that
        streams them copies them there; ``complete_promotion`` then widens the window)."""
        seq = self.seqs[rid]
        n = min(num_blocks, seq.first, self.device.num_free)
        if n <= 0 or seq.promoting:
            return []
        seq.promoting = self.device.allocate(n)
        return list(seq.promoting)

    def complete_promotion(self, rid: str, landed: bool = True) -> None:
        """The step's stream filled ``rid``'s promoted blocks (``landed``), or did not."""
        seq = self.seqs[rid]
        if landed:
            seq.first -= len(seq.promoting)
            seq.device_blocks[:0] = seq.promoting
            self.promoted_blocks += len(seq.promoting)
        else:
            self.device.free(seq.promoting)
        seq.promoting = []

    # ---- movement plans -----------------------------------------------------------------
    def plan_writeback(self, rid: str) -> list[tuple[int, int]]:
        """(device block, host block) pairs to copy device to host (none while an earlier
        write-back of the request is still moving).

        Only full blocks move. `fill` copies every full block (write-through); `tail` only
        those past the resident tail once the request passes ``offload_after_tokens``. The
        blocks stay on the device until ``complete_writeback``.
        """
        seq = self.seqs[rid]
        p = self.policy
        if not p.offload or seq.moving:
            return []
        start = len(seq.host_blocks)  # the first block without a host copy
        end = seq.num_tokens // self.block_size  # past the last full block
        if not p.fill:
            if seq.num_tokens <= p.offload_after_tokens:
                return []
            end = min(end, (seq.num_tokens - p.resident_tail_tokens) // self.block_size)
        movable = min(end - start, self.host.num_free)
        if movable <= 0:
            return []
        i = start - seq.first  # the window index of block `start`
        seq.moving = list(zip(seq.device_blocks[i : i + movable], self.host.allocate(movable)))
        return list(seq.moving)

    def complete_writeback(self, rid: str) -> None:
        """The copies of ``rid``'s moving blocks landed: they join its host history (`tail`:
        and leave the device; `fill` keeps them until the room is needed)."""
        seq = self.seqs[rid]
        seq.host_blocks.extend(h for _, h in seq.moving)
        seq.moving = []
        if not self.policy.fill:
            self.settle(rid)

    def restore_chunks(self, rid: str) -> list[RestoreChunk]:
        """The blocks of ``rid`` before its device window but those with a shared device copy
        (``lead``), in chunks of at most ``chunk_tokens`` tokens."""
        seq = self.seqs.get(rid)
        if seq is None or not seq.first:
            return []
        per_chunk = max(1, self.policy.chunk_tokens // self.block_size)
        out = []
        # cut where the shared run ends: every sharer's chunks of it are the same blocks
        cut = min(self.shared_run(rid), seq.first) if seq.refs else 0
        lead = len(self.lead(rid))
        for lo, hi in ((lead, max(cut, lead)), (max(cut, lead), seq.first)):
            for i in range(lo, hi, per_chunk):
                blocks = tuple(seq.host_blocks[i : min(i + per_chunk, hi)])
                out.append(RestoreChunk(blocks, i * self.block_size,
                                        len(blocks) * self.block_size))
        return out

