"""A `restore` step whose two layers of history do not fit in the room it was lent: each layer
comes in pieces through the room as a ring of slots (restore.py holds the whole-layer path).

A piece is at most half the room (so one lands while the one before it is attended) of one
request's history of one layer, cut where its slots stop being consecutive pool blocks of one
plane: one copy, one one-request wave, merged exactly like any other by the online softmax.
Pieces are issued in the order the round attends them (layer by layer, request by request),
as far ahead as the room allows; a piece's slots take the next copy once the attention
reading it is queued, so the next layer's first pieces fly while this layer's last ones are
attended.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specstream.attention.waves import WaveShape
from specstream.backends.base import TransferError, TransferHandle, to_device
from specstream.engine.exec.history import HistorySource, InFlight, Wave, in_order


@dataclass
class _Piece(InFlight):
    """One piece issued into the ring: blocks [first, first + length) of request ``index``'s
    history of ``layer``, in slots [slot, slot + length)."""

    layer: int
    index: int
    first: int
    length: int
    slot: int
    handle: TransferHandle

    def done(self) -> bool:
        return self.handle.done()


class PieceRing:
    """The step's pieces (``source.plan``) through the lent ``slots``: pool blocks, each of
    their layer planes one slot, slot s in plane s // len(slots)."""

    def __init__(self, source: HistorySource, slots: tuple[int, ...]) -> None:
        self.source, self.slots = source, slots
        self.num_layers = source.store.cfg.num_layers
        self.capacity = len(slots) * self.num_layers
        self.most = max(1, self.capacity // 2)  # blocks a piece holds at most
        seqs = source.plan.seqs
        # what is left to issue: (layer, request, next block), in the order attention reads
        self.jobs = deque((layer, i) for layer in range(self.num_layers)
                          for i in range(len(seqs)) if seqs[i].layer_link_blocks(layer))
        self.next_block = 0
        self.pending: deque[_Piece] = deque()  # issued, not yet released, in order
        self.head = 0  # the slot the next piece starts at, if free
        self.shapes: dict[tuple[int, int], WaveShape] = {}
        self.issued = 0
        self._fill()

    def _where(self, slot: int) -> tuple[int, int]:
        """(plane, pool block) of a slot."""
        plane, col = divmod(slot, len(self.slots))
        return plane, self.slots[col]

    def _run(self, slot: int, most: int) -> int:
        """Slots from ``slot`` on (at most ``most``) that are consecutive blocks of a plane."""
        m, col = len(self.slots), slot % len(self.slots)
        length = 1
        while length < most and col + length < m and (
                self.slots[col + length] == self.slots[col] + length):
            length += 1
        return length

    def _room(self) -> int:
        """Free consecutive slots from the head (pieces leave the ring in the order they
        entered, so the free slots run from the head to the oldest piece, round the end)."""
        if not self.pending:
            self.head = 0
            return self.capacity
        oldest = self.pending[0].slot
        if self.head > oldest and self.head == self.capacity:
            self.head = 0  # round the end
        if self.head > oldest:
            return self.capacity - self.head
        return oldest - self.head

    def _fill(self) -> None:
        store, seqs = self.source.store, self.source.plan.seqs
        while self.jobs:
            layer, i = self.jobs[0]
            blocks = seqs[i].layer_link_blocks(layer)
            room = self._room()
            if not room:
                return
            start = self.head
            length = self._run(start, min(len(blocks) - self.next_block, self.most, room))
            plane, first = self._where(start)
            t = self.next_block
            dst = store.device[plane, :, first : first + length]
            (handle,) = store.restore(layer, blocks[t : t + length], dst, seqs[i].request_id)
            self.pending.append(_Piece(layer, i, t, length, start, handle))
            self.issued += 1
            self.head = start + length
            self.next_block += length
            if self.next_block == len(blocks):
                self.jobs.popleft()
                self.next_block = 0

    def waves(self, layer: int) -> Iterator[InFlight]:
        return in_order(self.pending, layer)

    def landed(self, wave: InFlight) -> list[Wave]:
        assert isinstance(wave, _Piece) and wave is self.pending[0], "pieces land in order"
        source = self.source
        t0 = time.perf_counter()
        try:
            wave.handle.wait()
        except TransferError as exc:
            source._fail(exc)
        source.wait_s += time.perf_counter() - t0
        seq, store = source.plan.seqs[wave.index], source.store
        plane, first = self._where(wave.slot)
        kv = store.device[plane, :, first : first + wave.length]  # [2, n, bs, kv, D]
        if seq.promote and seq.request_id not in source.failed:
            lo = len(seq.layer_link_blocks(wave.layer)) - len(seq.promote)
            a, b = max(wave.first, lo), wave.first + wave.length
            if a < b:  # queued before the slots take the next copy (``release``)
                dst = to_device(seq.promote[a - lo : b - lo], torch.long, store.device.device)
                store.device[wave.layer].index_copy_(
                    1, dst, kv[:, a - wave.first : b - wave.first])
        cfg, keys = store.cfg, wave.length * store.block_size
        bucket, row = source.where[wave.index]
        if (row, keys) not in self.shapes:
            self.shapes[row, keys] = WaveShape.build([row], [keys], keys, None,
                                                     store.device.device)
        kv = kv.reshape(2, 1, keys, cfg.num_kv_heads, cfg.head_dim)
        return [(bucket, kv[0], kv[1], self.shapes[row, keys])]

    def release(self, wave: InFlight) -> None:
        assert wave is self.pending[0]
        self.pending.popleft()
        self._fill()

    def end(self, completed: bool = True) -> None:
        assert not completed or not (self.pending or self.jobs), "restore left pieces unconsumed"
        self.pending.clear()
        self.jobs.clear()
