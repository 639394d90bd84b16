"""Automatic prefix caching over both tiers: the index (keys, LRU, pins), the allocators that
take cached blocks back, and the engine: hits copy instead of prefilling, outputs are the
same with and without the cache in every mode, the draft keeps its acceptance, and the cache
always yields to requests."""

from __future__ import annotations

import pytest
import torch

from specstream import LLM, SamplingParams
from specstream.kvcache.manager import CopyKind, KVManager
from specstream.kvcache.prefix_cache import PrefixCache
from specstream.kvcache.residency import OffloadPolicy

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (n,), generator=g).tolist()


# ---- the index --------------------------------------------------------------------------
def test_keys_chain_their_parents_and_only_full_blocks_count():
    cache = PrefixCache(BS)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 2, 3, 4, 5, 6, 7, 8]
    ka, kb = cache.chain(a, 10), cache.chain(b, 10)
    assert len(ka) == 2 and len(kb) == 2  # the partial block is not a block
    assert ka[1][1] == ka[0][0]  # a block's parent is the block before it
    assert ka[0][0] != kb[0][0] and ka[1][0] != kb[1][0]  # same tokens, other prefix


def test_lookup_finds_the_longest_cached_prefix_and_never_a_colliding_one():
    cache = PrefixCache(BS)
    prompt = list(range(12))
    assert cache.insert(prompt, [10, 11, 12], [None, None, None]) == ([], [])
    assert [e.device for e in cache.lookup(prompt, 3)] == [10, 11, 12]
    assert [e.device for e in cache.lookup(prompt[:8] + [99] * 4, 3)] == [10, 11]
    assert len(cache.lookup(prompt, 2)) == 2  # at most max_blocks
    assert cache.lookup(prompt, 3, tiers=("host",)) == []  # no host copies
    # an entry under the right key with other tokens (a hash collision) is not a hit
    key = cache.chain(prompt, 1)[0][0]
    cache.entries[key].tokens = (7, 7, 7, 7)
    assert cache.lookup(prompt, 3) == []


def test_insert_keeps_one_copy_per_tier_and_hands_back_the_rest():
    cache = PrefixCache(BS)
    prompt = list(range(8))
    cache.insert(prompt, [1, None], [None, 21])
    left = cache.insert(prompt, [2, 3], [20, 22])  # the same blocks again, other copies
    assert left == ([2], [22])  # block 0 had a device copy, block 1 a host copy
    e0, e1 = cache.lookup(prompt, 2)
    assert (e0.device, e0.host, e1.device, e1.host) == (1, 20, 3, 21)


def test_reclaim_takes_the_least_recently_used_deepest_blocks_first_and_skips_pins():
    cache = PrefixCache(BS)
    old, new = list(range(12)), list(range(100, 112))
    cache.insert(old, [1, 2, 3], [None] * 3)
    cache.insert(new, [4, 5, 6], [None] * 3)
    cache.lookup(old, 3)  # old is now the most recently used
    assert cache.reclaim("device", 2) == [6, 5]  # new's deepest blocks first
    hits = cache.lookup(old, 3)
    cache.pin([(e, "device") for e in hits])
    assert cache.num_reclaimable("device") == 1
    assert cache.reclaim("device", 5) == [4]  # the pinned ones stay
    cache.unpin([(e, "device") for e in hits])
    assert sorted(cache.reclaim("device", 5)) == [1, 2, 3] and not cache.entries


# ---- the allocators -----------------------------------------------------------------------
def _manager(device: int, host: int) -> KVManager:
    policy = OffloadPolicy(offload=True, resident_tail_tokens=BS, offload_after_tokens=BS,
                           chunk_tokens=2 * BS, residency="fill")
    return KVManager(BS, device, host, policy, prefix_caching=True)


def test_a_finished_request_leaves_its_full_blocks_and_allocations_take_them_back():
    kv = _manager(device=6, host=6)
    tokens = list(range(14))  # 3 full blocks and 2 tokens
    kv.allocate("a", 14)
    kv.commit("a", 14)
    for d, h in kv.plan_writeback("a"):
        assert d in kv.seqs["a"].device_blocks and h is not None
    kv.complete_writeback("a")
    kv.free("a", tokens)
    # an offloading mode caches its host copies (write-through made one of every full block)
    assert (kv.device.num_cached, kv.host.num_cached) == (0, 3)
    assert kv.host.num_used == 0 and kv.host.num_free == 6  # cached blocks are free
    kv.allocate("b", 4 * BS)
    kv.commit("b", 4 * BS)
    kv.plan_writeback("b")  # four host blocks: the cache yields one
    assert kv.host.num_cached == 2 and kv.host.num_free == 2
    resident = KVManager(BS, 6, 0, OffloadPolicy(offload=False), prefix_caching=True)
    resident.allocate("a", 12)
    resident.commit("a", 12)
    resident.free("a", list(range(12)))
    assert resident.device.num_cached == 3 and resident.device.num_free == 6
    resident.allocate("b", 6 * BS)  # the whole device tier: the cache yields every block
    assert resident.device.num_cached == 0


