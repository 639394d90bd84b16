"""Attention over cold history on the host CPU (host_attention): the host's partial results
merge exactly with the streamed waves, and greedy output equals target-only decoding in every
offloading mode whatever the split, including one that changes from step to step."""

from __future__ import annotations

import itertools

import pytest
import torch

from specstream import LLM, SamplingParams
from specstream.attention.reference import full_attention
from specstream.attention.waves import ATTENTION, WaveShape
from specstream.config import EngineConfig
from specstream.engine.llm_engine import LLMEngine
from specstream.engine.policy.round_shape import transfer_s
from specstream.engine.sched.host_split import by_layer, split_for_host

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def test_a_host_partial_merges_exactly_with_the_waves():
    """Keys split in two: one half as a wave on the device, the other as a host partial (the
    worker's math on the host tier's layout); merged they equal full attention."""
    from specstream.backends import make_backend
    from specstream.engine.exec.host_attention import HostAttention
    from specstream.kvcache.storage import KVStore
    from specstream.models.config import ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(family="qwen3", vocab_size=8, hidden_size=8, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=8,
                      max_position_embeddings=64)
    bs, p = 4, 3
    store = KVStore(cfg, torch.float32, bs, 4, 8, make_backend("cpu"))
    assert store.host is not None
    store.host.normal_()
    host_blocks = (5, 2, 7)
    k_host = store.host[1, 0, list(host_blocks)].reshape(-1, 2, 8)
    v_host = store.host[1, 1, list(host_blocks)].reshape(-1, 2, 8)
    k_dev, v_dev = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    q = torch.randn(1, p, 4, 8)
    scale = 8**-0.5
    want = full_attention(q[0], torch.cat([k_host, k_dev]), torch.cat([v_host, v_dev]),
                          scale=scale)
    host = HostAttention(store, threads=1)
    out_h, lse_h = host.submit(1, q, [host_blocks], scale).result()
    host.close()
    assert host.bytes == 2 * 3 * bs * 2 * 8 * 4 and host.rate > 0
    for name in ("torch",):
        att = ATTENTION.get(name)(q, 2, scale)
        att.add(k_dev[None], v_dev[None], WaveShape.build(None, [10], 10, None, "cpu"))
        att.add_partial(out_h, lse_h, None)
        torch.testing.assert_close(att.result()[0], want, atol=1e-5, rtol=1e-5)


OFFLOAD = dict(block_size=16, chunk_tokens=64, device_kv_bytes=600_000, resident_tail_tokens=32,
               residency="tail", offload_after_tokens=64)


@pytest.fixture(scope="module")
def reference(tiny_target):
    llm = LLM(tiny_target, mode="resident", device_kv_bytes=4_000_000, block_size=16)
    out = [o.outputs[0].token_ids for o in llm.generate(_prompts((300, 420, 200)), GREEDY,
                                                        use_tqdm=False)]
    llm.close()
    return out


class Split:
    """A host split given to the engine (its public seam): per step a share of every request's
    cold blocks from ``shares``, spread over the layers by ``layers`` (default: as the engine
    does); it counts the steps it split and records the per-layer counts it gave."""

    def __init__(self, shares, layers=None):
        self.shares, self.layers, self.calls, self.given = shares, layers, 0, []

    def counts(self, seqs, blocks, est):
        self.calls += 1
        share = next(self.shares)
        return [share * n for n in blocks]

    def by_layer(self, blocks, num_layers):
        out = (by_layer(blocks, num_layers) if self.layers is None
               else self.layers(blocks, num_layers))
        self.given.append(out)
        return out


def _generate(tiny_target, split=None, params=GREEDY, **kw):
    eng = LLMEngine(tiny_target, EngineConfig(**kw), host_split=split)
    try:
        plist = params if isinstance(params, list) else [params] * 3
        ids = [eng.add_request(p, s) for p, s in zip(_prompts((300, 420, 200)), plist)]
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        return [done[i] for i in ids], eng.get_metrics(), list(eng.rounds)
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["offload", "stream", "offload-spec", "specstream",
                                  "parallel-spec"])
@pytest.mark.parametrize("split", [dict(host_attention_fraction=0.5),
                                   dict(host_attention="auto", link_gbps=0.01)])
