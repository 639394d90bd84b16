"""``stream`` (SpecStream): chunk waves through a staging ring (see history.py for the waves'
life: issued, landed, released)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specstream.attention.waves import WaveShape
from specstream.backends.base import BatchTag, TransferError, TransferHandle, to_device
from specstream.engine.contract import StepPlan
from specstream.engine.exec.history import SOURCES, HistorySource, InFlight, Wave, in_order
from specstream.kvcache.storage import KVStore


@dataclass
class _WaveCopy:
    """One chunk wave's copy, the same for every layer: which host blocks go where."""

    index: torch.Tensor  # [n] host blocks, region after region
    rows: torch.Tensor | None  # [n] slot rows they land in (None: 0 .. n-1)
    # per query bucket it serves: the bucket, its requests' shape, and the region of each of
    # them ([W]; None: one region each, in order)
    parts: list[tuple[int, WaveShape, torch.Tensor | None]]
    tag: BatchTag  # every request the wave serves
    num_regions: int  # staging regions: one per distinct chunk
    num_blocks: int  # the longest chunk of the wave: its keys are num_blocks x block_size
    # promoted blocks in the wave: their rows in the wave's regions, and their device blocks
    promote_rows: torch.Tensor | None = None
    promote_dst: torch.Tensor | None = None


@dataclass
class _Copy(InFlight):
    """A chunk wave issued into the staging ring: its layer, what it copies, where."""

    layer: int
    copy: _WaveCopy
    first: int  # its first staging region
    handle: TransferHandle

    def done(self) -> bool:
        return self.handle.done()


