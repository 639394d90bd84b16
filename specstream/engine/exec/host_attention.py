"""Attention over cold history on the host CPU, beside the link (``host_attention``).

A link-bound round spends its time moving history the device reads once; the host can read it
where it lives. For the requests of a step with ``SeqWork.host_blocks`` (the oldest of their
cold blocks, which then do not cross the link), each layer's query rows go to the host right
after the layer's projection; worker threads compute the partial attention of those rows over
those blocks, straight from the host tier (``KVStore.host``, no copy), as output and
log-sum-exp per query row; the round merges them into the same online softmax as the streamed
waves and the resident tail (``WaveAttention.add_partial``), exactly.

The scheduler decides the split (``sched/host_split.py``): a fixed share of every request's
cold chunks (``host_attention_fraction``), or under ``host_attention="auto"`` the split that
lets the host and the link finish together, from the link rate and what this worker measures
(``since_last``, fed to ``policy/feedback.py``): each job's time per byte of KV against its
query positions per request (a decode round's few positions read memory, a prefill chunk's
hundreds compute), and the device time of a round during which the host can have nothing to
do (``serial_s``: a layer's queries come only after its projection, and the layer's MLP
waits for the host's partials; the round's two halves hide most of it).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from torch import Tensor

from specstream.attention.host_kernel import blocks_read, host_partial
from specstream.kvcache.storage import KVStore

# one job: (query positions per request, seconds, KV bytes)
HostJob = tuple[int, float, int]


def default_threads() -> int:
    """The cores the engine's compute and copy threads leave (at least one)."""
    return max(1, (os.cpu_count() or 1) - 2)


class HostAttention:
    def __init__(self, store: KVStore, threads: int | None = None,
                 emulate_gbps: float | None = None) -> None:
        assert store.host is not None, "host attention needs a host tier"
        self.store = store
        # host_attention_gbps: the workers together attend at most this many bytes/s (a job
        # ends no sooner than its bytes at this rate after the host is free for it)
        self.emulate_bps = emulate_gbps * 1e9 if emulate_gbps else 0.0
        self._free_at = 0.0
        self.pool = ThreadPoolExecutor(threads or default_threads(),
                                       thread_name_prefix="host-attention")
        self._lock = threading.Lock()
        self.bytes = 0  # KV bytes attended on the host, since start
        self.busy_s = 0.0  # worker time spent on them
        self.wait_s = 0.0  # time the round waited for the host's partials (``collect``)
        self._jobs: list[HostJob] = []  # finished since the last ``since_last``
        # device time of rounds with host work while the host had none to do because the
        # device had not sent it yet: from the round's start, or from the partials the round
        # last collected (whichever the host was idle since), to the next queries, while no
        # job is pending (begin_round / submit / collect / end_round, the compute thread's)
        self.serial_s = 0.0
        self._mark: float | None = None
        self._pending = 0  # jobs submitted and not finished
        self._idle_since = 0.0  # when the last pending job finished
        self._last = (0.0, 0.0, 0.0)  # busy_s, wait_s, serial_s at the last ``since_last``

    @property
    def rate(self) -> float:
        """Host attention bytes/s measured so far (0: nothing measured)."""
        return self.bytes / self.busy_s if self.busy_s else 0.0

    def since_last(self) -> tuple[float, float, float, tuple[HostJob, ...]]:
        """Busy, wait and serial seconds and the finished jobs since the last call (one
        step's, called per step)."""
        now = (self.busy_s, self.wait_s, self.serial_s)
        delta = tuple(a - b for a, b in zip(now, self._last, strict=True))
        self._last = now
        with self._lock:
            jobs, self._jobs = tuple(self._jobs), []
        return delta[0], delta[1], delta[2], jobs

    def begin_round(self) -> None:
        self._mark = time.perf_counter()

    def end_round(self) -> None:
        self._idle_until(time.perf_counter())
        self._mark = None

    def _idle_until(self, now: float) -> None:
        """Count the host's wait for the device up to ``now``, if it has no job."""
        with self._lock:
            if self._mark is not None and not self._pending:
                self.serial_s += max(0.0, now - max(self._mark, self._idle_since))

    def submit(self, layer: int, q: Tensor, blocks: list[tuple[int, ...]],
               scale: float) -> Future[tuple[Tensor, Tensor]]:
        """Partial attention of ``q`` (``[W, P, H, D]``, one request per row, any device) over
        each request's host ``blocks`` of ``layer``: a future of (out ``[W, P, H, D]``, lse
        ``[W, P, H]``), fp32 on the host, ready to go back without blocking. The queries come
        down without blocking the device (``backend.queries_to_host``); the worker waits for
        them, not the caller."""
        self._idle_until(time.perf_counter())
        with self._lock:
            self._pending += 1
        q_host, ready = self.store.backend.queries_to_host(q)
        return self.pool.submit(self._run, layer, q_host, blocks, scale, ready)

    def collect(self, job: Future[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """A submitted job's partials, once done (the wait is counted in ``wait_s``)."""
        t0 = time.perf_counter()
        out = job.result()
        self._mark = time.perf_counter()
        self.wait_s += self._mark - t0
        return out

    def _run(self, layer: int, q: Tensor, blocks: list[tuple[int, ...]], scale: float,
             ready: Callable[[], None]) -> tuple[Tensor, Tensor]:
        ready()  # the queries have landed (this thread waits, not the round)
        t0 = time.perf_counter()
        try:
            host = self.store.host
            assert host is not None
            out, lse = host_partial(host, layer, q, blocks, self.store.block_size, scale)
            # K and V of every block attended, at the host tier's element size
            # (a prefix several requests share is read once)
            nbytes = 2 * blocks_read(blocks) * host[0, 0, 0].numel() * host.element_size()
            if self.emulate_bps:
                with self._lock:
                    self._free_at = max(self._free_at, t0) + nbytes / self.emulate_bps
                    until = self._free_at
                time.sleep(max(0.0, until - time.perf_counter()))
        finally:
            busy = time.perf_counter() - t0
            with self._lock:
                self._pending -= 1
                if not self._pending:
                    self._idle_since = t0 + busy
        with self._lock:
            self.bytes += nbytes
            self.busy_s += busy
            self._jobs.append((q.shape[1], busy, nbytes))
        # back to the device without blocking the compute thread
        backend = self.store.backend
        return backend.results_from_host(out), backend.results_from_host(lse)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