def test_a_hit_copies_the_cached_blocks_into_the_requests_own_host_blocks():
    kv = _manager(device=8, host=8)
    prompt = list(range(20))
    kv.allocate("a", 20)
    kv.commit("a", 20)
    kv.plan_writeback("a")
    kv.complete_writeback("a")
    kv.free("a", prompt)
    cached = [e.host for e in kv.cache.lookup(prompt, 5)]
    hit, copies = kv.adopt_prefix("b", prompt)
    assert hit == 16  # 4 of 5 blocks: the last prompt token is left to prefill
    seq = kv.seqs["b"]
    assert seq.first == 4 and seq.num_tokens == 16 and not seq.device_blocks
    assert [(k, s) for k, s, _ in copies] == [("h2h", h) for h in cached[:4]]
    assert [d for _, _, d in copies] == seq.host_blocks
    assert not set(seq.host_blocks) & set(cached[:4])  # its own blocks, not the hits'
    # (block 4 was no hit: its cached copy was not pinned, and the allocation took it back)
    # the sources are pinned until the step ran
    assert kv.host.num_free == kv.host.num_blocks - 4 - 4
    kv.release_pins()
    assert kv.host.num_free == kv.host.num_blocks - 4
    assert kv.cache.queries == 20 and kv.cache.hits == 16


def test_no_hit_without_the_cache_or_on_a_failed_request():
    kv = _manager(device=8, host=8)
    kv.allocate("a", 12)
    kv.commit("a", 12)
    kv.free("a", None)  # failed: its KV is not kept
    assert kv.device.num_cached == 0 and kv.adopt_prefix("b", list(range(13))) == (0, [])
    plain = KVManager(BS, 8, 8, OffloadPolicy(offload=False))
    assert plain.cache is None and plain.adopt_prefix("b", list(range(13))) == (0, [])


# ---- the engine ---------------------------------------------------------------------------
OFFLOAD = dict(block_size=16, chunk_tokens=64, device_kv_bytes=600_000,
               resident_tail_tokens=32, max_prefill_tokens=128)
MODES = {"resident": dict(block_size=16, device_kv_bytes=4_000_000, max_prefill_tokens=128),
         "offload": OFFLOAD, "offload-spec": OFFLOAD, "specstream": OFFLOAD,
         "parallel-spec": OFFLOAD}


