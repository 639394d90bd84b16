"""CUDA transfer backend: pinned host memory, prioritised copy streams, CUDA events.

- h2d restores run on a high-priority stream, d2h write-backs on a low-priority one, both with
  `non_blocking=True` from/to pinned host memory so they run on the copy engines while kernels
  run on the compute stream.
- A handle's `wait()` makes the *current* stream wait on the copy's event (no host sync);
  `host_wait()` blocks the host.
- Busy time comes from timing events recorded around each copy. To report perf_counter
  timestamps, an anchor event is recorded at start-up right after a device sync and paired
  with `time.perf_counter()`; copy times are anchor time + event elapsed time. The anchor is
  off by the sync latency (tens of microseconds), which is fine for traces and link utilisation.
- `link_gbps` is accepted for interface symmetry and ignored: the real link sets the pace.

Nothing here touches CUDA at import time; constructing the backend without CUDA raises.
"""

from __future__ import annotations

import time
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
        # Lower number = higher priority; out-of-range values are clamped by CUDA.
        self.h2d_stream = torch.cuda.Stream(self._device, priority=-1)
        self.d2h_stream = torch.cuda.Stream(self._device, priority=0)
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event, str, int, object]] = []
        self._closed = False
        torch.cuda.synchronize(self._device)
        self._anchor = torch.cuda.Event(enable_timing=True)
        self._anchor.record(self.h2d_stream)
        self._anchor.synchronize()
        self._anchor_t = time.perf_counter()

    def h2d(
        self, dst: Tensor, src: Tensor, tag: object = None, *, after_compute: bool = True
    ) -> TransferHandle:
        return self._copy(self.h2d_stream, dst, src, H2D, tag, after_compute)

    def d2h(
        self, dst: Tensor, src: Tensor, tag: object = None, *, after_compute: bool = True
    ) -> TransferHandle:
        return self._copy(self.d2h_stream, dst, src, D2H, tag, after_compute)

    def _copy(
        self,
        stream: torch.cuda.Stream,
        dst: Tensor,
        src: Tensor,
        direction: str,
        tag: object,
        after_compute: bool,
    ) -> CudaHandle:
        if self._closed:
            raise RuntimeError("CudaBackend is closed")
        if self._should_fail(tag):
            error = TransferError(tag, f"injected failure of transfer {tag!r}")
            return CudaHandle(tag, self._device, None, error=error)
        if after_compute:
            stream.wait_stream(torch.cuda.current_stream(self._device))
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        for t in (dst, src):
            if t.is_cuda:  # the caching allocator must not reuse it before the copy ran
                t.record_stream(stream)
        nbytes = src.numel() * src.element_size()
        with self._lock:
            self._pending.append((start, end, direction, nbytes, tag))
        return CudaHandle(tag, self._device, end, keepalive=(dst, src))

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
        with self._lock:
            self._pending.clear()
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