def test_greedy_output_equals_target_only_with_host_attention(tiny_target, reference, mode,
                                                              split):
    """Rounds with host work run their requests in two halves a layer apart (the device
    finishes one half's layer while the host attends the other's): checked to happen."""
    spec = {} if mode in ("stream", "offload") else dict(proposer="ngram")
    # room for the three requests at once (their cold history still streams: tail residency)
    got, m, rounds = _generate(tiny_target, mode=mode,
                               **{**OFFLOAD, "device_kv_bytes": 2_000_000}, **spec, **split)
    assert got == reference
    assert m["host_attention_bytes"] > 0 and m["host_attention_bytes_per_s"] > 0
    # the host took part of the cold history, the link the rest, in the same rounds
    shared = [r for r in rounds if r.host_bytes and r.history_bytes]
    assert shared
    assert any(r.halves == 2 for r in shared)  # a second half ran


def test_a_split_that_changes_every_step_stays_exact(tiny_target, reference):
    split = Split(itertools.cycle([0.0, 1.0, 0.5, 0.25, 0.75]))
    got, m, _ = _generate(tiny_target, split, mode="specstream", proposer="ngram",
                          host_attention="auto", **OFFLOAD)
    assert got == reference
    assert split.calls > 5 and m["host_attention_bytes"] > 0  # the host did attend


@pytest.mark.parametrize("mode", ["offload", "stream", "offload-spec", "specstream",
                                  "parallel-spec"])
@pytest.mark.parametrize("residency", ["tail", "fill"])
def test_a_split_that_changes_from_layer_to_layer_stays_exact(tiny_target, reference, mode,
                                                              residency):
    """Each layer attends a different number of each request's oldest cold blocks on the host
    (none in some layers, all in others), changing from step to step too; the rest of each
    layer streams or is restored (under fill, promoted on the way)."""
    steps = itertools.count()

    def pattern(blocks, layers):
        n, t = int(blocks), next(steps)
        return tuple((layer * 3 + t) % (n + 1) for layer in range(layers))

    split = Split(itertools.repeat(0.7), pattern)
    spec = {} if mode in ("stream", "offload") else dict(proposer="ngram")
    # the short request ends first: under fill the others' shares grow (promotions)
    params = [GREEDY, GREEDY, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]
    got, m, _ = _generate(tiny_target, split, params, mode=mode, host_attention="auto",
                          **{**OFFLOAD, "residency": residency, "device_kv_bytes": 900_000},
                          **spec)
    assert got == [*reference[:2], reference[2][:4]]
    assert any(len(set(g)) > 1 for g in split.given)  # the layers did differ
    assert m["host_attention_bytes"] > 0
    assert (m["promoted_blocks"] > 0) == (residency == "fill")


def test_a_fractional_share_alternates_between_block_counts_by_layer():
    assert by_layer(3.0, 6) == (3,) * 6
    split = by_layer(2.5, 6)
    assert set(split) == {2, 3} and sum(split) == 15
    assert sum(by_layer(0.2, 6)) == 1 and by_layer(0.0, 4) == (0, 0, 0, 0)


def test_an_emulated_host_rate_is_never_beaten():
    """host_attention_gbps paces the workers like the emulated link: the measured rate stays
    at or under it (a lower bound on each job's time, so a slow machine cannot break it)."""
    from specstream.backends import make_backend
    from specstream.engine.exec.host_attention import HostAttention
    from specstream.kvcache.storage import KVStore
    from specstream.models.config import ModelConfig

    cfg = ModelConfig(family="qwen3", vocab_size=8, hidden_size=8, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=8,
                      max_position_embeddings=64)
    store = KVStore(cfg, torch.float32, 4, 4, 8, make_backend("cpu"))
    host = HostAttention(store, threads=1, emulate_gbps=0.001)  # 1 MB/s
    q = torch.randn(1, 2, 4, 8)
    jobs = [host.submit(layer % 2, q, [(0, 1, 2)], 0.3) for layer in range(4)]
    for job in jobs:
        host.collect(job)
    host.close()
    assert host.bytes == 4 * 2 * 3 * 4 * 2 * 8 * 4
    assert 0 < host.rate <= 1e6 * 1.001
    with pytest.raises(ValueError, match="host_attention_gbps"):
        EngineConfig(host_attention_gbps=0.0)


