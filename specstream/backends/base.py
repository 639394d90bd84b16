"""The transfer interface: how KV bytes move between host memory and the device.

The engine (KV manager, round worker) only sees `TransferBackend` and `TransferHandle`; streams,
events, pinned memory and worker threads live in one module per device (`cpu.py`, `cuda.py`).
Restores (host to device, `h2d`) have priority over write-backs (device to host, `d2h`), because
a restore is on the critical path of the current round and a write-back is not.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import ClassVar, NamedTuple, TypeVar

import torch
from torch import Tensor

from specstream.registry import Registry

H2D = "h2d"
D2H = "d2h"


class TransferError(RuntimeError):
    """A copy failed; `tag` is the opaque tag (e.g. a request id) it was submitted with."""

    def __init__(self, tag: object, message: str) -> None:
        super().__init__(message)
        self.tag = tag


@contextmanager
def sync_point() -> Iterator[None]:
    """Where a round means to synchronise with the device (the tokens it emitted come back).
    CUDA's sync debug mode (tests run rounds under "error") lets these, and only these, through."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def upload(lists: Sequence[Sequence[float] | None], dtype: torch.dtype,
           device: torch.device | str) -> list[Tensor | None]:
    """Host lists as device tensors, sent as one transfer: pinned and non-blocking on a GPU
    (``torch.tensor(values, device="cuda")`` would copy from pageable memory and synchronise
    the stream, so preparing a round would wait for the device). None stays None."""
    device = torch.device(device)
    flat = torch.tensor([x for values in lists if values is not None for x in values], dtype=dtype)
    if device.type != "cpu":
        flat = flat.pin_memory().to(device, non_blocking=True)
    out: list[Tensor | None] = []
    at = 0
    for values in lists:
        out.append(None if values is None else flat[at : at + len(values)])
        at += 0 if values is None else len(values)
    return out


def to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """One host list as a device tensor without a stream sync (see ``upload``)."""
    (t,) = upload([values], dtype, device)
    assert t is not None
    return t


class BatchTag(tuple):  # type: ignore[type-arg]
    """The tags of the requests one batched copy serves (a chunk wave), in row order. A failure
    of the copy fails those whose rows it could not copy; an injected failure for any member's
    tag fails that member (the error's tag is the BatchTag of the failing members)."""


class TransferRecord(NamedTuple):
    """One finished copy, for stats and tracing (perf_counter timestamps, seconds)."""

    start: float
    end: float
    direction: str  # H2D or D2H
    nbytes: int
    tag: object


class TransferHandle(ABC):
    """Event-like completion handle of one submitted copy."""

    tag: object

    @abstractmethod
    def done(self) -> bool:
        """True once the copy finished (successfully or not); never blocks."""

    @abstractmethod
    def wait(self) -> None:
        """Make the caller's compute see the copied data; raise TransferError if it failed.

        On CPU this blocks the calling thread; on CUDA it only orders the current stream after
        the copy (no host sync), see `host_wait`.
        """

    def host_wait(self) -> None:
        """Block the calling host thread until the copy finished; raise TransferError if failed."""
        self.wait()


class MultiHandle(TransferHandle):
    """Completion of a group of copies: done when all are; the first failure is raised."""

    def __init__(self, tag: object, handles: list[TransferHandle]) -> None:
        self.tag, self.handles = tag, handles

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self) -> None:
        error = None
        for h in self.handles:
            try:
                h.wait()
            except TransferError as exc:
                error = error or exc
        if error is not None:
            raise error

    def host_wait(self) -> None:
        for h in self.handles:
            h.host_wait()


