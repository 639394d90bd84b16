"""Prefix sharing: requests that start with the same full blocks reference one host copy of
them (no copies), a shared cold block streams once a round for all its sharers, and outputs are
exactly those without sharing in every offloading mode, chains and trees, `fill` and `tail`,
with host attention, greedy and seeded sampling."""

from __future__ import annotations

import pytest
import torch

from specstream import LLM, SamplingParams
from specstream.kvcache.manager import KVManager
from specstream.kvcache.residency import OffloadPolicy

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (n,), generator=g).tolist()


def _manager(device: int = 16, host: int = 32, sharing: bool = True) -> KVManager:
    policy = OffloadPolicy(offload=True, resident_tail_tokens=2 * BS, chunk_tokens=2 * BS)
    return KVManager(BS, device, host, policy, prefix_caching=True, prefix_sharing=sharing)


def _write(kv: KVManager, rid: str, tokens: list[int]) -> None:
    """``rid`` computed ``tokens`` and wrote every full block through to the host."""
    kv.allocate(rid, len(tokens))
    kv.commit(rid, len(tokens))
    kv.plan_writeback(rid)
    kv.complete_writeback(rid)
    kv.share_written(rid, tokens)


# ---- the manager ------------------------------------------------------------------------
def test_a_sharer_references_the_owners_host_blocks_and_they_count_once():
    kv = _manager()
    doc = list(range(6 * BS))
    _write(kv, "a", doc + [90, 91, 92])
    owner = kv.seqs["a"]
    assert len(owner.host_blocks) == 6 and len(owner.refs) == 6  # all in the cache now
    used = kv.host.num_used
    assert used == 6 and kv.host.num_free == kv.host.num_blocks - 6
    hit, copies = kv.adopt_prefix("b", doc + [70, 71])
    assert (hit, copies) == (6 * BS, [])  # references, no copies
    sharer = kv.seqs["b"]
    assert sharer.host_blocks == owner.host_blocks and sharer.first == 6
    assert kv.host.num_used == used  # held once
    assert kv.shared_run("a") == kv.shared_run("b") == 6
    assert kv.shared_block_refs() == (12, 6) and kv.duplicate_blocks() == 6
    assert kv.duplicate_blocks(["a"]) == 0


def test_blocks_offered_over_several_write_backs_chain_on():
    """A request's blocks join the cache write-back by write-back, each keyed from the last
    one offered (not re-hashed from the first): a sharer finds all of them."""
    kv = _manager()
    tokens = list(range(6 * BS + 1))
    for n in (3 * BS, 6 * BS + 1):  # two write-backs: blocks 0-2, then 3-5
        _write(kv, "a", tokens[:n])
    assert len(kv.seqs["a"].refs) == 6
    hit, _ = kv.adopt_prefix("b", tokens)
    assert hit == 6 * BS and kv.seqs["b"].host_blocks == kv.seqs["a"].host_blocks


def test_restore_chunks_are_cut_where_the_shared_run_ends():
    kv = _manager()
    doc = list(range(3 * BS))
    _write(kv, "a", doc + list(range(50, 50 + 3 * BS)))  # 3 shared blocks, then 3 own
    kv.adopt_prefix("b", doc + [7])
    kv.drop("a", 6)
    chunks = [c.host_blocks for c in kv.restore_chunks("a")]
    assert [len(c) for c in chunks] == [2, 1, 2, 1]  # 2-block chunks, cut after block 3
    assert chunks[:2] == [tuple(c.host_blocks) for c in kv.restore_chunks("b")]


def test_a_shared_block_outlives_its_owner_and_is_never_reclaimed_while_referenced():
    kv = _manager(host=8)
    doc = list(range(4 * BS))
    _write(kv, "a", doc + [1])
    kv.adopt_prefix("b", doc + [2])
    blocks = list(kv.seqs["b"].host_blocks)
    kv.free("a", doc + [1])
    assert kv.host.num_used == 4 and kv.shared_block_refs() == (0, 0)  # b alone now
    got = kv.host.allocate(kv.host.num_free)  # everything that may be taken
    assert not set(got) & set(blocks)
    kv.host.free(got)
    kv.free("b", doc + [2])
    assert kv.host.num_used == 0 and kv.host.num_free == 8  # cached, reclaimable


