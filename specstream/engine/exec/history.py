"""How host history reaches attention in one step: not at all, whole layers, or chunk waves.

Sources yield *waves* (``attention/waves.py``): keys ``[W, N, kv, D]`` of some requests of one
query bucket, with the :class:`WaveShape` that says whose they are. The round attends each wave
in one call, whatever the number of requests in it.

- ``restore`` (the offloading baseline): before a layer attends, that layer's whole history of
  the batch is on the device; the next layer's restore is issued while this one computes, so the
  link never waits on a competent schedule, but attention waits for the whole layer.
- ``stream`` (SpecStream): for each layer, the j-th chunk of every request of a bucket (up to
  ``wave_requests`` of them) is one *chunk wave*: one batched copy into the staging ring, one
  event, one attention call that serves every query position of every request in it. All waves
  of the step are queued up front, layer-major, through a ring of ``staging_buffers`` full
  waves (``staging_buffers x wave_requests`` chunk regions of ``chunk_tokens`` tokens of one
  layer; a narrower wave takes fewer regions, so more of them fly at once); regions are refilled
  once the attention reading them was queued. Launches per step: layers x chunks, not
  layers x requests x chunks; device memory for history stays fixed whatever its length.

Both copy the blocks a request promotes (``SeqWork.promote``: its residency share grew) from
where they landed into the request's new device blocks, layer by layer as they pass: the window
widens without a byte more on the link.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from specstream.attention.waves import WaveShape
from specstream.backends.base import BatchTag, TransferError, TransferHandle, to_device
from specstream.engine.contract import StepPlan
from specstream.kvcache.storage import KVStore
from specstream.registry import Registry

# (bucket, k, v, shape): k, v [W, N, num_kv_heads, head_dim] for the bucket's requests in shape
Wave = tuple[int, torch.Tensor, torch.Tensor, WaveShape]
# (landed, link_busy_until) -> None: work that may run while a wave is still in flight
Gap = Callable[[Callable[[], bool], float], None]

SOURCES: Registry[type[HistorySource]] = Registry("history source")


def make_source(name: str, store: KVStore, chunk_tokens: int, staging_buffers: int,
                wave_requests: int = 8) -> HistorySource:
    return SOURCES.get(name)(store, chunk_tokens, staging_buffers, wave_requests)


def _failed_tags(exc: TransferError) -> list[object]:
    """The request tags a failed copy names (a batched copy names those whose rows failed)."""
    return list(exc.tag) if isinstance(exc.tag, BatchTag) else [exc.tag]


class HistorySource(ABC):
    """Yields the host-history waves of one layer in arrival order; a request whose copy failed
    lands in ``failed`` (its rows may hold anything; the request fails after the step)."""

    def __init__(self, store: KVStore, chunk_tokens: int, staging_buffers: int,
                 wave_requests: int = 8) -> None:
        self.store = store
        self.chunk_tokens = chunk_tokens
        self.staging_buffers = staging_buffers
        self.wave_requests = wave_requests
        self.peak_bytes = 0  # device bytes this source held at most
        self.wait_s = 0.0  # time attention sat waiting for copies (summed over steps)
        self.failed: dict[str, str] = {}  # this step: request id -> message
        # Bytes/s the link moves while busy, for landing estimates: a first guess (the
        # configured rate, where there is one), then measured from completed copies.
        self.link_bps = 10e9

    def observe_link(self, nbytes: int, busy_s: float) -> None:
        """Fold a step's completed copies into the link-rate estimate (EMA over steps that
        moved at least a megabyte, so a few tiny copies do not swing it)."""
        if nbytes >= 1 << 20 and busy_s > 0:
            self.link_bps = 0.7 * self.link_bps + 0.3 * nbytes / busy_s

    def begin(self, plan: StepPlan, buckets: list[list[int]]) -> None:
        """Issue what can be issued before the forward pass. ``buckets``: the step's requests
        (indices into ``plan.seqs``) as the round's query buckets."""
        self.plan = plan
        self.failed = {}
        self.where = {i: (b, p) for b, members in enumerate(buckets)
                      for p, i in enumerate(members)}

    @abstractmethod
    def waves(self, layer: int, while_waiting: Gap | None = None) -> Iterator[Wave]:
        """The waves of ``layer`` in arrival order. Before blocking on one still in flight,
        ``while_waiting(landed, link_busy_until)`` may use the wait (the drafter's gap)."""

    def end(self) -> None:  # noqa: B027
        """Drop per-step buffers."""

    def _fail(self, exc: TransferError) -> None:
        for tag in _failed_tags(exc):
            self.failed.setdefault(str(tag), f"KV restore failed: {exc}")


