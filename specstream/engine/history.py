"""How host history reaches attention in one step: not at all, whole layers, or streamed chunks.

- ``restore`` (the offloading baseline): before a layer attends, that layer's whole history of
  the batch is on the device; the next layer's restore is issued while this one computes, so the
  link never waits on a competent schedule, but attention waits for the whole layer.
- ``stream`` (SpecStream): every (layer, request, chunk) copy is queued up front through a fixed
  ring of staging buffers; attention starts on the first chunk that lands and each chunk serves
  all query positions of its request; a buffer is refilled only after the attention reading it
  has finished. Device memory for history stays fixed whatever the history length.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from specstream.backends.base import TransferError, TransferHandle
from specstream.engine.step import StepPlan
from specstream.kvcache.storage import KVStore
from specstream.registry import Registry

Piece = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_tokens, num_kv_heads, head_dim]
# (landed, link_busy_until) -> None: work that may run while a piece is still in flight
Gap = Callable[[Callable[[], bool], float], None]

SOURCES: Registry[type[HistorySource]] = Registry("history source")


def make_source(
    name: str, store: KVStore, chunk_tokens: int, staging_buffers: int
) -> HistorySource:
    return SOURCES.get(name)(store, chunk_tokens, staging_buffers)


def _all_done(handles: tuple[TransferHandle, ...]) -> bool:
    return all(h.done() for h in handles)


def _wait_all(handles: list[TransferHandle]) -> TransferError | None:
    err = None
    for h in handles:
        try:
            h.wait()
        except TransferError as exc:
            err = err or exc
    return err


class HistorySource(ABC):
    """Yields the host-history pieces of (layer, request) in order; raises TransferError after
    the request's pieces of that layer were consumed if one of its copies failed."""

    def __init__(self, store: KVStore, chunk_tokens: int, staging_buffers: int) -> None:
        self.store = store
        self.chunk_tokens = chunk_tokens
        self.staging_buffers = staging_buffers
        self.peak_bytes = 0  # device bytes this source held at most
        self.wait_s = 0.0  # time attention sat waiting for copies (summed over steps)
        # Bytes/s the link moves while busy, for landing estimates: a first guess (the
        # configured rate, where there is one), then measured from completed copies.
        self.link_bps = 10e9

    def observe_link(self, nbytes: int, busy_s: float) -> None:
        """Fold a step's completed copies into the link-rate estimate (EMA over steps that
        moved at least a megabyte, so a few tiny copies do not swing it)."""
        if nbytes >= 1 << 20 and busy_s > 0:
            self.link_bps = 0.7 * self.link_bps + 0.3 * nbytes / busy_s

    def begin(self, plan: StepPlan) -> None:  # noqa: B027
        """Issue what can be issued before the forward pass."""

    @abstractmethod
    def pieces(self, layer: int, index: int, while_waiting: Gap | None = None
               ) -> Iterator[Piece]:
        """History pieces of request ``plan.seqs[index]`` at ``layer``, in arrival order.
        Before blocking on a piece still in flight, ``while_waiting(landed, link_busy_until)``
        may use the wait (the drafter's gap)."""

    def end(self) -> None:  # noqa: B027
        """Drop per-step buffers."""


@SOURCES.register("none")
class NoHistory(HistorySource):
    def pieces(self, layer: int, index: int, while_waiting: Gap | None = None
               ) -> Iterator[Piece]:
        return iter(())


