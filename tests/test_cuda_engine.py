"""The engine on CUDA: every offloading mode decodes exactly what `resident` decodes, with either
attention backend; a decode round synchronises with the host only inside `sync_point()`; a
chunk wave's gathered copy lands bit-exact. Every test is marked `cuda` and skipped without a
GPU (on the CPU the same properties are covered by `test_engine_modes.py` and
`test_transfer_backends.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specstream import LLM, SamplingParams
from specstream.attention.triton_wave import triton_available
from specstream.backends import CudaBackend, make_backend
from specstream.backends.base import BatchTag

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")]

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_available(), reason="needs Triton"))]
# fp32 KV of the tiny target: 8 layers x 2 kv heads x 16 dims x (K, V) x 4 B = 2 KiB per token
TOKEN_BYTES = 2048
OFFLOAD = dict(block_size=16, chunk_tokens=64, resident_tail_tokens=32, offload_after_tokens=64,
               max_prefill_tokens=64)
# device budgets as in test_engine_modes: the 700-token prompt's history (1.4 MB) does not fit
BUDGET = {"stream": 1_000_000, "offload-spec": 1_600_000, "specstream": 1_600_000}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# fp32 everywhere; a small host tier (pinned memory on CUDA is allocated whole, in powers of 2)
COMMON = dict(device="cuda", dtype="float32", host_kv_bytes=16 << 20)


@pytest.fixture(autouse=True)
def _true_fp32() -> Iterator[None]:
    """No TF32 in matmuls: modes must agree token for token, so all of them compute in fp32."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _run(folder: Path, prompts: list[list[int]], **kw: Any) -> tuple[list[list[int]], dict]:
    llm = LLM(folder, **COMMON, **kw)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert all(o.outputs[0].error is None for o in outs), [o.outputs[0].error for o in outs]
        return [o.outputs[0].token_ids for o in outs], llm.get_metrics()
    finally:
        llm.close()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 300, 700)]


@pytest.fixture(scope="module")
def reference(tiny_target: Path, prompts: list[list[int]]) -> Callable[[str], list[list[int]]]:
    """Greedy target-only tokens with everything resident on CUDA, per attention backend."""
    cache: dict[str, list[list[int]]] = {}

    def get(backend: str) -> list[list[int]]:
        if backend not in cache:
            cache[backend], _ = _run(tiny_target, prompts, mode="resident",
                                     device_kv_bytes=16 << 20, attention_backend=backend)
        return cache[backend]

    return get


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["stream", "specstream", "offload-spec"])
def test_offloading_modes_equal_resident(tiny_target, tiny_draft, prompts, reference, mode,
                                         backend):
    spec = dict(draft_model=tiny_draft, num_speculative_tokens=3) if mode != "stream" else {}
    tokens, m = _run(tiny_target, prompts, mode=mode, device_kv_bytes=BUDGET[mode],
                     attention_backend=backend, **spec, **OFFLOAD)
    assert tokens == reference(backend)
    assert m["device_kv_peak_bytes"] <= BUDGET[mode]
    longest = max(len(p) for p in prompts)
    assert m["host_kv_peak_bytes"] >= (longest - 128) * TOKEN_BYTES  # history really offloaded
    assert m["link_bytes_h2d"] > 0
    if spec:
        assert m["proposed_tokens"] > 0


@pytest.mark.parametrize("mode", ["stream", "specstream", "offload-spec"])
def test_host_attention_equals_resident_on_cuda(tiny_target, tiny_draft, prompts, reference,
                                                mode):
    """Half of each request's cold history attended by the host workers (queries down into
    pinned memory, partials back without blocking), the rest streamed: resident's tokens."""
    spec = dict(draft_model=tiny_draft, num_speculative_tokens=3) if mode != "stream" else {}
    tokens, m = _run(tiny_target, prompts, mode=mode, device_kv_bytes=BUDGET[mode],
                     attention_backend="torch", host_attention_fraction=0.5, **spec, **OFFLOAD)
    assert tokens == reference("torch")
    assert m["host_attention_bytes"] > 0 and m["link_bytes_h2d"] > 0


@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_attention_backends_agree(reference):
    """The Triton kernel (IEEE fp32 dots) and the torch path decode the same tokens."""
    assert reference("triton") == reference("torch")


