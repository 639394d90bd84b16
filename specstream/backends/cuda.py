"""CUDA transfer backend: pinned host memory, prioritised streams, CUDA events.

Streams (lower number = higher priority, clamped to the device's range):
- `h2d_stream` (highest): restores, `non_blocking=True` from pinned host memory, so they run on
  a copy engine while kernels run;
- `d2h_stream` (lowest): write-backs to pinned host memory;
- the compute stream is whatever stream is current when the engine runs (verification);
  `verify_stream()` offers a high-priority one, and `draft_stream()` a low-priority one for
  drafting in the link's gaps (draft kernels yield SMs to verification kernels).

Ordering, with no host synchronisation inside a round:
- `after_compute=True` makes the copy stream wait (`wait_stream`, an event, not a host sync)
  for everything already queued on the current stream. A staging buffer refilled right after
  the attention that reads it was *queued* (as `engine.history.ChunkStream` does: the refill
  is issued when the consumer resumes the generator, after queueing `partial_attention` on the
  yielded views) is therefore overwritten only after that attention ran. The same holds for
  `LayerRestore`'s two layer buffers and for write-backs reading freshly written KV.
- A handle's `wait()` makes the *current* stream wait on the copy's end event; `host_wait()`
  blocks the host. Write-back then restore of the same host block is ordered transitively: the
  worker `wait()`s on write-backs (compute stream waits on d2h), and a later restore with
  `after_compute=True` waits on the compute stream. A copy issued with `after_compute=False`
  is ordered after nothing, so it must not target memory that queued work still reads.
- Device tensors used on a side stream get `record_stream`, so the caching allocator does not
  hand their memory out again before the copy ran; the handle also keeps both tensors alive.
- Pinned host memory comes from torch's caching host allocator, which rounds each allocation
  up to a power of two: size host KV pools accordingly (e.g. host_kv_bytes = 16 GiB).
- `h2d_many`/`d2h_many` (a staging chunk: K and V of many blocks) are one transfer: one stream
  wait, all copies back to back, one pair of timing events and one handle, so the per-transfer
  overhead does not scale with the number of blocks.
- Busy time comes from timing events recorded around each transfer. To report perf_counter
  timestamps, an anchor event is recorded at start-up right after a device sync and paired
  with `time.perf_counter()`; copy times are anchor time + event elapsed time. The anchor is
  off by the sync latency (tens of microseconds), which is fine for traces and link utilisation.
- `link_gbps` is accepted for interface symmetry and ignored: the real link sets the pace.

Nothing here touches CUDA at import time; constructing the backend without CUDA raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from specstream.backends.base import (
    D2H,
    H2D,
    TransferBackend,
    TransferError,
    TransferHandle,
    TransferRecord,
    register_backend,
)


def _contiguous(dst: Tensor, src: Tensor) -> list[tuple[Tensor, Tensor]]:
    """A host<->device copy as copies of contiguous pieces (split along leading dimensions):
    torch would otherwise stage a strided copy through a temporary, on the host synchronously."""
    if dst.is_contiguous() and src.is_contiguous():
        return [(dst, src)]
    if dst.is_cuda and src.is_cuda or dst.dim() == 0:
        return [(dst, src)]
    return [p for a, b in zip(dst.unbind(0), src.unbind(0)) for p in _contiguous(a, b)]


@dataclass(eq=False)
class CudaHandle(TransferHandle):
    """Completion of one copy: its end event, plus references that keep the tensors alive."""

    tag: object
    device: torch.device
    event: torch.cuda.Event | None  # None when the copy failed at submission
    keepalive: tuple[Tensor, ...] = ()
    error: TransferError | None = None

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Order the current stream after the copy, without blocking the host."""
        if self.error is not None or self.event is None:
            raise self.error or TransferError(self.tag, f"transfer {self.tag!r} failed")
        torch.cuda.current_stream(self.device).wait_event(self.event)

    def host_wait(self) -> None:
        if self.error is not None or self.event is None:
            raise self.error or TransferError(self.tag, f"transfer {self.tag!r} failed")
        self.event.synchronize()


