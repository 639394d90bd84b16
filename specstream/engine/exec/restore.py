"""``restore``, the offloading baseline: before a layer attends, that layer's whole history of
the batch is on the device; the next layer's restore is issued while this one computes, so the
link never waits on a competent schedule, but attention waits for the whole layer. A step lent
too little room for two whole layers (a small budget) restores each layer in pieces instead
(restore_pieces.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specstream.attention.waves import WaveShape
from specstream.backends.base import BatchTag, TransferError, TransferHandle, to_device
from specstream.engine.contract import StepPlan
from specstream.engine.exec.history import SOURCES, HistorySource, InFlight, Wave
from specstream.engine.exec.restore_pieces import PieceRing
from specstream.kvcache.storage import KVStore


@dataclass
class _Landed(InFlight):
    """A wave already on the device (restored layers)."""

    wave: Wave

    def done(self) -> bool:
        return True


@SOURCES.register("restore")
class LayerRestore(HistorySource):
    """Whole-layer restore with one layer of prefetch: two layers of the step's history on the
    device at a time, in the pool blocks the scheduler lent the step (``plan.restore_blocks``;
    every layer plane of a lent block is a slot for one block of history, so a request's layer
    history may come as a few pieces, each a one-request wave, merged exactly; a block several
    requests read, a shared prefix, is restored once and each of them attends that copy).
    Where the lent blocks hold less than two layers, a ``PieceRing`` restores the step in
    pieces (a shared block once per reader there)."""

    def __init__(self, store: KVStore, chunk_tokens: int, staging_buffers: int,
                 wave_requests: int = 8) -> None:
        super().__init__(store, chunk_tokens, staging_buffers, wave_requests)
        self.piece_steps = 0  # steps restored in pieces (the lent room held < two layers)
        self.most_copies = 0  # the most restore copies one step issued
        self.ring: PieceRing | None = None

    def begin(self, plan: StepPlan, buckets: list[list[int]], link_bps: float = 0.0) -> None:
        super().begin(plan, buckets, link_bps)
        # a slot for every distinct block any layer restores (the layer with the fewest blocks
        # on the host restores the most): a block several requests read (a shared prefix) is
        # restored once, and each of them attends that one copy
        self.pos: dict[int, int] = {}
        self.readers: dict[int, list[str]] = {}
        for s in plan.seqs:
            widest = s.host_layers.index(min(s.host_layers)) if s.host_layers else 0
            for b in s.layer_link_blocks(widest):
                self.pos.setdefault(b, len(self.pos))
                self.readers.setdefault(b, []).append(s.request_id)
        total = self.total_blocks = len(self.pos)
        self.shared = {b for b, r in self.readers.items() if len(r) > 1}
        self.slots = plan.restore_blocks
        self.handles: dict[int, list[TransferHandle]] = {}
        self.shapes: dict[tuple[int, int, int], WaveShape] = {}
        self.copies = 0
        self.ring = None
        if 2 * total > len(self.slots) * self.store.cfg.num_layers:
            assert self.slots, "a step with history to restore was lent no room"
            self.ring = PieceRing(self, self.slots)
            self.piece_steps += 1
        elif total:
            self._issue(0)

    def _runs(self, layer: int, index: int) -> list[tuple[int, int, int, int]]:
        """Where request ``index``'s history of ``layer`` lives: runs of (first history block,
        length, layer plane, first pool block), consecutive pool blocks within one plane."""
        blocks = self._blocks(layer, index)
        m, base = len(self.slots), (layer % 2) * self.total_blocks
        runs, t = [], 0
        while t < len(blocks):
            at = self.pos[blocks[t]]
            plane, col = divmod(base + at, m)
            length = 1
            while (t + length < len(blocks) and self.pos[blocks[t + length]] == at + length
                   and col + length < m and self.slots[col + length] == self.slots[col] + length):
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
        handles: list[TransferHandle] = []
        issued: set[int] = set()  # blocks of the layer already on their way
        for i, s in enumerate(self.plan.seqs):
            blocks = self._blocks(layer, i)
            for t, length, plane, first in self._runs(layer, i):
                if not self.shared:  # no block is read twice: the run is one copy
                    dst = self.store.device[plane, :, first : first + length]
                    handles += self.store.restore(layer, blocks[t : t + length], dst,
                                                  s.request_id)
                    self.copies += 1
                    continue
                # the run's blocks not issued yet, as consecutive pieces
                u = t
                while u < t + length:
                    if blocks[u] in issued:
                        u += 1
                        continue
                    v = u
                    while v < t + length and blocks[v] not in issued:
                        v += 1
                    piece = blocks[u:v]
                    issued.update(piece)
                    tag: object = s.request_id
                    if not self.shared.isdisjoint(piece):  # every request that reads it
                        tag = BatchTag(sorted({r for b in piece for r in self.readers[b]}))
                    dst = self.store.device[plane, :, first + u - t : first + v - t]
                    handles += self.store.restore(layer, piece, dst, tag)
                    self.copies += 1
                    u = v
        self.handles[layer] = handles

    def _shape(self, layer: int, index: int, run: int, num_keys: int) -> WaveShape:
        key = (layer % 2, index, run)
        if key not in self.shapes:
            self.shapes[key] = WaveShape.build(
                [self.where[index][1]], [num_keys], num_keys, None, self.store.device.device)
        return self.shapes[key]

    def landed(self, wave: InFlight) -> list[Wave]:
        if self.ring is not None:
            return self.ring.landed(wave)
        assert isinstance(wave, _Landed)
        return [wave.wave]

    def release(self, wave: InFlight) -> None:
        if self.ring is not None:
            self.ring.release(wave)

    def waves(self, layer: int) -> Iterator[InFlight]:
        if self.ring is not None:
            yield from self.ring.waves(layer)
            return
        if not self.total_blocks:
            return
        # full restore of the layer before any attention on it; then prefetch the next one
        t0 = time.perf_counter()
        for h in self.handles.pop(layer):
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
                yield _Landed((self.where[i][0], kv[0], kv[1],
                               self._shape(layer, i, r, length * bs)))

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

    def end(self, completed: bool = True) -> None:
        if self.ring is not None:
            self.copies = self.ring.issued
            self.ring.end(completed)
            self.ring = None
        self.most_copies = max(self.most_copies, self.copies)
        self.handles = {}
