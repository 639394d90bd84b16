"""CUDA transfer backend: ordering without host syncs, pinned memory, streams, stats.

The CPU-side tests check the contract the CUDA backend relies on (every refill of a staging
buffer is issued with `after_compute=True` after the attention reading it was queued); the
tests marked `cuda` run only where a GPU is present.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from specstream.backends import CpuBackend, CudaBackend, TransferError, make_backend
from specstream.backends.base import TransferHandle
from specstream.engine.contract import SeqWork
from specstream.engine.exec.restore import LayerRestore
from specstream.engine.exec.stream import ChunkStream
from specstream.kvcache.storage import KVStore
from specstream.models.config import ModelConfig

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


class RecordingBackend(CpuBackend):
    """CPU backend that logs each h2d copy (each gathered row) as ("copy", destination address,
    after_compute)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.log: list[tuple[str, int, bool]] = []

    def h2d(
        self, dst: torch.Tensor, src: torch.Tensor, tag: object = None, *,
        after_compute: bool = True,
    ) -> TransferHandle:  # fmt: skip
        self.log.append(("copy", dst.data_ptr(), after_compute))
        return super().h2d(dst, src, tag, after_compute=after_compute)

    def h2d_many(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], tag: object = None, *,
        after_compute: bool = True,
    ) -> TransferHandle:  # fmt: skip
        self.log.extend(("copy", dst.data_ptr(), after_compute) for dst, _ in pairs)
        return super().h2d_many(pairs, tag, after_compute=after_compute)

    def h2d_gather(
        self, dst: torch.Tensor, src: torch.Tensor, index: list[int] | torch.Tensor,
        tag: object = None, *, rows: list[int] | torch.Tensor | None = None,
        after_compute: bool = True,
    ) -> TransferHandle:  # fmt: skip
        at = range(len(index)) if rows is None else [int(r) for r in rows]
        self.log.extend(("copy", dst[j].data_ptr(), after_compute) for j in at)
        return super().h2d_gather(dst, src, index, tag, rows=rows, after_compute=after_compute)


def tiny_store(backend: CpuBackend, num_layers: int = 3) -> KVStore:
    cfg = ModelConfig(family="qwen3", vocab_size=16, hidden_size=16, num_layers=num_layers,
                      num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                      max_position_embeddings=256)
    store = KVStore(cfg, torch.float32, 4, num_device_blocks=2, num_host_blocks=12,
                    backend=backend)
    assert store.host is not None
    store.host.copy_(torch.randn(store.host.shape))
    return store


def plan(*chunks_per_seq: tuple[tuple[int, ...], ...]) -> SimpleNamespace:
    seqs = [SeqWork(request_id=str(i), token_ids=(0,), start_pos=0, num_drafts=0,
                    prefill=False, sample=True, host_tokens=4 * sum(len(x) for x in c),
                    device_blocks=(), restore_chunks=c)
            for i, c in enumerate(chunks_per_seq)]
    # whole-layer restores hold two layers of history in pool blocks lent to the step
    return SimpleNamespace(seqs=seqs, restore_blocks=(0, 1))


@pytest.fixture
def recording() -> Iterator[RecordingBackend]:
    backend = RecordingBackend()
    yield backend
    backend.close()


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_chunk_stream_refills_a_region_only_after_its_attention(
    recording: RecordingBackend, buffers: int
) -> None:
    """Every copy into a chunk region of the staging ring comes after the attention that read
    the wave there before (queued), and the copies of one wave come in one run; narrow waves
    (one request) take one region each, wide ones two."""
    store = tiny_store(recording)
    source = ChunkStream(store, chunk_tokens=8, staging_buffers=buffers, wave_requests=2)
    base = source.ring.data_ptr()
    region_bytes = source.ring[0, :2].numel() * source.ring.element_size()  # 2 blocks a chunk
    region = lambda ptr: (ptr - base) // region_bytes  # noqa: E731  (K plane pointers)
    source.begin(plan(((0, 1), (2, 3), (4,)), ((5, 6),)), [[0, 1]])  # type: ignore[arg-type]
    for layer in range(store.cfg.num_layers):
        for _, k, _, _ in source.drain(layer):
            for w in range(k.shape[0]):  # the attention queued on every region it reads
                recording.log.append(("attend", k[w].data_ptr(), True))
    source.end()
    assert all(after for kind, _, after in recording.log if kind == "copy")
    state = ["free"] * (2 * buffers)  # per region: free -> filling -> read -> filling ...
    previous: tuple[str, int] = ("", -1)
    for kind, ptr, _ in recording.log:
        r = region(ptr)
        if kind == "copy":
            assert state[r] != "filling" or previous == ("copy", r), "refilled before read"
            state[r] = "filling"
        else:
            assert state[r] == "filling"
            state[r] = "read"
        previous = (kind, r)
    # chunk 0 of both requests is one wave (two regions); chunks 1 and 2 of the first one each
    num_reads = 4 * store.cfg.num_layers
    assert sum(kind == "attend" for kind, _, _ in recording.log) == num_reads


def test_layer_restore_orders_every_copy_after_compute(recording: RecordingBackend) -> None:
    store = tiny_store(recording)
    source = LayerRestore(store, chunk_tokens=8, staging_buffers=2)
    source.begin(plan(((0, 1),), ((2,),)), [[0, 1]])  # type: ignore[arg-type]
    for layer in range(store.cfg.num_layers):
        keys = [0, 0]
        for _, k, _, shape in source.drain(layer):
            keys[int(shape.index[0])] += k.shape[1]
        assert keys == [8, 4]
    source.end()
    assert recording.log and all(after for _, _, after in recording.log)


