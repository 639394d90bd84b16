"""Transfer backends: bitwise round trips, priorities, throttling, stats, fault injection."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import pytest
import torch

from specstream.backends import (
    D2H,
    H2D,
    CpuBackend,
    TransferBackend,
    TransferError,
    available_backends,
    limit_compute_threads,
    make_backend,
)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def cpu() -> Iterator[TransferBackend]:
    backend = make_backend("cpu")
    yield backend
    backend.close()


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same storage viewed as integers, so NaN payloads and -0.0 compare exactly."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def special_values(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    flat = x.view(-1)
    flat[:4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0], dtype=dtype)
    return x


def test_registry_and_errors() -> None:
    assert {"cpu", "cuda"} <= set(available_backends())
    backend = make_backend("cpu")
    assert isinstance(backend, CpuBackend) and backend.name == "cpu"
    backend.close()
    with pytest.raises(ValueError, match="unknown transfer backend"):
        make_backend("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            make_backend("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bitwise(cpu: TransferBackend, dtype: torch.dtype) -> None:
    host = cpu.alloc_host((64, 8, 32), dtype)
    host.copy_(special_values((64, 8, 32), dtype))
    dev = cpu.alloc_device((64, 8, 32), dtype)
    back = cpu.alloc_host((64, 8, 32), dtype)
    cpu.h2d(dev, host, tag="up").wait()
    cpu.d2h(back, dev, tag="down").wait()
    assert torch.equal(bits(back), bits(host))


class LinkClock:
    """A fake clock for the emulated link. ``sleep`` moves ``now`` on by what was asked plus
    ``late_s`` (a copy thread that wakes late); while ``gate`` is clear, ``sleep`` blocks, which
    holds the copy worker on the link so that the test can queue copies behind it."""

    def __init__(self, late_s: float = 0.0) -> None:
        self.now = 100.0
        self.late_s = late_s
        self.gate = threading.Event()
        self.gate.set()

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.gate.wait()
        self.now += seconds + self.late_s


@contextmanager
def fake_link(gbps: float, late_s: float = 0.0,
              held: bool = False) -> Iterator[tuple[CpuBackend, LinkClock]]:
    """A CPU backend paced at ``gbps`` on a fake clock; ``held``: the first copy stays on the
    link until the test sets ``clock.gate``."""
    clock = LinkClock(late_s)
    if held:
        clock.gate.clear()
    backend = CpuBackend(link_gbps=gbps, now=clock.perf_counter, sleep=clock.sleep)
    try:
        yield backend, clock
    finally:
        clock.gate.set()
        backend.close()


def test_h2d_overtakes_queued_d2h() -> None:
    with fake_link(0.01, held=True) as (backend, clock):
        blocker = backend.h2d(torch.empty(1 << 20), torch.ones(1 << 20), tag="blocker")
        small = [torch.ones(16) for _ in range(5)]
        backend.d2h(torch.empty(16), small[0], tag="d0")
        backend.d2h(torch.empty(16), small[1], tag="d1")
        backend.d2h(torch.empty(16), small[2], tag="d2")
        backend.h2d(torch.empty(16), small[3], tag="h0")
        backend.h2d(torch.empty(16), small[4], tag="h1")
        assert not blocker.done()  # everything above was queued while the link was busy
        clock.gate.set()
        backend.synchronize()
        order = [r.tag for r in backend.busy_intervals()]
        assert order == ["blocker", "h0", "h1", "d0", "d1", "d2"]


def test_throttle_paces_copies_at_link_gbps() -> None:
    """Each copy holds the link for nbytes / link_gbps, one after another, and its waiter sees
    it only once it has landed."""
    gbps, nbytes = 0.1, 4 << 20
    per_copy = nbytes / (gbps * 1e9)  # 42 ms
    with fake_link(gbps) as (backend, clock):
        src = torch.ones(nbytes // 4)
        t0 = clock.now
        dsts = [torch.empty_like(src) for _ in range(3)]
        handles = [backend.h2d(d, src, tag=i) for i, d in enumerate(dsts)]
        landed = []
        for h in handles:
            h.wait()
            landed.append(clock.now)
        records = backend.busy_intervals()
        assert [r.tag for r in records] == [0, 1, 2]
        for i, r in enumerate(records):
            assert r.start == pytest.approx(t0 + i * per_copy)
            assert r.end == pytest.approx(t0 + (i + 1) * per_copy)
            assert landed[i] >= r.end
        assert clock.now == pytest.approx(t0 + 3 * per_copy)  # no more time than the link's
        assert backend.stats()["busy_s"] == pytest.approx(3 * per_copy)
        assert all(torch.equal(d, src) for d in dsts)


def test_link_clock_keeps_queued_copies_back_to_back() -> None:
    """Copies queued behind a busy link start when the previous one lands on the link clock,
    however late the copy thread wakes (here: 2.5 copy times late at every wake-up); a copy
    queued on an idle link starts when it is queued, and the idle time is not busy time."""
    gbps, nbytes = 1.0, 1 << 20
    per_copy = nbytes / (gbps * 1e9)  # ~1 ms
    with fake_link(gbps, late_s=2.5 * per_copy, held=True) as (backend, clock):
        src = torch.ones(nbytes // 4)
        t0 = clock.now
        handles = [backend.h2d(torch.empty_like(src), src, tag=i) for i in range(6)]
        clock.gate.set()  # all six queued while the first one held the link
        for h in handles:
            h.wait()
        records = backend.busy_intervals()
        assert records[0].start == t0
        for a, b in zip(records[:5], records[1:6]):
            assert b.start == a.end
            assert b.end - b.start == pytest.approx(per_copy)
        assert clock.now > records[5].end  # the worker did wake late
        clock.now += 0.02  # the link goes idle
        t1 = clock.now
        backend.h2d(torch.empty_like(src), src, tag="late").wait()
        records = backend.busy_intervals()
        assert records[6].start == t1 > records[5].end
        assert backend.stats()["busy_s"] == pytest.approx(7 * per_copy)


def test_stats_count_bytes(cpu: TransferBackend) -> None:
    a, b = torch.ones(100), torch.ones(10, dtype=torch.bfloat16)
    cpu.h2d(torch.empty(100), a).wait()
    cpu.h2d(torch.empty(10, dtype=torch.bfloat16), b).wait()
    cpu.d2h(torch.empty(100), a).wait()
    s = cpu.stats()
    assert (s["bytes_h2d"], s["bytes_d2h"], s["num_copies"]) == (420, 400, 3)
    assert s["busy_s"] > 0
    records = cpu.busy_intervals()
    assert [r.direction for r in records] == [H2D, H2D, D2H]
    assert all(r.start <= r.end for r in records)
    cpu.reset_stats()
    assert cpu.stats() == {"bytes_h2d": 0, "bytes_d2h": 0, "busy_s": 0.0, "num_copies": 0}


def test_failure_injection_fails_only_tagged_copies(cpu: TransferBackend) -> None:
    cpu.inject_failure(lambda tag: tag == ("req", 7))
    src = torch.arange(8.0)
    dsts = [torch.zeros(8) for _ in range(4)]
    tags = [("req", 1), ("req", 7), ("req", 2), ("req", 7)]
    handles = [cpu.h2d(d, src, tag=t) for d, t in zip(dsts, tags, strict=True)]
    for d, t, h in zip(dsts, tags, handles, strict=True):
        if t == ("req", 7):
            with pytest.raises(TransferError, match=r"\('req', 7\)") as info:
                h.wait()
            assert info.value.tag == t and h.done()
            assert torch.equal(d, torch.zeros(8))  # the failed copy wrote nothing
        else:
            h.wait()
            assert torch.equal(d, src)
    cpu.clear_failures()
    later = torch.zeros(8)
    cpu.h2d(later, src, tag=("req", 7)).wait()  # the worker survived
    assert torch.equal(later, src)
    assert cpu.stats()["num_copies"] == 3


def test_real_copy_error_becomes_transfer_error(cpu: TransferBackend) -> None:
    handle = cpu.h2d(torch.empty(3), torch.ones(5), tag="bad-shape")
    with pytest.raises(TransferError, match="bad-shape"):
        handle.wait()
    ok = torch.empty(5)
    cpu.h2d(ok, torch.ones(5)).wait()
    assert torch.equal(ok, torch.ones(5))


def test_close_drains_and_is_idempotent() -> None:
    backend = make_backend("cpu", link_gbps=0.1)
    dst = torch.empty(1 << 18)
    handle = backend.h2d(dst, torch.ones(1 << 18), tag="last")
    backend.close()
    assert handle.done() and torch.equal(dst, torch.ones(1 << 18))
    backend.close()
    with pytest.raises(RuntimeError, match="closed"):
        backend.h2d(dst, dst)


def test_limit_compute_threads_restores() -> None:
    previous = limit_compute_threads()
    try:
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)


@pytest.mark.cuda
@CUDA
def test_cuda_round_trip_stats_and_failures() -> None:
    backend = make_backend("cuda")
    try:
        host = backend.alloc_host((256, 8, 128), torch.bfloat16)
        assert host.is_pinned()
        host.copy_(special_values((256, 8, 128), torch.bfloat16))
        dev = backend.alloc_device((256, 8, 128), torch.bfloat16)
        back = backend.alloc_host((256, 8, 128), torch.bfloat16)
        backend.h2d(dev, host, tag="up").wait()  # orders the current stream, no host sync
        dev.mul_(1)  # compute on the current stream after the copy
        backend.d2h(back, dev, tag="down").host_wait()
        assert torch.equal(bits(back), bits(host))
        s = backend.stats()
        assert s["bytes_h2d"] == s["bytes_d2h"] == host.numel() * 2 and s["num_copies"] == 2
        backend.inject_failure(lambda tag: tag == "boom")
        with pytest.raises(TransferError, match="boom"):
            backend.h2d(dev, host, tag="boom").host_wait()
        backend.h2d(dev, host, tag="fine").host_wait()
    finally:
        backend.close()
        backend.close()


def test_h2d_gather_matches_indexing_and_the_per_row_default(cpu: TransferBackend) -> None:
    """The CPU gather (one index_select into a transposed view) and the base class's per-row
    copies give the same bytes as plain indexing."""
    table = torch.randn(10, 2, 4, 3)
    index = [7, 2, 2, 9]
    want = table[index]
    for gather in (cpu.h2d_gather, partial(TransferBackend.h2d_gather, cpu)):
        dst = torch.zeros(2, 6, 4, 3)  # [2, rows, ...] as a staging buffer; rows 4.. untouched
        gather(dst.transpose(0, 1), table, index, "g").wait()
        assert torch.equal(dst.transpose(0, 1)[:4], want)
        assert torch.equal(dst[:, 4:], torch.zeros(2, 2, 4, 3))


def test_h2d_gather_into_chosen_rows_coalesces_runs(cpu: TransferBackend) -> None:
    """A chunk wave: host rows into chosen staging rows (``rows=``). The CPU gather and the base
    class's copies (one per run of consecutive rows and per plane: 3 runs x 2 planes here) give
    the bytes plain indexing gives, and rows not named stay untouched."""
    table = torch.randn(12, 2, 4, 3)
    index, rows = [3, 4, 5, 9, 10, 0], [0, 1, 2, 4, 5, 6]
    counted: list[int] = []
    real_many = cpu.h2d_many

    def many(pairs, tag=None, *, after_compute=True):  # type: ignore[no-untyped-def]
        counted.append(len(pairs))
        return real_many(pairs, tag, after_compute=after_compute)

    for gather in (cpu.h2d_gather, partial(TransferBackend.h2d_gather, cpu)):
        dst = torch.zeros(2, 8, 4, 3)
        cpu.h2d_many = many  # type: ignore[method-assign]
        gather(dst.transpose(0, 1), table, torch.tensor(index), "w",
               rows=torch.tensor(rows)).wait()
        cpu.h2d_many = real_many  # type: ignore[method-assign]
        view = dst.transpose(0, 1)
        assert torch.equal(view[rows], table[index])
        assert torch.equal(view[[3, 7]], torch.zeros(2, 2, 4, 3))
    assert counted == [6]  # only the base class goes through h2d_many: 3 runs x 2 planes