def test_without_sharing_a_hit_still_copies():
    kv = _manager(sharing=False)
    doc = list(range(4 * BS))
    _write(kv, "a", doc + [1])
    assert not kv.seqs["a"].refs
    kv.free("a", doc + [1])
    hit, copies = kv.adopt_prefix("b", doc + [2])
    assert hit == 4 * BS and len(copies) == 4


# ---- the engine ---------------------------------------------------------------------------
OFFLOAD = dict(block_size=16, chunk_tokens=64, device_kv_bytes=600_000,
               resident_tail_tokens=32, max_prefill_tokens=128)
CASES = {
    "offload": {}, "offload-spec": dict(proposer="ngram"), "parallel-spec": dict(proposer="ngram"),
    "specstream": dict(proposer="ngram"),
    "specstream-tail": dict(proposer="ngram", residency="tail", offload_after_tokens=64),
    "specstream-host": dict(proposer="ngram", host_attention="auto",
                            host_attention_fraction=0.5),
}


def _prompts(n: int = 4, doc_len: int = 300) -> list[list[int]]:
    doc = _tokens(doc_len)
    return [doc + _tokens(20 + 3 * i, i + 1) for i in range(n)]


def _run(path, prompts, params, **kw):
    llm = LLM(path, **kw)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    m = llm.get_metrics()
    llm.close()
    return out, m


@pytest.fixture(scope="module")
def resident_out(tiny_target):
    return _run(tiny_target, _prompts(), GREEDY, mode="resident", block_size=16,
                device_kv_bytes=4_000_000)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_are_the_same_with_and_without_sharing(tiny_target, resident_out, case):
    mode = case.split("-host")[0].split("-tail")[0]
    runs = {share: _run(tiny_target, _prompts(), GREEDY, mode=mode, prefix_sharing=share,
                        **OFFLOAD, **CASES[case]) for share in (False, True)}
    assert runs[True][0] == runs[False][0] == resident_out
    on, off = runs[True][1], runs[False][1]
    # every later request references the document (those that arrived together waited for
    # the first one's prefill of it)
    assert on["prefix_cache_hits_total"] >= max(3 * 288, off["prefix_cache_hits_total"])
    assert on["host_kv_peak_bytes"] < off["host_kv_peak_bytes"]


@pytest.mark.parametrize(("mode", "residency"), [("specstream", "tail"), ("offload-spec", "tail"),
                                               ("specstream", "fill")])
def test_a_shared_block_crosses_the_link_once_a_round(tiny_target, mode, residency):
    """Streamed (chunk waves) or restored (whole layers), a block every sharer reads crosses
    the link once a round; under `fill` too, where the sharers' device windows start at
    different blocks of the shared run."""
    # tails of 64 tokens: all four run at once and their documents cross every round
    kw = dict(mode=mode, proposer="ngram", residency=residency, offload_after_tokens=64,
              **{**OFFLOAD, "device_kv_bytes": 1_500_000})
    on = _run(tiny_target, _prompts(), GREEDY, prefix_sharing=True, **kw)[1]
    off = _run(tiny_target, _prompts(), GREEDY, prefix_sharing=False, **kw)[1]
    assert on["link_bytes_per_round"] < 0.6 * off["link_bytes_per_round"]
    assert on["link_bytes_floor_per_round"] <= off["link_bytes_floor_per_round"]
    assert on["max_concurrency"] == off["max_concurrency"] == 4
    # what moved is the distinct blocks (the engine's own count of them)
    assert on["link_bytes_per_round"] <= 1.15 * on["link_bytes_unique_per_round"]


def test_trees_are_exact_with_sharing(tiny_target, tiny_draft, resident_out):
    # every round a tree: the policy's choice (auto) on the tiny pair is free to take none
    tree = dict(draft_model=tiny_draft, num_speculative_tokens=3, speculative_topk=2,
                speculative_num_draft_tokens=6, speculative_policy="fixed")
    out, m = _run(tiny_target, _prompts(), GREEDY, mode="specstream", **OFFLOAD, **tree)
    assert out == resident_out and m["tree_rounds"] > 0 and m["prefix_cache_hits_total"] > 0


def test_seeded_sampling_is_the_same_with_and_without_sharing(tiny_target):
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=s, ignore_eos=True)
              for s in range(4)]
    runs = [_run(tiny_target, _prompts(), params, mode="specstream", proposer="ngram",
                 prefix_sharing=share, **OFFLOAD)[0] for share in (False, True)]
    assert runs[0] == runs[1]


