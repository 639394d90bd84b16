"""Two-tier KV: the pure-Python manager, bitwise round trips, failures, full host pool."""

from __future__ import annotations

import pytest
import torch

from specstream import LLM, SamplingParams
from specstream.backends import make_backend
from specstream.kvcache.allocator import OutOfBlocks
from specstream.kvcache.manager import KVManager
from specstream.kvcache.residency import OffloadPolicy
from specstream.kvcache.storage import KVStore
from specstream.models.config import ModelConfig

OFFLOAD = dict(block_size=16, chunk_tokens=64, resident_tail_tokens=32, offload_after_tokens=64,
               max_prefill_tokens=64)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _manager(device_blocks=8, host_blocks=32, **policy) -> KVManager:
    p = dict(offload=True, resident_tail_tokens=32, offload_after_tokens=64, chunk_tokens=48,
             residency="tail")
    p.update(policy)
    return KVManager(16, device_blocks, host_blocks, OffloadPolicy(**p))


def test_manager_offloads_only_past_threshold():
    kv = _manager()
    kv.allocate("a", 64)
    kv.commit("a", 64)
    assert kv.plan_writeback("a") == []  # at offload_after_tokens: stays on the device
    kv.allocate("a", 1)
    kv.commit("a", 65)
    # past it: full blocks beyond the 32-token resident tail move, (65 - 32) // 16 = 2
    assert len(kv.plan_writeback("a")) == 2
    assert kv.plan_writeback("a") == []  # one write-back at a time
    kv.complete_writeback("a")
    assert kv.host_tokens("a") == 32


def test_manager_writeback_restore_and_rollback():
    kv = _manager()
    kv.allocate("a", 100)
    kv.commit("a", 100)
    pairs = kv.plan_writeback("a")
    assert len(pairs) == 4
    # until the copies land the blocks stay the head of the device tail (attended there)
    assert kv.host_tokens("a") == 0 and kv.restore_chunks("a") == []
    assert [d for d, _ in pairs] == kv.seqs["a"].device_blocks[:4]
    assert kv.device.num_used == 7
    kv.complete_writeback("a")
    assert kv.host_tokens("a") == 64
    assert kv.device.num_used == 3
    chunks = kv.restore_chunks("a")
    assert [c.num_tokens for c in chunks] == [48, 16]
    assert [b for c in chunks for b in c.host_blocks] == kv.seqs["a"].host_blocks
    # slots of new tokens land in the tail; rollback frees blocks past the kept tokens
    kv.allocate("a", 20)
    seq = kv.seqs["a"]  # token 100 lands in the window's second-to-last block
    bs = kv.block_size
    assert seq.device_blocks[(100 - seq.first * bs) // bs] == seq.device_blocks[-2]
    kv.commit("a", 101)
    assert kv.device.num_used == 3
    with pytest.raises(ValueError, match="host tier"):
        kv.commit("a", 10)
    kv.free("a")
    assert kv.device.num_used == 0 and kv.host.num_used == 0


def test_manager_resident_policy_never_offloads():
    kv = _manager(offload=False, device_blocks=20)
    kv.allocate("a", 300)
    kv.commit("a", 300)
    assert kv.plan_writeback("a") == []
    with pytest.raises(OutOfBlocks):
        kv.allocate("b", 100)


def test_offload_then_restore_is_bitwise_identical():
    cfg = ModelConfig(family="qwen3", vocab_size=8, hidden_size=32, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=8,
                      max_position_embeddings=64)
    backend = make_backend("cpu")
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            store = KVStore(cfg, dtype, 4, num_device_blocks=3, num_host_blocks=5,
                            backend=backend)
            data = torch.randn(store.device.shape).to(dtype)
            store.device.copy_(data)
            for h in store.writeback([(0, 4), (2, 1)], tag="r"):
                h.wait()
            dst = torch.empty(2, 2, 4, 2, 8, dtype=dtype)
            for layer in range(3):
                for h in store.restore(layer, (4, 1), dst, tag="r"):
                    h.wait()
                for j, dev in enumerate((0, 2)):
                    orig = data[layer, :, dev]
                    assert torch.equal(dst[:, j].view(torch.uint8), orig.view(torch.uint8))
    finally:
        backend.close()


def test_transfer_failure_fails_only_its_request(tiny_target):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (400, 500, 600)]
    ref_llm = LLM(tiny_target, mode="stream", device_kv_bytes=1_000_000, **OFFLOAD)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, GREEDY, use_tqdm=False)]
    ref_llm.close()
    llm = LLM(tiny_target, mode="stream", device_kv_bytes=1_000_000, **OFFLOAD)
    llm.engine.backend.inject_failure(lambda tag: tag == "1")
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error"
    assert "transfer" in outs[1].outputs[0].error and "'1'" in outs[1].outputs[0].error
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [ref[0], ref[2]]
    # the failed request's blocks went back to both pools
    assert llm.engine.kv.device.num_used == 0 and llm.engine.kv.host.num_used == 0
    llm.close()