@pytest.mark.parametrize("host", [{}, dict(host_attention_fraction=0.5)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_rounds_sync_only_inside_sync_point(tiny_target, tiny_draft, prompts, reference,
                                                   backend, host, caplog):
    """After prefill, decode rounds of `specstream` (drafting in the link's gaps, streamed
    history, write-backs) under CUDA's sync debug mode "error": any host synchronisation
    outside `sync_point()` raises inside the round, which fails the round's requests (and logs
    it), so the test sees it."""
    llm = LLM(tiny_target, mode="specstream", draft_model=tiny_draft, num_speculative_tokens=3,
              device_kv_bytes=BUDGET["specstream"], attention_backend=backend, **COMMON,
              **OFFLOAD, **host)
    eng = llm.engine
    try:
        rids = [eng.add_request(p, GREEDY) for p in prompts]
        reqs = [eng.scheduler.requests[r] for r in rids]
        while any(r.first_token_time is None for r in reqs):  # prefill, syncs allowed
            eng.step()
        for _ in range(2):  # warm-up: kernels of the decode shapes compiled, handles created
            eng.step()
        assert eng.has_unfinished(), "nothing left to decode: lengthen the requests"
        before = eng.get_metrics()
        torch.cuda.synchronize()
        saved = torch.cuda.get_sync_debug_mode()
        outputs = []
        with caplog.at_level(logging.ERROR, logger="specstream.engine"):
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(4):
                    outputs += eng.step()
            finally:
                torch.cuda.set_sync_debug_mode(saved)
        assert not caplog.records, caplog.text  # a round failed: the sync it hit is in there
        errors = [o.outputs[0].error for o in outputs if o.outputs[0].error]
        assert not errors, errors
        after = eng.get_metrics()
        assert after["decode_steps"] > before["decode_steps"]
        assert after["generated_tokens"] > before["generated_tokens"]
        assert after["proposed_tokens"] > before["proposed_tokens"]  # drafts were verified
        assert after["link_bytes_h2d"] > before["link_bytes_h2d"]  # history was streamed
        while eng.has_unfinished():
            eng.step()
        assert [r.output_token_ids for r in reqs] == reference(backend)
    finally:
        llm.close()


@pytest.fixture
def cuda_backend() -> Iterator[CudaBackend]:
    backend = make_backend("cuda")
    assert isinstance(backend, CudaBackend)
    yield backend
    backend.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ragged", [False, True])
def test_h2d_gather_lands_a_chunk_wave_bit_exact(cuda_backend: CudaBackend, dtype: torch.dtype,
                                                 ragged: bool) -> None:
    """A chunk wave as `KVStore.restore_rows` issues it: one layer of some host blocks (a view
    of the layer-major pinned host tier) into rows of a staging slot viewed block-major, as one
    transfer (runs of consecutive blocks coalesced); issuing and ordering it never syncs the
    host, and the bytes land exactly, rows not named untouched."""
    backend = cuda_backend
    layers, blocks, bs, kv, dim, cb = 3, 12, 16, 2, 8, 4  # cb: blocks per chunk
    host = backend.alloc_host((layers, 2, blocks, bs, kv, dim), dtype)  # the host tier
    raw = host.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))  # any bits, NaNs included
    slot = backend.alloc_device((2, 2 * cb, bs, kv, dim), dtype)  # [K/V, 2 requests x cb, ...]
    slot.view(torch.uint8).fill_(0x5A)
    before = slot.cpu()
    if ragged:  # request 0's chunk has 3 blocks (one run), request 1's 1: rows 3, 5-7 untouched
        index, rows = torch.tensor([7, 8, 9, 2]), torch.tensor([0, 1, 2, 4])
    else:  # runs 3-6, 0, 10-11, and a block that follows a run's end in the host tier only
        index, rows = torch.tensor([3, 4, 5, 6, 0, 10, 11, 1]), None
    layer = 1
    src = host[layer].transpose(0, 1)  # [blocks, 2, bs, kv, dim], as KVStore.host_rows
    torch.cuda.synchronize()
    saved = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        handle = backend.h2d_gather(slot.transpose(0, 1), src, index, BatchTag(("a", "b")),
                                    rows=rows)
        handle.wait()  # orders the current stream after the copy
    finally:
        torch.cuda.set_sync_debug_mode(saved)
    got = slot.cpu()  # on the current stream, so after the copy
    want = before.clone()
    at = range(len(index)) if rows is None else rows.tolist()
    for j, i in zip(at, index.tolist()):  # byte views: NaN bit patterns copied as they are
        want.view(torch.uint8)[:, j] = host.view(torch.uint8)[layer, :, i]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if ragged:
        untouched = [3, 5, 6, 7]
        assert torch.equal(got[:, untouched].view(torch.uint8),
                           before[:, untouched].view(torch.uint8))
    handle.host_wait()
    records = backend.busy_intervals()
    assert len(records) == 1  # one transfer for the whole wave
    assert records[0].nbytes == len(index) * 2 * bs * kv * dim * host.element_size()