@SOURCES.register("stream")
class ChunkStream(HistorySource):
    """All chunk waves of the step, layer-major, through a ring of wave-sized staging slots."""

    def __init__(self, store: KVStore, chunk_tokens: int, staging_buffers: int,
                 wave_requests: int = 8) -> None:
        super().__init__(store, chunk_tokens, staging_buffers, wave_requests)
        cfg = store.cfg
        self.chunk_blocks = chunk_tokens // store.block_size
        # The ring holds staging_buffers x wave_requests chunk regions; a wave of w requests
        # takes w consecutive ones, so narrow waves (a lone prefill chunk, a small bucket) keep
        # as many chunks in flight as wide ones keep bytes.
        self.num_regions = staging_buffers * wave_requests
        shape = (2, self.num_regions * self.chunk_blocks, store.block_size, cfg.num_kv_heads,
                 cfg.head_dim)
        # zeroed: a ragged wave leaves rows of a region unwritten (masked, so finite is enough)
        self.ring = store.backend.alloc_device(shape, store.dtype).zero_()
        self.ring_rows = self.ring.transpose(0, 1)  # as rows of blocks
        self.ring_bytes = staging_buffers * wave_requests * chunk_tokens * store.layer_token_bytes
        self.block_layer_bytes = store.block_size * store.layer_token_bytes

    def _plan_waves(self, plan: StepPlan, buckets: list[list[int]], layer: int
                    ) -> list[_WaveCopy]:
        """The layer's chunk waves: the j-th chunks of a bucket's requests, up to
        ``wave_requests`` distinct chunks a wave. Requests whose j-th chunk is the same blocks
        (a shared prefix) share its region: it is copied once and all of them attend it,
        across buckets too (those waves come first); so does a chunk that starts another's
        blocks (a sharer whose device window begins inside the shared run attends fewer of
        them)."""
        cb = self.chunk_blocks
        chunks_of = [s.layer_chunks(layer, cb) for s in plan.seqs]
        depth = max((len(c) for c in chunks_of), default=0)
        copies: list[_WaveCopy] = []
        served: set[tuple[int, int]] = set()  # (request, j) a cross-bucket wave serves

        def pack(j: int, holders: dict[tuple[int, ...], list[tuple[int, int]]]) -> None:
            unique = list(holders.items())
            for w0 in range(0, len(unique), self.wave_requests):
                copies.append(self._wave(plan, buckets, chunks_of, j,
                                         unique[w0 : w0 + self.wave_requests]))

        for j in range(depth):  # chunks that requests of several buckets share
            holders: dict[tuple[int, ...], list[tuple[int, int]]] = {}
            for b, members in enumerate(buckets):
                for p, i in enumerate(members):
                    if len(chunks_of[i]) > j:
                        holders.setdefault(chunks_of[i][j], []).append((b, p))
            holders = _by_prefix(holders)
            cross = {c: h for c, h in holders.items() if len({b for b, _ in h}) > 1}
            served.update((buckets[b][p], j) for h in cross.values() for b, p in h)
            pack(j, cross)
        for b, members in enumerate(buckets):
            for j in range(max((len(chunks_of[i]) for i in members), default=0)):
                holders = {}
                for p, i in enumerate(members):
                    if len(chunks_of[i]) > j and (i, j) not in served:
                        holders.setdefault(chunks_of[i][j], []).append((b, p))
                pack(j, _by_prefix(holders))
        return copies

    def _wave(self, plan: StepPlan, buckets: list[list[int]],
              chunks_of: list[tuple[tuple[int, ...], ...]], j: int,
              unique: list[tuple[tuple[int, ...], list[tuple[int, int]]]]) -> _WaveCopy:
        """The wave of the distinct j-th chunks ``unique``: (chunk, the (bucket, position)
        of each request whose j-th chunk it is), one region per chunk, one part per bucket."""
        cb, bs, device = self.chunk_blocks, self.store.block_size, self.store.device.device
        chunks = [c for c, _ in unique]
        region_of = {bp: u for u, (_, holders) in enumerate(unique) for bp in holders}
        lens = [len(c) for c in chunks]
        ragged = any(n != cb for n in lens)
        rows = [u * cb + t for u, n in enumerate(lens) for t in range(n)] if ragged else None
        p_rows, p_dst, parts = [], [], []
        for b in sorted({b for b, _ in region_of}):
            members = buckets[b]
            part = sorted(p for bb, p in region_of if bb == b)
            for p in part:  # promoted blocks: the request's newest
                s, u = plan.seqs[members[p]], region_of[b, p]
                if not s.promote:
                    continue
                mine = chunks_of[members[p]]
                lo = sum(map(len, mine)) - len(s.promote)
                start = sum(map(len, mine[:j]))  # chunks may be short before the last
                for t in range(max(0, lo - start), len(mine[j])):
                    p_rows.append(u * cb + t)
                    p_dst.append(s.promote[start + t - lo])
            regions = [region_of[b, p] for p in part]
            # keys up to the longest chunk only: a last chunk shorter than the region is not
            # padded (padding costs attention time and a mask)
            shape = WaveShape.build(None if part == list(range(len(members))) else part,
                                    [len(chunks_of[members[p]][j]) * bs for p in part],
                                    max(lens) * bs, None, device)
            same = regions == list(range(len(chunks)))
            parts.append((b, shape, None if same else to_device(regions, torch.long, device)))
        return _WaveCopy(
            torch.tensor([x for c in chunks for x in c], dtype=torch.long),
            None if rows is None else torch.tensor(rows, dtype=torch.long), parts,
            BatchTag(plan.seqs[buckets[b][p]].request_id for b, p in sorted(region_of)),
            len(chunks), max(lens),
            to_device(p_rows, torch.long, device) if p_rows else None,
            to_device(p_dst, torch.long, device) if p_dst else None)

    def begin(self, plan: StepPlan, buckets: list[list[int]], link_bps: float = 0.0) -> None:
        super().begin(plan, buckets, link_bps)
        # layers with the same split (host_layers) share one plan of waves
        plans: dict[tuple[int, ...], list[_WaveCopy]] = {}
        self.jobs: deque[tuple[int, _WaveCopy]] = deque()
        for layer in range(self.store.cfg.num_layers):
            key = tuple(s.host_layers[layer] if s.host_layers else -1 for s in plan.seqs)
            if key not in plans:
                plans[key] = self._plan_waves(plan, buckets, layer)
            self.jobs.extend((layer, c) for c in plans[key])
        self.pending: deque[_Copy] = deque()  # issued, not consumed, in order
        self.in_use: deque[tuple[int, int]] = deque()  # (first region, regions), issue order
        self.head = 0  # where the next wave's regions start, if free
        if self.jobs:
            self.peak_bytes = self.ring_bytes
        self._fill()

    def _regions(self, count: int) -> int | None:
        """The first of ``count`` free consecutive regions at the ring's head (from region 0
        when the end is too short), or None while a wave still in flight holds them."""
        start = self.head if self.head + count <= self.num_regions else 0
        if any(s < start + count and start < s + n for s, n in self.in_use):
            return None
        return start

    def _fill(self) -> None:
        cb = self.chunk_blocks
        while self.jobs:
            layer, copy = self.jobs[0]
            first = self._regions(copy.num_regions)
            if first is None:
                return
            self.jobs.popleft()
            self.in_use.append((first, copy.num_regions))
            self.head = first + copy.num_regions
            dst = self.ring_rows[first * cb : self.head * cb]
            handle = self.store.restore_rows(layer, copy.index, dst, copy.tag, copy.rows)
            # when the link should be done with everything issued (from the rate estimate)
            start = max(time.perf_counter(), self.link_busy_until)
            nbytes = copy.index.numel() * self.block_layer_bytes
            self.link_busy_until = start + nbytes / self.link_bps
            self.pending.append(_Copy(layer, copy, first, handle))

    def waves(self, layer: int) -> Iterator[InFlight]:
        return in_order(self.pending, layer)

    def landed(self, wave: InFlight) -> list[Wave]:
        assert isinstance(wave, _Copy) and wave is self.pending[0], "waves land in order"
        self.pending.popleft()
        t0 = time.perf_counter()
        try:
            wave.handle.wait()
        except TransferError as exc:
            self._fail(exc)
        self.wait_s += time.perf_counter() - t0
        copy, cfg = wave.copy, self.store.cfg
        w, cb = copy.num_regions, self.chunk_blocks
        buf = self.ring[:, wave.first * cb : (wave.first + w) * cb]  # [2, w * cb, bs, kv, D]
        if copy.promote_dst is not None and copy.promote_rows is not None:
            # queued before the regions are refilled (``release``)
            self.store.device[wave.layer].index_copy_(
                1, copy.promote_dst, buf.index_select(1, copy.promote_rows))
        kv = buf.reshape(2, w, cb * self.store.block_size, cfg.num_kv_heads, cfg.head_dim)
        kv = kv[:, :, : copy.num_blocks * self.store.block_size]
        out = []
        for bucket, shape, regions in copy.parts:  # a shared chunk: one copy for every sharer
            part = kv if regions is None else kv.index_select(1, regions)
            out.append((bucket, part[0], part[1], shape))
        return out

    def release(self, wave: InFlight) -> None:
        self.in_use.popleft()  # regions are handed back in issue order
        self._fill()

    def end(self, completed: bool = True) -> None:
        assert not completed or not (self.pending or self.jobs), "stream left waves unconsumed"
        self.pending.clear()
        self.jobs.clear()
        self.in_use.clear()


def _by_prefix(holders: dict[tuple[int, ...], list[tuple[int, int]]]
               ) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """Chunks (and who reads them) with every chunk that starts another one folded into the
    longer: its readers attend the region's first blocks only. Unchanged, in order, where no
    chunk starts another (no sharing)."""
    into: dict[tuple[int, ...], tuple[int, ...]] = {}
    kept: list[tuple[int, ...]] = []
    for chunk in sorted(holders, key=len, reverse=True):
        big = next((k for k in kept if k[: len(chunk)] == chunk), None)
        if big is None:
            kept.append(chunk)
        into[chunk] = big or chunk
    if len(kept) == len(holders):
        return holders
    out: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for chunk, readers in holders.items():
        out.setdefault(into[chunk], []).extend(readers)
    return out