def _turns(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    """Each prompt after the one before has finished (as chat turns come)."""
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("mode", list(MODES))
def test_outputs_are_the_same_with_and_without_the_cache(tiny_target, mode):
    context = _tokens(300)
    prompts = [context + _tokens(20, 1), context + _tokens(40, 2), context[:100]]
    spec = dict(proposer="ngram") if mode != "offload" else {}
    runs, hits = {}, {}
    for cache in (False, True):
        llm = LLM(tiny_target, mode=mode, enable_prefix_caching=cache, **MODES[mode], **spec)
        runs[cache] = _turns(llm, prompts)
        m = llm.get_metrics()
        hits[cache] = m["prefix_cache_hits_total"]
        if cache:
            assert m["prefix_cache_queries_total"] == sum(map(len, prompts))
            tier = "device" if mode == "resident" else "host"
            assert m["prefix_cache_hits_by_tier"][tier] == m["prefix_cache_hits_total"]
        llm.close()
    assert runs[True] == runs[False]
    # the second prompt finds the context's 18 full blocks; the third 6 (99 tokens)
    assert hits == {False: 0, True: (18 + 6) * 16}


def test_a_cached_block_is_bitwise_the_block_a_fresh_prefill_makes(tiny_target):
    """The cache of one engine (from a short prompt) and of another (from a long prompt with
    the same start) hold the same bytes for the shared blocks. (Both prefilled them in the
    same 128-token chunks: KV is bitwise reproducible for the same chunk shapes, as the
    engine's kernels are; a chunk of another length rounds differently, with or without a
    cache.)"""
    context = _tokens(256)
    stores = []
    for extra in (8, 150):
        llm = LLM(tiny_target, mode="resident", **MODES["resident"])
        _turns(llm, [context + _tokens(extra, 3)])
        kv, store = llm.engine.kv, llm.engine.store
        blocks = [e.device for e in kv.cache.lookup(context, 256 // 16, tiers=("device",))]
        assert len(blocks) == 16
        stores.append(store.device[:, :, blocks].clone())
        llm.close()
    assert torch.equal(stores[0], stores[1])


def test_hit_copies_are_bitwise_and_go_between_the_right_tiers():
    from specstream.backends import make_backend
    from specstream.kvcache.storage import KVStore
    from specstream.models.config import ModelConfig

    cfg = ModelConfig(family="qwen3", vocab_size=8, hidden_size=8, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=4, intermediate_size=8,
                      max_position_embeddings=64)
    store = KVStore(cfg, torch.float32, BS, 6, 6, make_backend("cpu"))
    assert store.host is not None
    store.device.normal_()
    store.host.normal_()
    before_d, before_h = store.device.clone(), store.host.clone()
    h2h, d2d = CopyKind.HOST_TO_HOST, CopyKind.DEVICE_TO_DEVICE
    store.copy_blocks(((h2h, 0, 5), (d2d, 2, 3), (h2h, 1, 2)))
    assert torch.equal(store.host[:, :, 5], before_h[:, :, 0])
    assert torch.equal(store.device[:, :, 3], before_d[:, :, 2])
    assert torch.equal(store.host[:, :, 2], before_h[:, :, 1])
    untouched = [0, 1, 3, 4]
    assert torch.equal(store.host[:, :, untouched], before_h[:, :, untouched])


def test_the_draft_keeps_its_acceptance_on_a_hit(tiny_target, tiny_draft):
    """The draft's window is rebuilt from the cached tokens on its first drafts: the hit
    request verifies the same drafts as without the cache, round for round."""
    context = _tokens(400)
    prompts = [context + _tokens(16, 4), context + _tokens(24, 5)]
    got = {}
    for cache in (False, True):
        llm = LLM(tiny_target, mode="specstream", draft_model=tiny_draft,
                  speculative_policy="fixed", num_speculative_tokens=3,
                  enable_prefix_caching=cache, **OFFLOAD)
        outs = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0] for p in prompts]
        got[cache] = [(o.token_ids, o.num_accepted_tokens, o.num_rounds) for o in outs]
        if cache:
            assert llm.get_metrics()["prefix_cache_hits_total"] == 25 * 16
        llm.close()
    assert got[True] == got[False]


def test_seeded_sampling_is_the_same_with_and_without_the_cache(tiny_target, tiny_draft):
    context = _tokens(260)
    prompts = [context + _tokens(10, 6), context + _tokens(12, 7)]
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=20, ignore_eos=True)
    runs = []
    for cache in (False, True):
        llm = LLM(tiny_target, mode="specstream", draft_model=tiny_draft,
                  enable_prefix_caching=cache, **OFFLOAD)
        runs.append(_turns(llm, prompts, params))
        llm.close()
    assert runs[0] == runs[1]


def test_the_cache_yields_every_block_to_requests(tiny_target):
    """Finished requests fill most of the host tier with cached blocks; a request that needs
    nearly all of it is admitted, runs and matches an engine without the cache."""
    kw = dict(block_size=16, chunk_tokens=64, device_kv_bytes=600_000,
              host_kv_bytes=2_500_000, resident_tail_tokens=32, max_prefill_tokens=128)
    fillers = [_tokens(280, 10 + i) for i in range(4)]
    big = _tokens(1000, 20)
    llm = LLM(tiny_target, mode="specstream", proposer="ngram", **kw)
    _turns(llm, fillers)
    kv = llm.engine.kv
    assert kv.host.num_cached > kv.host.num_blocks // 2
    got = _turns(llm, [big])
    m = llm.get_metrics()
    llm.close()
    plain = LLM(tiny_target, mode="specstream", proposer="ngram", enable_prefix_caching=False,
                **kw)
    assert got == _turns(plain, [big])
    plain.close()
    assert m["prefix_cache_hits_total"] == 0  # nothing shared: the cache only gave room


def test_resident_admission_waits_for_blocks_a_hit_pins(tiny_target):
    """Resident mode takes a request's whole reservation at admission; blocks a hit of the
    same step copies from cannot be taken back until the step ran, so the next request
    waits a step instead of failing."""
    context = _tokens(300)
    llm = LLM(tiny_target, mode="resident", block_size=16, device_kv_bytes=1_670_000,
              max_prefill_tokens=128)
    assert llm.engine.kv.device.num_blocks == 50  # 19 cached, two requests of 21 each
    first = _turns(llm, [context + _tokens(10, 8)])
    both = llm.generate([context + _tokens(10, 9), _tokens(300, 10)], GREEDY, use_tqdm=False)
    assert llm.get_metrics()["prefix_cache_hits_total"] == 18 * 16
    llm.close()
    plain = LLM(tiny_target, mode="resident", block_size=16, device_kv_bytes=1_670_000,
                max_prefill_tokens=128, enable_prefix_caching=False)
    assert _turns(plain, [context + _tokens(10, 8)]) == first
    want = plain.generate([context + _tokens(10, 9), _tokens(300, 10)], GREEDY, use_tqdm=False)
    plain.close()
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in want]
