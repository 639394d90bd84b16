"""How host history reaches attention in one step: not at all, whole layers, or chunk waves.

Sources hand the round *waves* (``attention/waves.py``): keys ``[W, N, kv, D]`` of some
requests of one query bucket, with the :class:`WaveShape` that says whose they are. The round
attends each wave in one call, whatever the number of requests in it. Per layer the round asks
for the copies in flight (``waves``), in the order they were issued; for each it may let the
drafter use the wait (``done``, ``link_busy_until``), then takes the landed wave (``landed``:
waits for the copy) and hands its staging back (``release``: the next copies are issued into
it).

- ``restore`` (restore.py, the offloading baseline): before a layer attends, that layer's
  whole history of the batch is on the device; the next layer's restore is issued while this
  one computes, so the link never waits on a competent schedule, but attention waits for the
  whole layer.
- ``stream`` (stream.py, SpecStream): for each layer, the j-th chunk of every request of a
  bucket (up to ``wave_requests`` of them) is one *chunk wave*: one batched copy into the
  staging ring, one event, one attention call that serves every query position of every
  request in it. All waves of the step are queued up front, layer-major, through a ring of
  ``staging_buffers`` full waves (``staging_buffers x wave_requests`` chunk regions of
  ``chunk_tokens`` tokens of one layer; a narrower wave takes fewer regions, so more of them
  fly at once); regions are refilled once the attention reading them was queued. Launches
  per step: layers x chunks, not layers x requests x chunks; device memory for history stays
  fixed whatever its length.

Both copy the blocks a request promotes (``SeqWork.promote``: its residency share grew) from
where they landed into the request's new device blocks, layer by layer as they pass: the window
widens without a byte more on the link.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

import torch

from specstream.attention.waves import WaveShape
from specstream.backends.base import BatchTag, TransferError
from specstream.engine.contract import StepPlan
from specstream.kvcache.storage import KVStore
from specstream.registry import Registry

# (bucket, k, v, shape): k, v [W, N, num_kv_heads, head_dim] for the bucket's requests in shape
Wave = tuple[int, torch.Tensor, torch.Tensor, WaveShape]
# (landed, link_busy_until) -> None: work that may run while a wave is still in flight
Gap = Callable[[Callable[[], bool], float], None]
W = TypeVar("W", bound="LayerWave")


class InFlight(ABC):
    """One wave of a layer, issued: its copy may still be crossing the link."""

    @abstractmethod
    def done(self) -> bool:
        """The copy has landed (the round would not wait for it)."""


class LayerWave(Protocol):
    """An issued wave that knows its layer (chunk waves, restore pieces)."""

    layer: int


def in_order(pending: deque[W], layer: int) -> Iterator[W]:
    """The issued waves of ``layer`` at the head of ``pending``, oldest first; the caller
    takes each (``landed`` pops it) before asking for the next."""
    last: W | None = None
    while pending and pending[0].layer == layer:
        assert pending[0] is not last, "take each wave (landed) before the next"
        last = pending[0]
        yield last


SOURCES: Registry[type[HistorySource]] = Registry("history source")


def make_source(name: str, store: KVStore, chunk_tokens: int, staging_buffers: int,
                wave_requests: int = 8) -> HistorySource:
    """The registered source ``name`` (``none`` here; ``restore`` in restore.py, ``stream`` in
    stream.py, imported here so that they register)."""
    from specstream.engine.exec import restore, stream  # noqa: F401

    return SOURCES.get(name)(store, chunk_tokens, staging_buffers, wave_requests)


def _failed_tags(exc: TransferError) -> list[object]:
    """The request tags a failed copy names (a batched copy names those whose rows failed)."""
    return list(exc.tag) if isinstance(exc.tag, BatchTag) else [exc.tag]


class HistorySource(ABC):
    """Yields the host-history waves of one layer in arrival order; a request whose copy failed
    lands in ``failed`` (its rows may hold anything; the request fails after the step)."""

    def __init__(self, store: KVStore, chunk_tokens: int, staging_buffers: int,
                 wave_requests: int = 8) -> None:
        self.store = store
        self.chunk_tokens = chunk_tokens
        self.staging_buffers = staging_buffers
        self.wave_requests = wave_requests
        self.peak_bytes = 0  # device bytes this source held at most
        self.wait_s = 0.0  # time attention sat waiting for copies (summed over steps)
        self.failed: dict[str, str] = {}  # this step: request id -> message
        self.link_bps = 10e9  # the link's estimated rate this step (``begin``)
        # when the link should be done with every copy issued so far (from link_bps)
        self.link_busy_until = 0.0

    def begin(self, plan: StepPlan, buckets: list[list[int]], link_bps: float = 0.0) -> None:
        """Issue what can be issued before the forward pass. ``buckets``: the step's requests
        (indices into ``plan.seqs``) as the round's query buckets; ``link_bps``: the link's
        estimated rate (when copies in flight should land)."""
        self.plan = plan
        self.failed = {}
        self.link_bps = link_bps or self.link_bps
        self.link_busy_until = 0.0
        self.where = {i: (b, p) for b, members in enumerate(buckets)
                      for p, i in enumerate(members)}

    @abstractmethod
    def waves(self, layer: int) -> Iterator[InFlight]:
        """The waves of ``layer``, in the order their copies were issued."""

    @abstractmethod
    def landed(self, wave: InFlight) -> list[Wave]:
        """The wave once its copy has landed (waiting for it if need be), as one part per
        query bucket it serves (a shared chunk may serve several)."""

    def release(self, wave: InFlight) -> None:  # noqa: B027
        """The attention reading ``wave`` is queued: its staging may take the next copies."""

    def drain(self, layer: int) -> Iterator[Wave]:
        """The waves of ``layer`` as they land, nothing done between them (each released once
        the consumer asks for the next)."""
        for wave in self.waves(layer):
            yield from self.landed(wave)
            self.release(wave)

    def end(self, completed: bool = True) -> None:  # noqa: B027
        """Drop per-step buffers. ``completed`` is False where the round failed part way (a
        rank stopped answering, a kernel raised): its waves may be left unconsumed, and copies
        still in flight land before any the next step issues (one ordered queue)."""

    def _fail(self, exc: TransferError) -> None:
        for tag in _failed_tags(exc):
            self.failed.setdefault(str(tag), f"KV restore failed: {exc}")


@SOURCES.register("none")
class NoHistory(HistorySource):
    def waves(self, layer: int) -> Iterator[InFlight]:
        return iter(())

    def landed(self, wave: InFlight) -> list[Wave]:
        raise AssertionError("no history, no waves")