def test_a_sharer_that_ends_first_leaves_the_others_unchanged(tiny_target, resident_out):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (16, 3, 16, 5)]
    out, m = _run(tiny_target, _prompts(), params, mode="specstream", proposer="ngram",
                  **OFFLOAD)
    assert m["prefix_cache_hits_total"] > 0
    assert out == [r[: p.max_tokens] for r, p in zip(resident_out, params)]


def test_a_shared_block_is_bitwise_the_block_a_fresh_prefill_makes(tiny_target):
    """The host copy the sharers reference is the one the first request wrote, byte for byte
    what an engine without sharing writes for the same blocks from that prompt alone (in the
    same 128-token prefill chunks: the others waited for its prefill)."""
    prompts, copies = _prompts(), []
    for share in (False, True):
        llm = LLM(tiny_target, mode="offload", prefix_sharing=share, **OFFLOAD)
        llm.generate(prompts if share else prompts[:1], GREEDY, use_tqdm=False)
        kv, store = llm.engine.kv, llm.engine.store
        entries = kv.cache.lookup(prompts[0], 300 // 16, tiers=("host",))
        assert len(entries) == 300 // 16
        copies.append(store.host[:, :, [e.host for e in entries]].clone())
        llm.close()
    assert torch.equal(copies[0], copies[1])


def test_sharing_shows_in_the_metrics_while_requests_run(tiny_target):
    llm = LLM(tiny_target, mode="specstream", proposer="ngram", **OFFLOAD)
    engine, prompts = llm.engine, _prompts()
    for i, p in enumerate(prompts):
        engine.add_request(p, GREEDY, str(i))
    seen = []
    while engine.has_unfinished():
        engine.step()
        m = engine.get_metrics()
        seen.append((m["shared_block_refs"], m["shared_blocks"], m["unique_kv_bytes"]))
    llm.close()
    refs, blocks, _ = max(seen)
    assert blocks >= 18 and refs >= 2 * blocks
    assert all(u >= 0 for *_, u in seen)


def test_one_copy_of_a_shared_chunk_serves_every_bucket_bit_for_bit():
    """Three requests in two query buckets, the first two with the same two chunks of history
    (a shared prefix) and then one chunk of their own: the stream copies each shared chunk once
    (one region, both buckets' parts), and every request's keys are its host history."""
    from specstream.backends import make_backend
    from specstream.engine.contract import SeqWork, StepPlan
    from specstream.engine.exec.history import make_source
    from specstream.kvcache.storage import KVStore
    from specstream.models.config import ModelConfig

    cfg = ModelConfig(family="qwen3", vocab_size=8, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=8,
                      max_position_embeddings=64)
    backend = make_backend("cpu")
    try:
        store = KVStore(cfg, torch.float32, 4, num_device_blocks=12, num_host_blocks=12,
                        backend=backend)
        store.host.copy_(torch.randn(store.host.shape))
        chunks = [((0, 1), (2, 3), (4,)), ((0, 1), (2, 3), (5, 6)), ((7, 8), (9,))]
        seqs = tuple(SeqWork(f"r{i}", (1,), 4 * sum(map(len, c)), 0, False, True,
                             4 * sum(map(len, c)), (i,), c) for i, c in enumerate(chunks))
        source = make_source("stream", store, 8, 2, wave_requests=2)
        source.begin(StepPlan(seqs), [[0], [1, 2]])
        copied = []
        for layer in range(cfg.num_layers):
            got: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in seqs}
            for wave in source.waves(layer):
                copied.append(wave.copy.index.tolist())
                for bucket, k, v, shape in source.landed(wave):
                    members = [[0], [1, 2]][bucket]
                    rows = shape.index.tolist() if shape.index is not None else range(len(k))
                    for w, row in enumerate(rows):
                        n = int(shape.key_len[w])
                        got[f"r{members[row]}"].append(torch.stack([k[w, :n], v[w, :n]]))
                source.release(wave)
            for s, c in zip(seqs, chunks):
                want = store.host_rows(layer)[[b for ch in c for b in ch]]
                want = want.transpose(0, 1).reshape(2, -1, 2, 8)
                assert torch.equal(torch.cat(got[s.request_id], dim=1), want)
        source.end()
        per_layer = sorted(map(tuple, copied[: len(copied) // cfg.num_layers]))
        # each shared chunk once; the own chunks and r2's chunks once each
        assert per_layer == sorted([(0, 1), (2, 3), (4,), (5, 6), (7, 8), (9,)])
    finally:
        backend.close()


def test_the_host_split_treats_a_shared_run_as_one_request():
    """Host attention's split, fraction 0.7: a run of chunks two requests of the step start
    with is one request to the splitter (the link carries it once, the host attends it once
    with both requests' queries): its whole leading chunks that fit the share go to the host
    for both sharers, the rest keeps its chunks for both; each request's own blocks split as
    before."""
    from specstream.config import EngineConfig
    from specstream.engine.contract import SeqWork
    from specstream.engine.policy.feedback import Estimates
    from specstream.engine.sched.host_split import MeasuredSplit, split_steps

    shared = ((0, 1), (2,))
    seqs = [SeqWork("a", (1,), 0, 0, False, True, 0, (), shared + ((3, 4), (5, 6))),
            SeqWork("b", (1,), 0, 0, False, True, 0, (), shared + ((7, 8),)),
            SeqWork("c", (1,), 0, 0, False, True, 0, (), ((9, 10), (11, 12)))]
    config = EngineConfig(mode="stream", host_attention="auto", host_attention_fraction=0.7)
    out, share = split_steps(seqs, MeasuredSplit(config, 1), Estimates(), 2, 2)
    # the shared run: 0.7 x 3 blocks = 2.1 holds its first chunk, (0, 1), for both
    assert [s.host_blocks for s in out] == [(0, 1, 3, 4, 5), (0, 1, 7, 8), (9, 10, 11)]
    assert [s.restore_chunks for s in out] == [((2,), (6,)), ((2,),), ((12,),)]
    assert [s.host_layers for s in out] == [(), (3, 4), ()]  # b's own share: 1 and 2 blocks
    assert [s.shared_chunks for s in out] == [1, 1, 0]
    assert share == pytest.approx((2.8 + 1.4 + 2.8 + 2 + 2) / 16)  # of every cold block


def test_a_layer_that_spills_keeps_the_shared_chunks_as_cut():
    """A layer that streams some of the host's share: without a shared run its link blocks
    are re-cut into full chunks (as before sharing); with one, the shared chunks stay the same
    blocks for every sharer and only the rest is re-cut."""
    from specstream.engine.contract import SeqWork

    base = SeqWork("a", (1,), 0, 0, False, True, 0, (), ((0, 1), (2,), (5, 6)),
                   host_blocks=(3, 4), host_layers=(2, 1))
    assert base.layer_chunks(0, 2) == ((0, 1), (2,), (5, 6))  # the host takes both
    assert base.layer_chunks(1, 2) == ((4, 0), (1, 2), (5, 6))  # re-cut from the spill
    shared = SeqWork("a", (1,), 0, 0, False, True, 0, (), ((0, 1), (2,), (5, 6)),
                     host_blocks=(3, 4), host_layers=(2, 1), shared_chunks=2)
    assert shared.layer_chunks(1, 2) == ((0, 1), (2,), (4, 5), (6,))
    assert [b for c in shared.layer_chunks(1, 2) for b in c] == sorted(
        shared.layer_link_blocks(1))


def test_the_host_share_of_a_shared_run_may_end_inside_a_chunk():
    """Half of a three-block shared run is one block on the host for both sharers; the chunk
    it came from keeps its tail, so both still stream the same chunks."""
    from specstream.config import EngineConfig
    from specstream.engine.contract import SeqWork
    from specstream.engine.policy.feedback import Estimates
    from specstream.engine.sched.host_split import MeasuredSplit, split_steps

    seqs = [SeqWork(r, (1,), 0, 0, False, True, 0, (), ((0, 1), (2,))) for r in "ab"]
    config = EngineConfig(mode="stream", host_attention="auto", host_attention_fraction=0.5)
    out, share = split_steps(seqs, MeasuredSplit(config, 1), Estimates(), 2, 2)
    assert [(s.host_blocks, s.restore_chunks, s.shared_chunks) for s in out] == [
        ((0,), ((1,), (2,)), 2)] * 2
    assert share == pytest.approx(2 / 6)
