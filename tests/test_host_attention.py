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
from specstream.engine.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def test_a_host_partial_merges_exactly_with_the_waves():
    """Keys split in two: one half as a wave on the device, the other as a host partial (the
    worker's math on the host tier's layout); merged they equal full attention."""
    from specstream.backends import make_backend
    from specstream.engine.host_attention import HostAttention
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


@pytest.mark.parametrize("mode", ["offload", "stream", "offload-spec", "specstream",
                                  "parallel-spec"])
@pytest.mark.parametrize("split", [dict(host_attention_fraction=0.5),
                                   dict(host_attention="auto", link_gbps=0.01)])
def test_greedy_output_equals_target_only_with_host_attention(tiny_target, reference, mode,
                                                              split):
    spec = {} if mode in ("stream", "offload") else dict(proposer="ngram")
    llm = LLM(tiny_target, mode=mode, **OFFLOAD, **spec, **split)
    got = [o.outputs[0].token_ids for o in llm.generate(_prompts((300, 420, 200)), GREEDY,
                                                        use_tqdm=False)]
    m = llm.get_metrics()
    llm.close()
    assert got == reference
    assert m["host_attention_bytes"] > 0 and m["host_attention_bytes_per_s"] > 0
    assert 0 < m["host_attention_share"] < 1


def test_a_split_that_changes_every_step_stays_exact(tiny_target, reference, monkeypatch):
    shares = itertools.cycle([0.0, 1.0, 0.5, 0.25, 0.75])
    monkeypatch.setattr(Scheduler, "host_share", property(lambda self: next(shares)))
    llm = LLM(tiny_target, mode="specstream", proposer="ngram", host_attention="auto", **OFFLOAD)
    got = [o.outputs[0].token_ids for o in llm.generate(_prompts((300, 420, 200)), GREEDY,
                                                        use_tqdm=False)]
    llm.close()
    assert got == reference


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
               "auto", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    m = report["modes"]["specstream"]
    assert m["outputs_match_reference"] is True
    assert m["host_attention_bytes"] > 0 and m["host_attention_bytes_per_s"] > 0
    assert m["link_bytes_per_s"] == 0.05e9 and "--host-attention" in report["command"]