def test_cuda_backend_needs_cuda() -> None:
    if CUDA:
        pytest.skip("CUDA is available")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        make_backend("cuda")


@pytest.fixture
def cuda_backend() -> Iterator[CudaBackend]:
    backend = make_backend("cuda")
    assert isinstance(backend, CudaBackend)
    yield backend
    backend.close()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pinned_round_trip_is_bitwise(cuda_backend: CudaBackend, dtype: torch.dtype) -> None:
    backend = cuda_backend
    host = backend.alloc_host((256, 64), dtype)
    assert host.is_pinned()
    host.copy_(torch.randn(256, 64).to(dtype))
    dev = backend.alloc_device((256, 64), dtype)
    backend.h2d(dev, host, "r").wait()  # orders the current stream, no host sync
    back = backend.alloc_host((256, 64), dtype)
    backend.d2h(back, dev * 1, "w").host_wait()
    assert torch.equal(back, host)
    stats = backend.stats()
    assert stats["bytes_h2d"] == stats["bytes_d2h"] == host.numel() * host.element_size()
    assert stats["busy_s"] > 0 and stats["num_copies"] == 2


@pytest.mark.cuda
@needs_cuda
def test_refill_waits_for_queued_compute(cuda_backend: CudaBackend) -> None:
    """A refill issued right after a (slow) read was queued must not overwrite what it reads."""
    backend = cuda_backend
    staging = backend.alloc_device((1 << 20,), torch.float32)
    staging.fill_(1.0)
    fresh = backend.alloc_host((1 << 20,), torch.float32)
    fresh.fill_(2.0)
    torch.cuda._sleep(50_000_000)  # ~tens of ms of queued compute before the read
    total = staging.sum()  # the "attention" reading the buffer
    handle = backend.h2d(staging, fresh, "refill", after_compute=True)
    handle.wait()
    after = staging.sum()
    assert total.item() == float(1 << 20) and after.item() == 2.0 * (1 << 20)


@pytest.mark.cuda
@needs_cuda
def test_streams_priorities_and_failures(cuda_backend: CudaBackend) -> None:
    backend = cuda_backend
    main = torch.cuda.current_stream()
    with backend.draft_stream() as draft:
        assert torch.cuda.current_stream() == draft != main
        x = torch.ones(16, device="cuda") * 3
    backend.join(draft)
    assert torch.cuda.current_stream() == main and x.sum().item() == 48.0
    with backend.verify_stream() as verify:
        assert torch.cuda.current_stream() == verify
    assert verify.priority < draft.priority and backend.h2d_stream.priority < draft.priority
    backend.inject_failure(lambda tag: tag == "bad")
    handle = backend.h2d(torch.empty(4, device="cuda"), torch.zeros(4).pin_memory(), "bad")
    assert handle.done()
    with pytest.raises(TransferError):
        handle.wait()


@pytest.mark.cuda
@needs_cuda
def test_many_is_one_transfer(cuda_backend: CudaBackend) -> None:
    """A staging chunk (K and V of several blocks) moves as one transfer with one record."""
    backend = cuda_backend
    host = backend.alloc_host((6, 2, 16, 8), torch.bfloat16)  # [blocks, K/V, tokens, dims]
    host.copy_(torch.randn(host.shape).to(torch.bfloat16))
    ring = backend.alloc_device((2, 6, 16, 8), torch.bfloat16)  # [K/V, blocks, tokens, dims]
    pairs = [(ring[kv, j], host[j, kv]) for j in range(6) for kv in (0, 1)]
    handle = backend.h2d_many(pairs, "chunk")
    handle.host_wait()
    assert torch.equal(ring.cpu(), host.permute(1, 0, 2, 3))
    records = backend.busy_intervals()
    assert len(records) == 1 and records[0].nbytes == host.numel() * host.element_size()
    torch.cuda._sleep(50_000_000)  # queued compute that the next transfer must wait for
    pending = backend.h2d_many(pairs, "in flight", after_compute=True)
    backend.reset_stats()  # an in-flight transfer is still reported once it finished
    pending.host_wait()
    assert [r.tag for r in backend.busy_intervals()] == ["in flight"]


def test_strided_copies_split_into_contiguous_pieces() -> None:
    """A write-back of one block gathers it from every layer of both tiers (strided on both
    sides); the CUDA backend copies it as contiguous pieces, which together are the block."""
    from specstream.backends.cuda import _contiguous

    host = torch.zeros(3, 2, 5, 4, 2, 8)  # [layers, K/V, blocks, bs, kv, D]
    device = torch.randn(3, 2, 6, 4, 2, 8)
    pieces = _contiguous(host[:, :, 1], device[:, :, 4])
    assert len(pieces) == 3 * 2
    assert all(d.is_contiguous() and s.is_contiguous() for d, s in pieces)
    for d, s in pieces:
        d.copy_(s)
    assert torch.equal(host[:, :, 1], device[:, :, 4])
    assert len(_contiguous(host[0, 0, :2], device[0, 0, :2])) == 1  # a contiguous run: one


def test_narrow_waves_keep_the_ring_full(recording: RecordingBackend) -> None:
    """A ring of one full wave of two requests holds two one-request waves at once (a lone
    prefill chunk's history streams with as many chunks in flight as a full wave's bytes)."""
    store = tiny_store(recording)
    source = ChunkStream(store, chunk_tokens=8, staging_buffers=1, wave_requests=2)
    source.begin(plan(((0, 1), (2, 3), (4,))), [[0]])  # type: ignore[arg-type]
    assert len(source.pending) == 2
    for layer in range(store.cfg.num_layers):
        assert sum(1 for _ in source.drain(layer)) == 3
    source.end()
