"""Prefix sharing under `fill`: one device copy of a shared run for all of its sharers.

Without it a shared prefix crosses the link once a round for all its sharers (exec/stream.py),
and the device windows hold only each request's own newest history: a window that grew into
the shared run would be a copy per sharer, and saves nothing while any sharer still streams
the block. Here the residency (engine/sched/residency.py) gives each distinct shared run a
share of the device like a request's (counted once, however many read it), caps every
sharer's window at its own blocks, and this holds the first ``target`` blocks of each run on
the device: taken over from the first sharer's window where it still holds them (no transfer),
else copied from the host once (a planned host-to-device copy at the start of the step, on the
link like any other), then read from the device by every sharer, which streams only the rest
of its history. A copy is freed when no running request references its block any more
or the residency takes the room back; the host copy (the cache's) stays, so freeing
moves no bytes.

A sharer's leading blocks with a device copy come first in its step's ``device_blocks`` and
are not host-read (``SeqWork.host_tokens`` leaves them out): attention reads the device blocks
as one key run in which the shared blocks, all older than the request's window, precede it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specstream.kvcache.blocks import BlockCopy, CopyKind
from specstream.kvcache.prefix_cache import Entry

if TYPE_CHECKING:
    from specstream.kvcache.manager import KVManager


class SharedDevice:
    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self.copies: dict[int, tuple[int, Entry]] = {}  # host block -> (device block, entry)

    @property
    def held(self) -> int:
        return len(self.copies)

    def runs(self, rids: list[str]) -> list[list[tuple[int, Entry]]]:
        """The distinct shared runs of the requests ``rids``, each as its (host block, cache
        entry) pairs, oldest first; a run as long as its longest sharer's."""
        out: dict[int, list[tuple[int, Entry]]] = {}
        for rid in rids:
            seq, n = self.kv.seqs[rid], self.run_of(rid)
            if n and n > len(out.get(seq.host_blocks[0], ())):
                out[seq.host_blocks[0]] = [(seq.host_blocks[i], seq.refs[i]) for i in range(n)]
        return list(out.values())

    def run_of(self, rid: str) -> int:
        """The leading blocks of ``rid`` that another running request references too, or
        that have a device copy (kept for its last reader: streaming them again, or growing
        its window over them, would move what is already there)."""
        seq, n = self.kv.seqs[rid], 0
        while n in seq.refs and (seq.refs[n].pins["host"] > 1
                                 or seq.host_blocks[n] in self.copies):
            n += 1
        return n

    def lead(self, rid: str) -> list[int]:
        """The device copies of ``rid``'s leading host-read blocks (before its window), as far
        as they run unbroken from its first block."""
        seq, out = self.kv.seqs[rid], []
        for n in range(seq.first):
            copy = self.copies.get(seq.host_blocks[n]) if n in seq.refs else None
            if copy is None:
                break
            out.append(copy[0])
        return out

    def hold(self, targets: list[tuple[list[tuple[int, Entry]], int]], spare: int
             ) -> list[BlockCopy]:
        """Keep the first ``t`` blocks of each shared run ``(run, t)`` on the device, freeing
        every other copy; new copies take at most ``spare`` free blocks, oldest block of each
        run first. Returns the host-to-device copies the step makes before anything reads
        them."""
        copies: list[BlockCopy] = []
        reached: set[int] = set()
        for run, t in targets:
            for h, entry in run[:t]:
                if h not in self.copies:
                    if spare <= 0:
                        break  # a sharer's lead runs unbroken from its first block
                    (d,) = self.kv.device.allocate(1)
                    self.copies[h] = (d, entry)
                    copies.append((CopyKind.HOST_TO_DEVICE, h, d))
                    spare -= 1
                reached.add(h)
        self.release([h for h in self.copies if h not in reached])  # not wanted, or past a gap
        return copies

    def take_over(self, targets: list[tuple[list[tuple[int, Entry]], int]]) -> None:
        """Before the room is made: the blocks of each run's first ``t`` that a sharer's window
        still holds at its front (the first sharer wrote them there) become the run's copies as
        they are, with no transfer (they have host copies; the window starts after them)."""
        for run, t in targets:
            for n, (h, entry) in enumerate(run[:t]):
                if h in self.copies:
                    continue
                seq = next((s for s in self.kv.seqs.values() if s.first == n and s.droppable
                            and s.refs.get(n) is entry), None)
                if seq is None:
                    break  # the rest are copied from the host (``hold``)
                self.copies[h] = (seq.device_blocks.pop(0), entry)
                seq.first += 1

    def prune(self) -> None:
        """Free the copies of blocks no running request references now."""
        self.release([h for h, (_, e) in self.copies.items() if e.pins["host"] < 1])

    def release(self, host_blocks: list[int]) -> None:
        self.kv.device.free([self.copies.pop(h)[0] for h in host_blocks])
