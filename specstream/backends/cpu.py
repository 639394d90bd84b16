"""CPU transfer backend: an *emulation* of a host-device link, for tests and CI.

The "device" is ordinary CPU memory. One copy worker thread plays the DMA engine: it takes jobs
from a priority queue (every queued h2d restore before any d2h write-back, FIFO within a
direction), runs `dst.copy_(src)` and, when `link_gbps` is set, paces the jobs on a link clock:
a job starts on the link when it was queued or when the link finished the previous job,
whichever is later, and lands `nbytes / (link_gbps * 1e9)` seconds after that; the worker sleeps
until then. So link time relative to compute time looks like a PCIe link (e.g. ~25 GB/s for
PCIe 4 x16) even though the copy itself is a memcpy. The clock does what a DMA engine does and
a Python thread does not: the worker wakes late when the compute thread holds the interpreter
lock, but a late wake-up does not push back the jobs queued behind it (it only delays when the
waiter sees the copy), and the busy intervals recorded are the link clock's. A restore of
scattered host blocks is one gather (`h2d_gather`, one index_select) rather than a copy per
block. Completion is a `threading.Event`; an exception in a job is captured and re-raised by
`wait()` as `TransferError`, and the worker goes on with the next job.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specstream.backends.base import (
    D2H,
    H2D,
    BatchTag,
    TransferBackend,
    TransferError,
    TransferHandle,
    register_backend,
)

_PRIORITY = {H2D: 0, D2H: 1}
_STOP_PRIORITY = 2  # after every queued copy: close() drains the queue first


def limit_compute_threads(num_threads: int = 1) -> int:
    """Run torch compute on `num_threads` intra-op threads so the copy thread keeps a core.

    Measured on the 2-core CI machine: the copy thread overlapped a one-thread matmul almost
    fully (1.91x of serial) but not a two-thread one (1.03x), since two compute threads leave
    the copy worker no core. Returns the previous thread count, to restore it afterwards.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    return previous


@dataclass(eq=False)
class CpuHandle(TransferHandle):
    """Completion of one queued copy; `wait()` blocks the calling thread."""

    tag: object
    event: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def done(self) -> bool:
        return self.event.is_set()

    def wait(self) -> None:
        self.event.wait()
        if self.error is not None:
            if isinstance(self.error, TransferError):
                raise self.error
            raise TransferError(self.tag, f"transfer {self.tag!r} failed: {self.error}") from (
                self.error
            )


@dataclass
class _Job:
    pairs: list[tuple[Tensor, Tensor]]  # (dst, src) copies done back to back
    direction: str
    handle: CpuHandle
    fail: object | None  # fault injection decided at submit time: the tag to report
    submitted: float = 0.0  # the link clock's now() when queued
    # (dst, src, index, rows): dst[rows] = src[index] (rows None: dst[:n]), one index_select
    gather: tuple[Tensor, Tensor, Tensor, Tensor | None] | None = None


@register_backend("cpu")
class CpuBackend(TransferBackend):
    """Emulated link: one daemon copy worker, h2d before d2h, optional bandwidth throttle.

    `now` and `sleep` are the link clock (`time.perf_counter` and `time.sleep`); tests pass a
    fake clock to check the pacing without waiting for it.
    """

    def __init__(
        self, device: str = "cpu", link_gbps: float | None = None, *,
        now: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(device, link_gbps)
        self._now, self._sleep = now, sleep
        self._queue: queue.PriorityQueue[tuple[int, int, _Job | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._closed = False
        self._link_free_at = 0.0  # link clock: when the link finishes the last job (throttled)
        self._worker = threading.Thread(target=self._run, name="specstream-copy", daemon=True)
        self._worker.start()

    def h2d(
        self, dst: Tensor, src: Tensor, tag: object = None, *, after_compute: bool = True
    ) -> TransferHandle:
        return self._submit([(dst, src)], H2D, tag)

    def d2h(
        self, dst: Tensor, src: Tensor, tag: object = None, *, after_compute: bool = True
    ) -> TransferHandle:
        return self._submit([(dst, src)], D2H, tag)

    def h2d_many(
        self, pairs: list[tuple[Tensor, Tensor]], tag: object = None, *, after_compute: bool = True
    ) -> TransferHandle:
        return self._submit(pairs, H2D, tag)

    def d2h_many(
        self, pairs: list[tuple[Tensor, Tensor]], tag: object = None, *, after_compute: bool = True
    ) -> TransferHandle:
        return self._submit(pairs, D2H, tag)

    def h2d_gather(
        self, dst: Tensor, src: Tensor, index: list[int] | Tensor, tag: object = None, *,
        rows: list[int] | Tensor | None = None, after_compute: bool = True,
    ) -> TransferHandle:
        idx = index if isinstance(index, Tensor) else torch.tensor(index, dtype=torch.long)
        if rows is None:
            return self._submit([], H2D, tag, gather=(dst[: idx.numel()], src, idx, None))
        at = rows if isinstance(rows, Tensor) else torch.tensor(rows, dtype=torch.long)
        return self._submit([], H2D, tag, gather=(dst, src, idx, at))

    def _submit(
        self, pairs: list[tuple[Tensor, Tensor]], direction: str, tag: object,
        gather: tuple[Tensor, Tensor, Tensor, Tensor | None] | None = None,
    ) -> CpuHandle:
        # CPU compute runs synchronously in the caller, so `after_compute` always holds.
        if self._closed:
            raise RuntimeError("CpuBackend is closed")
        handle = CpuHandle(tag)
        job = _Job(pairs, direction, handle, fail=self._failing(tag),
                   submitted=self._now(), gather=gather)
        self._queue.put((_PRIORITY[direction], next(self._seq), job))
        return handle

    def _run(self) -> None:
        while True:
            _, _, job = self._queue.get()
            try:
                if job is None:
                    return
                self._execute(job)
            finally:
                self._queue.task_done()

    def _execute(self, job: _Job) -> None:
        nbytes = sum(src.numel() * src.element_size() for _, src in job.pairs)
        if job.gather is not None:
            table, index = job.gather[1], job.gather[2]
            nbytes += index.numel() * table[0].numel() * table.element_size()
        start = self._now()
        try:
            if job.fail is not None and not isinstance(job.fail, BatchTag):
                raise TransferError(job.fail, f"injected failure of transfer {job.fail!r}")
            for dst, src in job.pairs:
                dst.copy_(src)
            if job.gather is not None:
                dst, table, index, at = job.gather
                if at is None:
                    torch.index_select(table, 0, index, out=dst)
                else:
                    dst.index_copy_(0, at, table.index_select(0, index))
            if self.link_gbps is None:
                end = self._now()
            else:
                start = max(job.submitted, self._link_free_at)
                end = self._link_free_at = start + nbytes / (self.link_gbps * 1e9)
                remaining = end - self._now()
                if remaining > 0:
                    self._sleep(remaining)
            self._record(start, end, job.direction, nbytes, job.handle.tag)
            if job.fail is not None:  # some rows of a batched copy: the others landed
                raise TransferError(job.fail, f"injected failure of transfer {job.fail!r}")
        except BaseException as exc:  # noqa: BLE001  (delivered to the waiter, worker lives on)
            job.handle.error = exc
        finally:
            job.handle.event.set()

    def alloc_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.empty(shape, dtype=dtype)

    def alloc_device(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.empty(shape, dtype=dtype)

    def synchronize(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put((_STOP_PRIORITY, next(self._seq), None))
        self._worker.join()