def test_full_host_pool_makes_requests_wait_not_fail(tiny_target):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (600,), generator=g).tolist() for _ in range(4)]
    # room for about 1.5 requests' history at a time: the others must wait their turn
    host = int(1.5 * 600 * 2048)
    llm = LLM(tiny_target, mode="stream", device_kv_bytes=1_000_000, host_kv_bytes=host,
              **OFFLOAD)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    m = llm.get_metrics()
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert m["max_concurrency"] == 1
    assert m["host_kv_peak_bytes"] <= host
    with pytest.raises(ValueError, match="host_kv_bytes"):
        llm.generate([list(range(100)) * 20], GREEDY, use_tqdm=False)
    llm.close()


def test_layer_restore_into_lent_pool_blocks_returns_every_layer_exactly():
    """`restore` modes hold two layers of a step's history in pool blocks lent to the step,
    every layer plane of a block a slot: with scattered lent blocks a request's layer history
    comes as several pieces, which together are its host history of that layer, bit for bit."""
    from specstream.engine.contract import SeqWork, StepPlan
    from specstream.engine.exec.history import make_source

    cfg = ModelConfig(family="qwen3", vocab_size=8, hidden_size=32, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=8,
                      max_position_embeddings=64)
    backend = make_backend("cpu")
    try:
        store = KVStore(cfg, torch.float32, 4, num_device_blocks=12, num_host_blocks=10,
                        backend=backend)
        store.host.copy_(torch.randn(store.host.shape))
        histories = [(7, 2, 9), (0, 5, 1, 4)]  # host blocks of two requests
        seqs = tuple(SeqWork(f"r{i}", (1,), 4 * len(h), 0, False, True, 4 * len(h), (i,),
                             (h,)) for i, h in enumerate(histories))
        # 2 layers x 7 history blocks = 14 slots: 5 lent blocks x 3 planes, not consecutive
        plan = StepPlan(seqs, restore_blocks=(3, 4, 6, 10, 11))
        source = make_source("restore", store, 4, 2)
        source.begin(plan, [[0, 1]])
        for layer in range(3):
            waves = list(source.drain(layer))  # one-request waves: the pieces of each request
            for i, h in enumerate(histories):
                pieces = [(k[0], v[0]) for _, k, v, shape in waves
                          if shape.index is not None and shape.index.tolist() == [i]]
                assert len(pieces) > 1  # scattered slots, or across planes: several pieces
                k = torch.cat([p[0] for p in pieces])
                v = torch.cat([p[1] for p in pieces])
                want = store.host_rows(layer)[list(h)]  # [blocks, 2, bs, kv, D]
                assert torch.equal(k, want[:, 0].reshape(-1, 2, 8))
                assert torch.equal(v, want[:, 1].reshape(-1, 2, 8))
        source.end()
    finally:
        backend.close()