@SOURCES.register("restore")
class LayerRestore(HistorySource):
    """Whole-layer restore with one layer of prefetch: two layers of the step's history on the
    device at a time, in the pool blocks the scheduler lent the step (``plan.restore_blocks``;
    every layer plane of a lent block is a slot for one block of history, so a request's layer
    history may come as a few pieces, merged exactly by the online softmax)."""

    def begin(self, plan: StepPlan) -> None:
        self.plan = plan
        self.offsets: list[int] = []
        total = 0
        for s in plan.seqs:
            self.offsets.append(total)
            total += sum(len(c) for c in s.restore_chunks)
        self.total_blocks = total
        self.slots = plan.restore_blocks
        self.handles: dict[int, list[list[TransferHandle]]] = {}
        self.restored_layer = -1
        self.errors: list[TransferError | None] = []
        if total:
            assert 2 * total <= len(self.slots) * self.store.cfg.num_layers, "too few lent blocks"
            self._issue(0)

    def _runs(self, layer: int, index: int) -> list[tuple[int, int, int, int]]:
        """Where request ``index``'s history of ``layer`` lives: runs of (first history block,
        length, layer plane, first pool block), consecutive pool blocks within one plane."""
        n = sum(len(c) for c in self.plan.seqs[index].restore_chunks)
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

    def _issue(self, layer: int) -> None:
        if layer >= self.store.cfg.num_layers or not self.total_blocks:
            return
        per_seq = []
        for i, s in enumerate(self.plan.seqs):
            blocks = tuple(b for c in s.restore_chunks for b in c)
            handles = []
            for t, length, plane, first in self._runs(layer, i):
                dst = self.store.device[plane, :, first : first + length]
                handles += self.store.restore(layer, blocks[t : t + length], dst, s.request_id)
            per_seq.append(handles)
        self.handles[layer] = per_seq

    def pieces(self, layer: int, index: int, while_waiting: Gap | None = None
               ) -> Iterator[Piece]:
        seq = self.plan.seqs[index]
        if not seq.host_tokens:
            return
        if self.restored_layer != layer:
            # full restore of the layer before any attention on it; then prefetch the next one
            t0 = time.perf_counter()
            self.errors = [_wait_all(h) for h in self.handles.pop(layer)]
            self.wait_s += time.perf_counter() - t0
            self.restored_layer = layer
            self._issue(layer + 1)
        error = self.errors[index]
        if error is not None:
            raise error
        cfg = self.store.cfg
        for _, length, plane, first in self._runs(layer, index):
            kv = self.store.device[plane, :, first : first + length]  # [2, length, bs, kv, D]
            yield (kv[0].reshape(-1, cfg.num_kv_heads, cfg.head_dim),
                   kv[1].reshape(-1, cfg.num_kv_heads, cfg.head_dim))

    def end(self) -> None:
        self.handles = {}


@dataclass
class _Job:
    layer: int
    index: int
    blocks: tuple[int, ...]
    tag: object
    slot: int = -1
    handles: tuple[TransferHandle, ...] = ()


@SOURCES.register("stream")
class ChunkStream(HistorySource):
    """All chunk copies of the step, layer-major, through a ring of staging buffers."""

    def __init__(self, store: KVStore, chunk_tokens: int, staging_buffers: int) -> None:
        super().__init__(store, chunk_tokens, staging_buffers)
        cfg = store.cfg
        blocks = chunk_tokens // store.block_size
        shape = (2, blocks, store.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.ring = [store.backend.alloc_device(shape, store.dtype) for _ in range(staging_buffers)]
        self.ring_bytes = staging_buffers * chunk_tokens * store.layer_token_bytes
        self.chunk_bytes_per_block = store.block_size * store.layer_token_bytes
        self._link_free_at = 0.0

    def begin(self, plan: StepPlan) -> None:
        self.jobs: deque[_Job] = deque(
            _Job(layer, i, chunk, s.request_id)
            for layer in range(self.store.cfg.num_layers)
            for i, s in enumerate(plan.seqs)
            for chunk in s.restore_chunks
        )
        self.pending: deque[_Job] = deque()  # issued, not consumed, in order
        self._link_free_at = 0.0
        self.free_slots = deque(range(len(self.ring)))
        if self.jobs:
            self.peak_bytes = self.ring_bytes
        self._fill()

    def _fill(self) -> None:
        while self.free_slots and self.jobs:
            job = self.jobs.popleft()
            job.slot = self.free_slots.popleft()
            job.handles = tuple(
                self.store.restore(job.layer, job.blocks, self.ring[job.slot], job.tag)
            )
            # when the link should be done with everything issued (from the rate estimate)
            start = max(time.perf_counter(), self._link_free_at)
            nbytes = len(job.blocks) * self.chunk_bytes_per_block
            self._link_free_at = start + nbytes / self.link_bps
            self.pending.append(job)

    def pieces(self, layer: int, index: int, while_waiting: Gap | None = None
               ) -> Iterator[Piece]:
        cfg = self.store.cfg
        error: TransferError | None = None
        while self.pending and (self.pending[0].layer, self.pending[0].index) == (layer, index):
            job = self.pending.popleft()
            if while_waiting is not None:
                while_waiting(partial(_all_done, job.handles), self._link_free_at)
            t0 = time.perf_counter()
            err = _wait_all(list(job.handles))
            self.wait_s += time.perf_counter() - t0
            if err is None and error is None:
                n = len(job.blocks)
                buf = self.ring[job.slot]
                yield (buf[0, :n].reshape(-1, cfg.num_kv_heads, cfg.head_dim),
                       buf[1, :n].reshape(-1, cfg.num_kv_heads, cfg.head_dim))
            error = error or err
            # the attention on this buffer has finished: refill it with the next chunk
            self.free_slots.append(job.slot)
            self._fill()
        if error is not None:
            raise error

    def end(self) -> None:
        assert not self.pending and not self.jobs, "stream left chunks unconsumed"