@SOURCES.register("none")
class NoHistory(HistorySource):
    def waves(self, layer: int, while_waiting: Gap | None = None) -> Iterator[Wave]:
        return iter(())


@SOURCES.register("restore")
class LayerRestore(HistorySource):
    """Whole-layer restore with one layer of prefetch: two layers of the step's history on the
    device at a time, in the pool blocks the scheduler lent the step (``plan.restore_blocks``;
    every layer plane of a lent block is a slot for one block of history, so a request's layer
    history may come as a few pieces, each a one-request wave, merged exactly)."""

    def begin(self, plan: StepPlan, buckets: list[list[int]]) -> None:
        super().begin(plan, buckets)
        self.offsets: list[int] = []
        total = 0
        for s in plan.seqs:  # each request's slots: room for its largest layer
            self.offsets.append(total)
            total += s.max_link_blocks
        self.total_blocks = total
        self.slots = plan.restore_blocks
        self.handles: dict[int, list[list[TransferHandle]]] = {}
        self.shapes: dict[tuple[int, int, int], WaveShape] = {}
        self.restored_layer = -1
        if total:
            assert 2 * total <= len(self.slots) * self.store.cfg.num_layers, "too few lent blocks"
            self._issue(0)

    def _runs(self, layer: int, index: int) -> list[tuple[int, int, int, int]]:
        """Where request ``index``'s history of ``layer`` lives: runs of (first history block,
        length, layer plane, first pool block), consecutive pool blocks within one plane."""
        n = len(self._blocks(layer, index))
        m, slot0 = len(self.slots), (layer % 2) * self.total_blocks + self.offsets[index]
        runs, t = [], 0
        while t < n:
            plane, col = divmod(slot0 + t, m)
            length = 1
            while (t + length < n and col + length < m
                   and self.slots[col + length] == self.slots[col] + length):
                length += 1
            runs.append((t, length, plane, self.slots[col]))
            t += length
        return runs

    def _blocks(self, layer: int, index: int) -> tuple[int, ...]:
        """The history blocks of request ``index`` that ``layer`` restores."""
        return self.plan.seqs[index].layer_link_blocks(layer)

    def _issue(self, layer: int) -> None:
        if layer >= self.store.cfg.num_layers or not self.total_blocks:
            return
        per_seq = []
        for i, s in enumerate(self.plan.seqs):
            blocks = self._blocks(layer, i)
            handles = []
            for t, length, plane, first in self._runs(layer, i):
                dst = self.store.device[plane, :, first : first + length]
                handles += self.store.restore(layer, blocks[t : t + length], dst, s.request_id)
            per_seq.append(handles)
        self.handles[layer] = per_seq

    def _shape(self, layer: int, index: int, run: int, num_keys: int) -> WaveShape:
        key = (layer % 2, index, run)
        if key not in self.shapes:
            self.shapes[key] = WaveShape.build(
                [self.where[index][1]], [num_keys], num_keys, None, self.store.device.device)
        return self.shapes[key]

    def waves(self, layer: int, while_waiting: Gap | None = None) -> Iterator[Wave]:
        if not self.total_blocks:
            return
        # full restore of the layer before any attention on it; then prefetch the next one
        t0 = time.perf_counter()
        for handles in self.handles.pop(layer):
            for h in handles:
                try:
                    h.wait()
                except TransferError as exc:
                    self._fail(exc)
        self.wait_s += time.perf_counter() - t0
        self._issue(layer + 1)
        self._promote(layer)
        cfg, bs = self.store.cfg, self.store.block_size
        for i, seq in enumerate(self.plan.seqs):
            if not seq.host_tokens or seq.request_id in self.failed:
                continue
            for r, (_, length, plane, first) in enumerate(self._runs(layer, i)):
                kv = self.store.device[plane, :, first : first + length]  # [2, n, bs, kv, D]
                kv = kv.reshape(2, 1, length * bs, cfg.num_kv_heads, cfg.head_dim)
                yield self.where[i][0], kv[0], kv[1], self._shape(layer, i, r, length * bs)

    def _promote(self, layer: int) -> None:
        """Copy this layer of promoted blocks from the lent slots into their device blocks."""
        device = self.store.device
        for i, seq in enumerate(self.plan.seqs):
            if not seq.promote or seq.request_id in self.failed:
                continue
            n = len(self._blocks(layer, i))
            lo = n - len(seq.promote)  # the first promoted history block
            for t, length, plane, first in self._runs(layer, i):
                a, b = max(t, lo), min(t + length, n)
                if a >= b:
                    continue
                dst = to_device(seq.promote[a - lo : b - lo], torch.long, device.device)
                device[layer].index_copy_(1, dst, device[plane, :, first + a - t : first + b - t])

    def end(self) -> None:
        self.handles = {}