class TransferBackend(ABC):
    """Copies between host tensors and device tensors, with priorities, stats and fault hooks.

    Subclasses record each finished copy with `_record`, and consult `_failing(tag)` when a
    copy is submitted. Failures are reported through the handle, never by killing a worker.
    """

    name: ClassVar[str] = "abstract"

    def __init__(self, device: str, link_gbps: float | None = None) -> None:
        if link_gbps is not None and link_gbps <= 0:
            raise ValueError(f"link_gbps must be positive, got {link_gbps}")
        self.device = device
        self.link_gbps = link_gbps  # GB/s (1e9 bytes per second)
        self._lock = threading.Lock()
        self._records: list[TransferRecord] = []
        self._fail_predicates: list[Callable[[object], bool]] = []

    # -- copies ---------------------------------------------------------------------------------
    @abstractmethod
    def h2d(
        self, dst: Tensor, src: Tensor, tag: object = None, *, after_compute: bool = True
    ) -> TransferHandle:
        """Copy host `src` into device `dst` (restore, high priority); returns at once.

        `after_compute`: the copy starts only after the compute already queued by the caller
        (needed when `dst` may still be read by it, e.g. a staging buffer being refilled).
        """

    @abstractmethod
    def d2h(
        self, dst: Tensor, src: Tensor, tag: object = None, *, after_compute: bool = True
    ) -> TransferHandle:
        """Copy device `src` into host `dst` (write-back, low priority: queued h2d goes first)."""

    def h2d_many(
        self, pairs: list[tuple[Tensor, Tensor]], tag: object = None, *, after_compute: bool = True
    ) -> TransferHandle:
        """Several host-to-device copies as one transfer with one completion handle (one
        staging chunk is many blocks; per-copy overhead must not scale with the block count)."""
        return MultiHandle(tag, [self.h2d(d, s, tag, after_compute=after_compute)
                                 for d, s in pairs])

    def h2d_gather(
        self, dst: Tensor, src: Tensor, index: list[int] | Tensor, tag: object = None, *,
        rows: list[int] | Tensor | None = None, after_compute: bool = True,
    ) -> TransferHandle:
        """``dst[rows[j]] = src[index[j]]`` for every j (rows of dim 0; ``rows`` None: j) as
        one transfer.

        The default copies runs of consecutive source rows that land in consecutive
        destination rows, one copy per run and per index of the second dimension (a K/V plane:
        contiguous on both sides in the KV tiers' layout), through ``h2d_many``; a backend
        whose copy engine can gather (the CPU emulation) overrides it. ``index`` and ``rows``
        are host values (a CPU tensor is read without a device sync).
        """
        index = index.tolist() if isinstance(index, Tensor) else list(index)
        rows = list(range(len(index))) if rows is None else (
            rows.tolist() if isinstance(rows, Tensor) else list(rows))
        pairs = []
        t = 0
        while t < len(index):
            n = 1
            while (t + n < len(index) and index[t + n] == index[t] + n
                   and rows[t + n] == rows[t] + n):
                n += 1
            i, j = index[t], rows[t]
            pairs += [(dst[j : j + n, k], src[i : i + n, k]) for k in range(src.shape[1])]
            t += n
        return self.h2d_many(pairs, tag, after_compute=after_compute)

    def d2h_many(
        self, pairs: list[tuple[Tensor, Tensor]], tag: object = None, *, after_compute: bool = True
    ) -> TransferHandle:
        """Several device-to-host copies as one transfer (see ``h2d_many``)."""
        return MultiHandle(tag, [self.d2h(d, s, tag, after_compute=after_compute)
                                 for d, s in pairs])

    # -- memory ---------------------------------------------------------------------------------
    @abstractmethod
    def alloc_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """Uninitialised host tensor suitable for fast copies (pinned on CUDA)."""

    @abstractmethod
    def alloc_device(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """Uninitialised tensor in device memory."""

    # -- compute hand-offs ----------------------------------------------------------------------
    def queries_to_host(self, q: Tensor) -> tuple[Tensor, Callable[[], None]]:
        """Query rows for a host worker: fp32 on the host, and what the worker calls before it
        reads them (on a GPU the copy is queued on the compute stream without blocking it)."""
        return q.detach().float(), lambda: None

    def results_from_host(self, t: Tensor) -> Tensor:
        """A host worker's result, ready to go back to the device without blocking (pinned
        on a GPU)."""
        return t

    def to_device_async(self, t: Tensor, device: torch.device) -> Tensor:
        """A host tensor on the device, without making the host wait."""
        return t.to(device, non_blocking=True)

    @contextmanager
    def draft_stream(self) -> Iterator[object]:
        """Where draft work is queued while verification runs (CUDA: the low-priority draft
        stream; here: the caller's own)."""
        yield None

    def join(self, stream: object) -> None:  # noqa: B027
        """Make the caller's stream wait for work queued on ``stream`` (no host sync)."""

    # -- lifecycle ------------------------------------------------------------------------------
    @abstractmethod
    def synchronize(self) -> None:
        """Block until every copy submitted so far has finished (failures stay in the handles)."""

    @abstractmethod
    def close(self) -> None:
        """Finish queued copies and release workers/streams; safe to call more than once."""

    def __enter__(self) -> TransferBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- stats and tracing ----------------------------------------------------------------------
    def _record(self, start: float, end: float, direction: str, nbytes: int, tag: object) -> None:
        with self._lock:
            self._records.append(TransferRecord(start, end, direction, nbytes, tag))

    def _finished_records(self) -> list[TransferRecord]:
        """Records of finished copies; backends with deferred timing override this."""
        with self._lock:
            return list(self._records)

    def busy_intervals(self) -> list[TransferRecord]:
        """Finished copies as (start, end, direction, nbytes, tag), sorted by start."""
        return sorted(self._finished_records(), key=lambda r: r.start)

    def stats(self) -> dict[str, float]:
        """bytes_h2d, bytes_d2h, num_copies, and busy_s = length of the union of copy intervals."""
        records = self.busy_intervals()
        busy, cur_start, cur_end = 0.0, None, None
        for r in records:  # sorted by start: sweep and merge overlapping intervals
            if cur_end is None or r.start > cur_end:
                if cur_end is not None and cur_start is not None:
                    busy += cur_end - cur_start
                cur_start, cur_end = r.start, r.end
            else:
                cur_end = max(cur_end, r.end)
        if cur_end is not None and cur_start is not None:
            busy += cur_end - cur_start
        return {
            "bytes_h2d": sum(r.nbytes for r in records if r.direction == H2D),
            "bytes_d2h": sum(r.nbytes for r in records if r.direction == D2H),
            "busy_s": busy,
            "num_copies": len(records),
        }

    def reset_stats(self) -> None:
        """Forget all finished-copy records."""
        with self._lock:
            self._records.clear()

    # -- fault injection (tests) ----------------------------------------------------------------
    def inject_failure(self, predicate: Callable[[object], bool]) -> None:
        """Copies submitted from now on whose tag satisfies `predicate` fail with TransferError."""
        with self._lock:
            self._fail_predicates.append(predicate)

    def clear_failures(self) -> None:
        """Remove every injected failure predicate."""
        with self._lock:
            self._fail_predicates.clear()

    def _failing(self, tag: object) -> object | None:
        """The tag an injected failure reports for a copy tagged ``tag``, or None: for a
        BatchTag, the BatchTag of its failing members."""
        if not self._fail_predicates:  # the common case: no lock needed to see an empty list
            return None
        with self._lock:
            predicates = list(self._fail_predicates)
        if isinstance(tag, BatchTag):
            bad = BatchTag(t for t in tag if any(p(t) for p in predicates))
            return bad or None
        return tag if any(p(tag) for p in predicates) else None


BACKENDS: Registry[type[TransferBackend]] = Registry("transfer backend")
_BackendT = TypeVar("_BackendT", bound=type[TransferBackend])


def register_backend(name: str) -> Callable[[_BackendT], _BackendT]:
    """Class decorator: make `make_backend(name)` build this class; returns the class unchanged."""

    def decorate(cls: _BackendT) -> _BackendT:
        cls.name = name
        BACKENDS.register(name)(cls)
        return cls

    return decorate


def available_backends() -> list[str]:
    """Names accepted by `make_backend` (CUDA is listed even on machines without it)."""
    import specstream.backends  # noqa: F401  (importing the package registers the built-ins)

    return BACKENDS.names()


def make_backend(device: str, link_gbps: float | None = None) -> TransferBackend:
    """Build the backend for `device` ("cpu", "cuda", "cuda:1"); `link_gbps` throttles emulation."""
    available_backends()  # registers the built-ins
    return BACKENDS.get(device.split(":", 1)[0])(device, link_gbps)