@register_backend("cuda")
class CudaBackend(TransferBackend):
    """Copies on two prioritised side streams; see the module docstring."""

    def __init__(self, device: str = "cuda", link_gbps: float | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"transfer backend {device!r} needs CUDA, but torch.cuda.is_available() is False "
                "(CPU-only torch build or no GPU); use make_backend('cpu') for the emulated link"
            )
        super().__init__(device, link_gbps)
        dev = torch.device(device)
        self._device = (
            dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
        )
        # e.g. (0, -5): lower = higher priority (a static method the stubs call an instance one)
        low, high = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
        self.h2d_stream = torch.cuda.Stream(self._device, priority=high)
        self.d2h_stream = torch.cuda.Stream(self._device, priority=low)
        self._verify_stream = torch.cuda.Stream(self._device, priority=high)
        self._draft_stream = torch.cuda.Stream(self._device, priority=low)
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event, str, int, object]] = []
        self._closed = False
        torch.cuda.synchronize(self._device)
        self._anchor = torch.cuda.Event(enable_timing=True)
        self._anchor.record(self.h2d_stream)
        self._anchor.synchronize()
        self._anchor_t = time.perf_counter()

    # -- compute streams ------------------------------------------------------------------------
    @contextmanager
    def verify_stream(self) -> Iterator[torch.cuda.Stream]:
        """Run the enclosed work on the high-priority verification stream (see draft_stream)."""
        with self._side_stream(self._verify_stream) as stream:
            yield stream

    def queries_to_host(self, q: Tensor) -> tuple[Tensor, Callable[[], None]]:
        """Into pinned memory on the compute stream, without blocking it; the worker waits on
        the copy's event, not the caller."""
        q_host = torch.empty(q.shape, dtype=torch.float32, pin_memory=True)
        q_host.copy_(q.detach(), non_blocking=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        return q_host, ready.synchronize

    def results_from_host(self, t: Tensor) -> Tensor:
        return t.pin_memory()

    def to_device_async(self, t: Tensor, device: torch.device) -> Tensor:
        """From pinned memory, so the copy does not synchronise the stream."""
        return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)

    @contextmanager
    def draft_stream(self) -> Iterator[torch.cuda.Stream]:
        """Run the enclosed work (drafting) on the low-priority draft stream.

        On entry the draft stream waits for the work queued so far on the caller's stream (its
        inputs); on exit the caller's stream is *not* made to wait: call `join(stream)` where the
        drafts are consumed. Tensors allocated inside and used on another stream afterwards need
        `record_stream` (or must outlive that use), as with any side stream.
        """
        with self._side_stream(self._draft_stream) as stream:
            yield stream

    @contextmanager
    def _side_stream(self, stream: torch.cuda.Stream) -> Iterator[torch.cuda.Stream]:
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            yield stream

    def join(self, stream: object) -> None:
        """Make the current stream wait for all work queued on `stream` (no host sync)."""
        assert isinstance(stream, torch.cuda.Stream)
        torch.cuda.current_stream(self._device).wait_stream(stream)

    # -- copies ---------------------------------------------------------------------------------
    def h2d(
        self, dst: Tensor, src: Tensor, tag: object = None, *, after_compute: bool = True
    ) -> TransferHandle:
        return self._copy(self.h2d_stream, [(dst, src)], H2D, tag, after_compute)

    def d2h(
        self, dst: Tensor, src: Tensor, tag: object = None, *, after_compute: bool = True
    ) -> TransferHandle:
        return self._copy(self.d2h_stream, [(dst, src)], D2H, tag, after_compute)

    def h2d_many(
        self, pairs: list[tuple[Tensor, Tensor]], tag: object = None, *, after_compute: bool = True
    ) -> TransferHandle:
        return self._copy(self.h2d_stream, pairs, H2D, tag, after_compute)

    def d2h_many(
        self, pairs: list[tuple[Tensor, Tensor]], tag: object = None, *, after_compute: bool = True
    ) -> TransferHandle:
        return self._copy(self.d2h_stream, pairs, D2H, tag, after_compute)

    def _copy(
        self,
        stream: torch.cuda.Stream,
        pairs: list[tuple[Tensor, Tensor]],  # (dst, src), copied back to back
        direction: str,
        tag: object,
        after_compute: bool,
    ) -> CudaHandle:
        """One transfer: one stream wait, one pair of timing events, one handle for all pairs."""
        if self._closed:
            raise RuntimeError("CudaBackend is closed")
        failing = self._failing(tag)
        if failing is not None:
            error = TransferError(failing, f"injected failure of transfer {failing!r}")
            return CudaHandle(tag, self._device, None, error=error)
        if after_compute:
            stream.wait_stream(torch.cuda.current_stream(self._device))
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        pairs = [piece for pair in pairs for piece in _contiguous(*pair)]
        with torch.cuda.stream(stream):
            start.record(stream)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            end.record(stream)
        device_storages = {
            t.untyped_storage().data_ptr(): t for pair in pairs for t in pair if t.is_cuda
        }
        for t in device_storages.values():  # the allocator must not reuse them before the copy
            t.record_stream(stream)
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        with self._lock:
            self._pending.append((start, end, direction, nbytes, tag))
        keepalive = tuple(t for pair in pairs for t in pair)
        return CudaHandle(tag, self._device, end, keepalive=keepalive)

    def _finished_records(self) -> list[TransferRecord]:
        with self._lock:
            still: list[tuple[torch.cuda.Event, torch.cuda.Event, str, int, object]] = []
            for start, end, direction, nbytes, tag in self._pending:
                if not end.query():
                    still.append((start, end, direction, nbytes, tag))
                    continue
                t0 = self._anchor_t + self._anchor.elapsed_time(start) / 1e3
                t1 = self._anchor_t + self._anchor.elapsed_time(end) / 1e3
                self._records.append(TransferRecord(t0, t1, direction, nbytes, tag))
            self._pending = still
            return list(self._records)

    def reset_stats(self) -> None:
        """Forget finished copies; copies still in flight are reported once they finish (the
        engine resets after every step, and a low-priority write-back may outlive its step)."""
        self._finished_records()
        with self._lock:
            self._records.clear()

    def alloc_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def alloc_device(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.empty(shape, dtype=dtype, device=self._device)

    def synchronize(self) -> None:
        self.h2d_stream.synchronize()
        self.d2h_stream.synchronize()

    def close(self) -> None:
        if self._closed:
            return
        self.synchronize()
        self._closed = True
