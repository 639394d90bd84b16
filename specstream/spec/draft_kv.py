"""The draft model's KV of all requests, and the layout of one draft forward over them.

One pool, ``[layers, 2, slots, capacity, kv_heads, D]``, a slot per request (taken on its first
draft, given back when it finishes). A draft forward (``DraftForward``, the model's
AttentionContext) writes the new tokens' K/V into their slots with one copy per layer and
attends each query bucket (the 1-token draft steps together, each long window prefill alone:
``attention.buckets.buckets_of``) with one call of the ``WaveAttention`` backend over the
bucket's slots (a view of the pool when the slots are consecutive). Its index lists are laid
out on the host from lengths alone and reach the device in one pinned, non-blocking copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from specstream.attention.buckets import buckets_of
from specstream.attention.waves import WaveAttention, WaveShape
from specstream.backends.base import upload
from specstream.models.decoder import CausalLM


def consecutive(xs: Sequence[int]) -> bool:
    return all(b == a + 1 for a, b in zip(xs, xs[1:]))


class DraftKVPool:
    """The draft KV of every request: ``kv`` ``[layers, 2, slots, capacity, kv_heads, D]``.

    It grows (one copy of everything) when a request needs a slot and none is free, or a slot
    needs more than ``capacity`` entries; the window policy sizes ``capacity`` so that the
    latter does not happen in steady state. A freed slot's memory waits for the next request.
    """

    def __init__(self, model: CausalLM, capacity: int) -> None:
        cfg, weight = model.config, next(model.parameters())
        self.kv = weight.new_zeros(
            (len(model.layers), 2, 0, capacity, cfg.num_kv_heads, cfg.head_dim))
        self.free: list[int] = []

    @property
    def num_slots(self) -> int:
        return self.kv.shape[2]

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def take(self, count: int) -> list[int]:
        """``count`` free slots, lowest first (a batch's slots then tend to be consecutive)."""
        if len(self.free) < count:
            first = self.num_slots
            self._grow(first + count - len(self.free), self.capacity)
            self.free += range(first, self.num_slots)
        self.free.sort()
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def give_back(self, slot: int) -> None:
        self.free.append(slot)

    def reserve(self, entries: int) -> None:
        """Room for ``entries`` entries in every slot."""
        if entries > self.capacity:
            self._grow(self.num_slots, max(2 * self.capacity, entries))

    def _grow(self, num_slots: int, capacity: int) -> None:
        old = self.kv
        # zeros, not garbage: a batch's keys are padded with entries past a slot's length, and
        # a NaN there would leak through its zero attention weight
        self.kv = old.new_zeros((old.shape[0], 2, num_slots, capacity, *old.shape[4:]))
        self.kv[:, :, : old.shape[2], : old.shape[3]] = old
        if old.is_cuda and old.numel():  # the copy may run on another stream than old's
            old.record_stream(torch.cuda.current_stream(old.device))

    def write(self, layer: int, index: Tensor, k: Tensor, v: Tensor) -> None:
        """New tokens' ``k``, ``v`` ``[n, kv_heads, D]`` into the flat rows ``index`` ``[n]``
        (``slot * capacity + entry``)."""
        _, _, s, c, h, d = self.kv.shape
        self.kv[layer, 0].view(s * c, h, d).index_copy_(0, index, k)
        self.kv[layer, 1].view(s * c, h, d).index_copy_(0, index, v)

    def keys(self, layer: int, slots: Tensor | None, first: int, count: int, num_keys: int
             ) -> tuple[Tensor, Tensor]:
        """K and V ``[count, num_keys, kv_heads, D]`` of ``count`` slots: a view of slots
        ``first`` onwards when ``slots`` is None, else a gather of ``slots`` ``[count]``."""
        if slots is None:
            x = self.kv[layer, :, first : first + count, :num_keys]
        else:
            x = self.kv[layer, :, :, :num_keys].index_select(1, slots)
        return x[0], x[1]

    def evict(self, slot: int, length: int, keep_head: int, keep_recent: int) -> None:
        """Keep the first ``keep_head`` and the last ``keep_recent`` of a slot's ``length``
        entries, in every layer."""
        x = self.kv[:, :, slot]  # [layers, 2, capacity, kv_heads, D]
        recent = x[:, :, length - keep_recent : length].clone()
        x[:, :, keep_head : keep_head + keep_recent] = recent


class DraftSeqCache:
    """One request's draft KV: its slot in the pool, filled to ``length`` (every layer holds the
    same number). The window policy evicts in batches, so a step attends over between
    ``window`` and ``window + slack`` recent tokens (plus the sinks)."""

    def __init__(self, pool: DraftKVPool, slot: int, generator: torch.Generator | None) -> None:
        self.pool, self.slot, self.generator = pool, slot, generator
        self.length = 0  # cached entries
        self.num_tokens = 0  # request tokens processed (evicted ones included)
        # The last ``tree_entries`` of the ``length`` entries are nodes of a draft tree under
        # construction (not request tokens: their positions repeat); a round drops them.
        self.tree_entries = 0

    def drop_tree(self) -> None:
        """Forget the tree nodes: the cache holds the request's tokens only."""
        self.length -= self.tree_entries
        self.tree_entries = 0

    @property
    def k(self) -> Tensor:  # [layers, capacity, kv_heads, D], filled to length
        return self.pool.kv[:, 0, self.slot]

    @property
    def v(self) -> Tensor:  # [layers, capacity, kv_heads, D]
        return self.pool.kv[:, 1, self.slot]


# A request's queries in a tree forward: ``(start, seen)``. Every query sees the request's
# first ``start`` entries (its tokens); query t also sees the entries ``start + e`` for e in
# ``seen[t]`` (its ancestors among the tree nodes already cached, and itself among the new ones).
TreeQueries = tuple[int, Sequence[Sequence[int]]]
# per bucket, the index lists sent to the device: queries, slots, key lengths, causal offsets,
# and for tree buckets the visible prefix and the tree region's mask
_LISTS_PER_BUCKET = 6


@dataclass
class DraftBucket:
    """Requests of one forward attended in one call, queries padded to ``num_q``."""

    num_rows: int  # W requests
    num_q: int  # P query positions each
    q_first: int  # the queries are token rows q_first .. + W * P (when q_index is None)
    q_index: Tensor | None  # [W * P] else: the token row of each padded query position
    first_slot: int  # the slots are first_slot .. + W (when slots is None: a view)
    slots: Tensor | None  # [W] else
    num_keys: int  # N: the most entries among them, new tokens included
    shape: WaveShape


class DraftForward:
    """One draft forward over a batch of requests' slots, as the model's AttentionContext.

    Laid out on the host from lengths alone; its index tensors reach the device in one transfer
    (with ``extra``, int lists the caller wants there too). Per layer, ``attend`` writes the new
    tokens' K/V into their slots and makes one attention call per query bucket.

    ``tree`` (one ``TreeQueries`` or None per request; None: causal as usual) makes the buckets
    with a tree request attend under an explicit mask (``WaveShape.tree``), built on the device
    from each request's visible prefix and a small mask over the rest of its entries.
    """

    def __init__(self, pool: DraftKVPool, caches: list[DraftSeqCache], counts: list[int],
                 positions: list[int], attention: type[WaveAttention], scale: float,
                 extra: Sequence[Sequence[int] | None],
                 tree: Sequence[TreeQueries | None] | None = None) -> None:
        self.pool, self.attention, self.scale = pool, attention, scale
        cap = pool.capacity
        rows = [0, *accumulate(counts)]  # request i's tokens are rows rows[i] .. rows[i + 1]
        write = [c.slot * cap + c.length + t for c, n in zip(caches, counts) for t in range(n)]
        last = None if all(n == 1 for n in counts) else [r - 1 for r in rows[1:]]
        out_index = [0] * rows[-1]  # token row -> row of the buckets' concatenated outputs
        layout, lists, base = [], [], 0
        for members in buckets_of(counts):
            seqs = [caches[i] for i in members]
            w, p = len(members), max(counts[i] for i in members)
            for j, i in enumerate(members):
                for t in range(counts[i]):
                    out_index[rows[i] + t] = base + j * p + t
            base += w * p
            dense = consecutive(members) and all(counts[i] == p for i in members)
            slots = [c.slot for c in seqs]
            key_len = [c.length + counts[i] for c, i in zip(seqs, members)]
            n_keys = max(key_len)
            masks = None if tree is None or all(tree[i] is None for i in members) else [
                _tree_queries(tree[i], c.length, counts[i]) for c, i in zip(seqs, members)]
            width = 0 if masks is None else max(len(m[1][0]) for m in masks)
            layout.append((w, p, rows[members[0]] if dense else -1,
                           slots[0] if consecutive(slots) else -1, n_keys,
                           p == 1 and masks is None and all(n == n_keys for n in key_len),
                           width))
            lists += [
                None if dense else [rows[i] + min(t, counts[i] - 1)
                                    for i in members for t in range(p)],
                None if consecutive(slots) else slots,
                key_len,
                # a single query sees all its request's keys: no causal offset needed
                None if p == 1 or masks is not None else [c.length for c in seqs],
                None if masks is None else [m[0] for m in masks],
                None if masks is None else _padded_mask(masks, p, width),
            ]
        identity = base == rows[-1] and out_index == list(range(base))  # no padding
        sent = upload([positions, write, last, None if identity else out_index, *extra, *lists],
                       torch.long, pool.kv.device)
        self.positions, self.write, self.last, self.out_index = sent[:4]
        self.extra = sent[4 : 4 + len(extra)]
        self.buckets = []
        for b, (w, p, q_first, first_slot, n_keys, full, width) in enumerate(layout):
            at = 4 + len(extra) + _LISTS_PER_BUCKET * b
            q_index, slot_index, key_len_t, offset, start, small = sent[at : at + 6]
            assert key_len_t is not None
            mask = None
            if start is not None and small is not None:
                mask = _device_tree_mask(start, small.view(w, p, width) != 0, n_keys)
            self.buckets.append(DraftBucket(
                w, p, q_first, q_index, first_slot, slot_index, n_keys,
                WaveShape(None, key_len_t, offset, full, mask)))

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q: [num_tokens, heads, D]; k, v: [num_tokens, kv_heads, D] -> [num_tokens, heads, D]
        assert self.write is not None
        self.pool.write(layer, self.write, k, v)
        outs = []
        for b in self.buckets:
            w, p = b.num_rows, b.num_q
            qb = q[b.q_first : b.q_first + w * p] if b.q_index is None else q.index_select(
                0, b.q_index)
            kb, vb = self.pool.keys(layer, b.slots, b.first_slot, w, b.num_keys)
            att = self.attention(qb.reshape(w, p, *q.shape[1:]), k.shape[1], self.scale)
            att.add(kb, vb, b.shape)
            outs.append(att.result().flatten(0, 1))  # [W * P, heads, D]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if self.out_index is None else out.index_select(0, self.out_index)


def _tree_queries(tree: TreeQueries | None, length: int, count: int) -> TreeQueries:
    """A request's queries as ``(start, rows)``: ``rows[t]`` the bools over its entries
    ``start .. length + count``; a request without a tree is causal over its new tokens."""
    if tree is None:
        return length, [[u <= t for u in range(count)] for t in range(count)]
    start, seen = tree
    if len(seen) != count:
        raise ValueError(f"tree queries: {len(seen)} visibility lists for {count} tokens")
    width = length + count - start
    rows = []
    for entries in seen:
        row = [False] * width
        for e in entries:
            row[e] = True
        rows.append(row)
    return start, rows


def _padded_mask(masks: list[TreeQueries], num_q: int, width: int) -> list[int]:
    """The bucket's masks over the tree regions, ``[W, P, width]`` flat; padding queries repeat
    their request's last row (their output is discarded, but a row must see some key)."""
    flat: list[int] = []
    for _, rows in masks:
        for t in range(num_q):
            row = rows[min(t, len(rows) - 1)]
            flat += [int(x) for x in row] + [0] * (width - len(row))
    return flat


def _device_tree_mask(start: Tensor, small: Tensor, num_keys: int) -> Tensor:
    # start: [W] entries every query sees; small: [W, P, T] bool over entries start .. + T
    # -> [W, P, N] bool
    w, p, t = small.shape
    rel = torch.arange(num_keys, device=start.device)[None, :] - start[:, None]  # [W, N]
    seen = small.gather(2, rel.clamp(0, t - 1)[:, None, :].expand(w, p, num_keys))
    inside = (rel >= 0) & (rel < t)
    return (rel < 0)[:, None, :] | (seen & inside[:, None, :])
