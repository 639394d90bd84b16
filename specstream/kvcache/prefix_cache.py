"""Automatic prefix caching over both tiers. Pure Python, no tensors.

The cache keeps full KV blocks of finished requests so that a later request whose prompt starts
with the same tokens copies them instead of prefilling them (chat turns re-send the whole
conversation; document QA sends one long context with many questions).

- **Keys** (as vLLM's): block ``i`` of a token sequence is keyed by its parent's key (block
  ``i - 1``'s) and its ``block_size`` token ids. An entry stores both, and a lookup compares
  them, so two prefixes never share an entry through a hash collision. Only full blocks are
  cached, and a block's KV depends only on the tokens up to its end, so equal keys mean equal
  KV (one engine: one model, one dtype, one set of kernels).
- **Ownership**: entries own their blocks (ids of the ``KVManager``'s two allocators), a device
  copy, a host copy, or both. Requests never share a block with the cache: a finished request's
  full blocks move into the cache without a copy (``insert``: the request needs them no
  more), and a hit copies cached blocks into the request's own blocks (the worker runs the
  copies at the start of the step, before anything reads or writes them). A hit is therefore
  counted against the budgets exactly like blocks the request prefilled itself. The
  ``KVManager`` caches in the tier its mode keeps history in: the device in ``resident`` mode,
  the host in the offloading modes (write-through puts every full block there).
- **Sharing** (``prefix_sharing``, offloading modes): the host tier's entries are also shared
  by running requests. A request's full host blocks join the cache as soon as they are written
  back (``share``), and a later request whose prompt starts with them references the same
  blocks instead of copying them. A reference is a pin of the entry's host block, so a block
  in use is never evicted; the entry's ``pins`` count its references.
- **Yielding**: cached blocks count as free in their allocator; an allocation that finds too
  few truly free blocks reclaims the least recently used cached copies of its tier
  (``reclaim``), the deepest blocks of a prefix first. Entries a planned copy reads are pinned
  until the step that copies them has run: nothing in use is ever evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

TIERS = ("device", "host")


@dataclass
class Entry:
    key: int
    parent: int | None  # the key of the block before it (None: the first block)
    tokens: tuple[int, ...]
    device: int | None = None  # the cache's device block holding the KV, if any
    host: int | None = None  # ... and host block
    # copies planned from its block of each tier and not yet made
    pins: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    def block(self, tier: str) -> int | None:
        return self.device if tier == "device" else self.host


@dataclass
class PrefixCache:
    block_size: int
    entries: dict[int, Entry] = field(default_factory=dict)
    # per tier, keys of entries holding a copy there, least recently used first
    lru: dict[str, OrderedDict[int, None]] = field(
        default_factory=lambda: {t: OrderedDict() for t in TIERS})
    # counters (tokens), named as vLLM names them
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found
    hits_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    # per tier, keys of entries whose block there a planned copy reads
    pinned: dict[str, set[int]] = field(default_factory=lambda: {t: set() for t in TIERS})
    # per tier, pins beyond each entry's first (0: no block is read by two at once)
    extra_pins: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    # ---- keys ---------------------------------------------------------------------------
    def chain(self, tokens: Sequence[int], num_blocks: int, start: int = 0,
              parent: int | None = None) -> list[tuple[int, int | None, tuple[int, ...]]]:
        """(key, parent key, token ids) of the full blocks ``start .. num_blocks - 1`` of
        ``tokens`` (``parent``: the key of block ``start - 1``)."""
        bs = self.block_size
        out: list[tuple[int, int | None, tuple[int, ...]]] = []
        for i in range(start, num_blocks):
            block = tuple(tokens[i * bs : (i + 1) * bs])
            if len(block) < bs:
                break
            key = hash((parent, block))
            out.append((key, parent, block))
            parent = key
        return out

    def _find(self, key: int, parent: int | None, block: tuple[int, ...]) -> Entry | None:
        e = self.entries.get(key)
        return e if e is not None and e.parent == parent and e.tokens == block else None

    # ---- lookup and insertion -----------------------------------------------------------
    def lookup(self, tokens: Sequence[int], max_blocks: int,
               tiers: Sequence[str] = TIERS) -> list[Entry]:
        """The cached entries of the longest prefix of ``tokens`` (at most ``max_blocks``
        blocks) whose every block has a copy in one of ``tiers``; they become the most
        recently used."""
        found = []
        for key, parent, block in self.chain(tokens, max_blocks):
            e = self._find(key, parent, block)
            if e is None or all(e.block(t) is None for t in tiers):
                break
            found.append(e)
        self._touch_chain(found)
        return found

    def insert(self, tokens: Sequence[int], device: Sequence[int | None],
               host: Sequence[int | None]) -> tuple[list[int], list[int]]:
        """A finished request's full blocks: block ``i`` of ``tokens`` has the device copy
        ``device[i]`` and the host copy ``host[i]`` (None: none). The cache takes the copies
        it lacks; returns the (device, host) blocks it did not take, for the caller to free."""
        left_device: list[int] = []
        left_host: list[int] = []
        kept: list[Entry] = []
        for (key, parent, block), d, h in zip(self.chain(tokens, len(device)), device, host):
            e = self._find(key, parent, block)
            if e is None:
                if key in self.entries:  # a collision: keep the entry there, drop this block
                    left_device += [d] if d is not None else []
                    left_host += [h] if h is not None else []
                    continue
                e = self.entries[key] = Entry(key, parent, block)
            for tier, b, left in (("device", d, left_device), ("host", h, left_host)):
                if b is None:
                    continue
                if e.block(tier) is None:
                    setattr(e, tier, b)
                else:
                    left.append(b)
            kept.append(e)
        self._touch_chain(kept)
        return left_device, left_host

    def share(self, tokens: Sequence[int], host: Sequence[int | None], start: int = 0,
              parent: int | None = None) -> tuple[dict[int, Entry], int | None]:
        """A running request's host blocks ``host[i]`` (None: not to share) for blocks
        ``start + i`` of ``tokens`` (``parent``: block ``start - 1``'s key): each joins the
        cache where no entry holds a host copy of its key yet, pinned for the request (a
        reference). Returns the entries taken, by block index (the request's references: the
        cache owns those blocks now), and the last block's key (the next call's parent)."""
        taken: dict[int, Entry] = {}
        chain = self.chain(tokens, start + len(host), start, parent)
        for i, ((key, parent, block), h) in enumerate(zip(chain, host), start):
            if h is None:
                continue
            e = self._find(key, parent, block)
            if e is None:
                if key in self.entries:
                    continue  # a collision: the entry there stays
                e = self.entries[key] = Entry(key, parent, block)
            if e.host is not None:
                continue  # another copy is cached already: the request keeps its own
            e.host = h
            self.lru["host"][e.key] = None
            self.pin([(e, "host")])
            taken[i] = e
        return taken, chain[-1][0] if chain else parent

    def record(self, queried: int, hit_tiers: Sequence[str]) -> None:
        """Count a lookup: ``queried`` prompt tokens, one hit block per entry of ``hit_tiers``
        (the tier its copy came from)."""
        self.queries += queried
        for t in hit_tiers:
            self.hits += self.block_size
            self.hits_by_tier[t] += self.block_size

    # ---- pins and eviction --------------------------------------------------------------
    def pin(self, pins: Sequence[tuple[Entry, str]]) -> None:
        """(entry, tier): a planned copy or a sharing request reads the entry's block of that
        tier."""
        for e, tier in pins:
            self.extra_pins[tier] += e.pins[tier] > 0
            e.pins[tier] += 1
            self.pinned[tier].add(e.key)

    def unpin(self, pins: Sequence[tuple[Entry, str]]) -> None:
        for e, tier in pins:
            e.pins[tier] -= 1
            self.extra_pins[tier] -= e.pins[tier] > 0
            if not e.pins[tier]:
                self.pinned[tier].discard(e.key)

    def num_blocks(self, tier: str) -> int:
        return len(self.lru[tier])

    def num_reclaimable(self, tier: str) -> int:
        """Copies of ``tier`` that may leave now (not pinned)."""
        return len(self.lru[tier]) - len(self.pinned[tier])

    def reclaim(self, tier: str, n: int) -> list[int]:
        """Free up to ``n`` blocks of ``tier``, least recently used first, skipping pinned
        entries; returns the blocks (for the allocator's free list)."""
        freed: list[int] = []
        for key in list(self.lru[tier]):
            if len(freed) >= n:
                break
            e = self.entries[key]
            if e.pins[tier]:
                continue
            b = e.block(tier)
            assert b is not None
            freed.append(b)
            setattr(e, tier, None)
            del self.lru[tier][key]
            if e.device is None and e.host is None:
                del self.entries[key]
        return freed

    def _touch_chain(self, chain: Sequence[Entry]) -> None:
        """The entries of a prefix become the most recently used, its first block last, so
        eviction takes a prefix's deepest blocks before the blocks they continue."""
        for e in reversed(chain):
            for tier in TIERS:
                if e.block(tier) is not None:
                    self.lru[tier][e.key] = None
                    self.lru[tier].move_to_end(e.key)