@dataclass
class _WaveCopy:
    """One chunk wave's copy, the same for every layer: which host blocks go where."""

    bucket: int
    index: torch.Tensor  # [n] host blocks, request after request
    rows: torch.Tensor | None  # [n] slot rows they land in (None: 0 .. n-1)
    shape: WaveShape
    tag: BatchTag
    num_requests: int
    # promoted blocks in the wave: their rows in the wave's regions, and their device blocks
    promote_rows: torch.Tensor | None = None
    promote_dst: torch.Tensor | None = None


@SOURCES.register("stream")
class ChunkStream(HistorySource):
    """All chunk waves of the step, layer-major, through a ring of wave-sized staging slots."""

    def __init__(self, store: KVStore, chunk_tokens: int, staging_buffers: int,
                 wave_requests: int = 8) -> None:
        super().__init__(store, chunk_tokens, staging_buffers, wave_requests)
        cfg = store.cfg
        self.chunk_blocks = chunk_tokens // store.block_size
        # The ring holds staging_buffers x wave_requests chunk regions; a wave of w requests
        # takes w consecutive ones, so narrow waves (a lone prefill chunk, a small bucket) keep
        # as many chunks in flight as wide ones keep bytes.
        self.num_regions = staging_buffers * wave_requests
        shape = (2, self.num_regions * self.chunk_blocks, store.block_size, cfg.num_kv_heads,
                 cfg.head_dim)
        # zeroed: a ragged wave leaves rows of a region unwritten (masked, so finite is enough)
        self.ring = store.backend.alloc_device(shape, store.dtype).zero_()
        self.ring_rows = self.ring.transpose(0, 1)  # as rows of blocks
        self.ring_bytes = staging_buffers * wave_requests * chunk_tokens * store.layer_token_bytes
        self.block_layer_bytes = store.block_size * store.layer_token_bytes
        self._link_free_at = 0.0

    def _plan_waves(self, plan: StepPlan, buckets: list[list[int]], layer: int
                    ) -> list[_WaveCopy]:
        copies = []
        cb, bs, device = self.chunk_blocks, self.store.block_size, self.store.device.device
        chunks_of = [s.layer_chunks(layer, cb) for s in plan.seqs]
        for b, members in enumerate(buckets):
            depth = max((len(chunks_of[i]) for i in members), default=0)
            for j in range(depth):
                having = [p for p, i in enumerate(members) if len(chunks_of[i]) > j]
                for w0 in range(0, len(having), self.wave_requests):
                    part = having[w0 : w0 + self.wave_requests]
                    chunks = [chunks_of[members[p]][j] for p in part]
                    lens = [len(c) for c in chunks]
                    ragged = any(n != cb for n in lens)
                    rows = ([w * cb + t for w, n in enumerate(lens) for t in range(n)]
                            if ragged else None)
                    p_rows, p_dst = [], []  # promoted blocks: the request's newest
                    for w, p in enumerate(part):
                        s = plan.seqs[members[p]]
                        if not s.promote:
                            continue
                        lo = sum(len(c) for c in chunks_of[members[p]]) - len(s.promote)
                        for t in range(max(0, lo - j * cb), lens[w]):
                            p_rows.append(w * cb + t)
                            p_dst.append(s.promote[j * cb + t - lo])
                    copies.append(_WaveCopy(
                        b, torch.tensor([x for c in chunks for x in c], dtype=torch.long),
                        None if rows is None else torch.tensor(rows, dtype=torch.long),
                        WaveShape.build(None if part == list(range(len(members))) else part,
                                        [n * bs for n in lens], cb * bs, None, device),
                        BatchTag(plan.seqs[members[p]].request_id for p in part), len(part),
                        to_device(p_rows, torch.long, device) if p_rows else None,
                        to_device(p_dst, torch.long, device) if p_dst else None))
        return copies

    def begin(self, plan: StepPlan, buckets: list[list[int]]) -> None:
        super().begin(plan, buckets)
        # layers with the same split (host_layers) share one plan of waves
        plans: dict[tuple[int, ...], list[_WaveCopy]] = {}
        self.jobs: deque[tuple[int, _WaveCopy]] = deque()
        for layer in range(self.store.cfg.num_layers):
            key = tuple(s.host_layers[layer] if s.host_layers else -1 for s in plan.seqs)
            if key not in plans:
                plans[key] = self._plan_waves(plan, buckets, layer)
            self.jobs.extend((layer, c) for c in plans[key])
        # issued, not consumed, in order: (layer, copy, first region, handle)
        self.pending: deque[tuple[int, _WaveCopy, int, TransferHandle]] = deque()
        self.in_use: deque[tuple[int, int]] = deque()  # (first region, regions), issue order
        self.head = 0  # where the next wave's regions start, if free
        self._link_free_at = 0.0
        if self.jobs:
            self.peak_bytes = self.ring_bytes
        self._fill()

    def _regions(self, count: int) -> int | None:
        """The first of ``count`` free consecutive regions at the ring's head (from region 0
        when the end is too short), or None while a wave still in flight holds them."""
        start = self.head if self.head + count <= self.num_regions else 0
        if any(s < start + count and start < s + n for s, n in self.in_use):
            return None
        return start

    def _fill(self) -> None:
        cb = self.chunk_blocks
        while self.jobs:
            layer, copy = self.jobs[0]
            first = self._regions(copy.num_requests)
            if first is None:
                return
            self.jobs.popleft()
            self.in_use.append((first, copy.num_requests))
            self.head = first + copy.num_requests
            dst = self.ring_rows[first * cb : self.head * cb]
            handle = self.store.restore_rows(layer, copy.index, dst, copy.tag, copy.rows)
            # when the link should be done with everything issued (from the rate estimate)
            start = max(time.perf_counter(), self._link_free_at)
            nbytes = copy.index.numel() * self.block_layer_bytes
            self._link_free_at = start + nbytes / self.link_bps
            self.pending.append((layer, copy, first, handle))

    def waves(self, layer: int, while_waiting: Gap | None = None) -> Iterator[Wave]:
        cfg = self.store.cfg
        n = self.chunk_blocks * self.store.block_size
        while self.pending and self.pending[0][0] == layer:
            _, copy, first, handle = self.pending.popleft()
            if while_waiting is not None:
                while_waiting(handle.done, self._link_free_at)
            t0 = time.perf_counter()
            try:
                handle.wait()
            except TransferError as exc:
                self._fail(exc)
            self.wait_s += time.perf_counter() - t0
            w, cb = copy.num_requests, self.chunk_blocks
            buf = self.ring[:, first * cb : (first + w) * cb]  # [2, w * cb, bs, kv, D]
            if copy.promote_dst is not None and copy.promote_rows is not None:
                # queued before the regions are refilled (the next _fill)
                self.store.device[layer].index_copy_(
                    1, copy.promote_dst, buf.index_select(1, copy.promote_rows))
            kv = buf.reshape(2, w, n, cfg.num_kv_heads, cfg.head_dim)
            yield copy.bucket, kv[0], kv[1], copy.shape
            # the attention reading these regions is queued: refill them with the next waves
            self.in_use.popleft()
            self._fill()

    def end(self) -> None:
        assert not self.pending and not self.jobs, "stream left waves unconsumed"