def test_host_attention_options_are_validated():
    with pytest.raises(ValueError, match="host_attention must be"):
        EngineConfig(host_attention="cpu")
    with pytest.raises(ValueError, match="host_attention_fraction"):
        EngineConfig(host_attention_fraction=1.5)
    assert not EngineConfig(mode="resident", host_attention="auto").host_attends
    assert EngineConfig(mode="stream", host_attention="auto").host_attends


def test_auto_gives_the_host_nothing_where_the_round_is_compute_bound(tiny_target, reference):
    """Copies at memory speed: streaming every cold block takes less than the round's
    compute, so auto stops giving the host a share after the first decode round."""
    llm = LLM(tiny_target, mode="specstream", proposer="ngram", host_attention="auto",
              **{**OFFLOAD, "link_gbps": 1000.0})
    got = [o.outputs[0].token_ids for o in llm.generate(_prompts((300, 420, 200)), GREEDY,
                                                        use_tqdm=False)]
    m = llm.get_metrics()
    llm.close()
    assert got == reference
    assert m["host_attention_share"] == 0.0


def test_the_bench_runs_host_attention_and_reports_its_rate(tiny_target, tiny_draft, tmp_path):
    import json

    from specstream.cli import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", str(tiny_target), "--draft-model", str(tiny_draft),
               "--modes", "specstream", "--context-len", "300", "--num-requests", "2",
               "--output-len", "8", "--device-kv-bytes", "900000", "--chunk-tokens", "128",
               "--block-size", "16", "--resident-tail-tokens", "32", "--residency", "tail",
               "--offload-after-tokens", "64", "--link-gbps", "0.05", "--host-attention",
               "auto", "--host-attention-gbps", "0.5", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    m = report["modes"]["specstream"]
    assert m["outputs_match_reference"] is True
    assert m["host_attention_bytes"] > 0 and m["host_attention_bytes_per_s"] > 0
    assert m["link_bytes_per_s"] == 0.05e9 and "--host-attention" in report["command"]
    # the emulated host rate is a ceiling on the measured one
    assert m["host_attention_bytes_per_s"] <= 0.5e9 * 1.001
    assert "--host-attention-gbps" in report["command"]


def test_the_split_lets_link_and_host_finish_together():
    """Cheapest bytes first (fewest query positions), until the host's time (its idle device
    time included) meets the link's; what is left of the link then matches."""
    block, link = 1000, 1e6  # 1 ms a block over the link
    # request 0 verifies (host 0.1 ms a block), request 1 prefills (host 2 ms a block)
    counts = split_for_host([200, 40], [1e-7, 2e-6], block, link, serial_s=0.15)
    assert 0 < counts[0] < 200 and counts[1] == 0  # the prefill chunk's stays on the link
    link_s = (240 - counts[0]) * block / link
    host_s = 0.15 + counts[0] * block * 1e-7
    assert abs(link_s - host_s) <= block * (1 / link + 1e-7)
    # a faster host takes all of the cheap request and some of the other
    counts = split_for_host([40, 40], [1e-7, 2e-6], block, link, serial_s=0.011)
    assert counts[0] == 40 and 0 < counts[1] < 40
    # a host that is idle for longer than the link takes gets nothing
    assert split_for_host([10], [1e-7], block, link, serial_s=0.02) == [0]
    # transfer_s: the same balance as a time, never worse than the link alone
    t = transfer_s(240 * block, link, 1e-7, 0.15)
    assert t == pytest.approx(host_s, abs=1e-3) and t < 240 * block / link
    assert transfer_s(10 * block, link, 1e-7, 0.02) == 10 * block / link
    assert transfer_s(10 * block, link, 0.0, 0.0) == 10 * block / link


def test_host_cost_grows_with_query_positions_and_trees_pay_for_it():
    """The worker's cost per byte is a line in query positions per request; the round-shape
    cost model puts it in the round's history time, so a tree's positions cost host time."""
    from specstream.engine.policy.round_shape import RoundCosts, Shape

    costs = RoundCosts(link_s=1.0, cold_bytes=1e8, link_bps=1e8, host_s_per_byte=1e-10,
                       host_s_per_byte_per_position=1e-10, host_serial_s=0.0)
    chain, tree = Shape(2), Shape(4, topk=4, nodes=32)
    assert costs.history_s(chain, 1) < costs.history_s(tree, 1) < 1.0
    assert RoundCosts(link_s=1.0).history_s(tree, 1) == 1.0  # no host: the link's time
