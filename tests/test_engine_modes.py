"""Every mode and proposer produces target-only greedy output, token for token."""

from __future__ import annotations

import pytest
import torch

from specstream import LLM, SamplingParams

# KV of the tiny target: 8 layers x 2 kv heads x 16 dims x (K, V) x 4 B = 2 KiB per token.
TOKEN_BYTES = 2048
OFFLOAD = dict(block_size=16, chunk_tokens=64, resident_tail_tokens=32, offload_after_tokens=64,
               max_prefill_tokens=64)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def _run(folder, prompts, **kw) -> tuple[list[list[int]], dict]:
    llm = LLM(folder, **kw)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.get_metrics()
    finally:
        llm.close()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompts((5, 300, 1200))


@pytest.fixture(scope="module")
def reference(tiny_target, prompts) -> list[list[int]]:
    """Target-only greedy decoding with everything resident."""
    tokens, _ = _run(tiny_target, prompts, mode="resident", device_kv_bytes=16 << 20)
    return tokens


@pytest.mark.parametrize("mode", ["offload", "stream"])
def test_offloaded_autoregressive_equals_resident(tiny_target, prompts, reference, mode):
    # the 1200-token prompt's history is 2.4 MB; the device budget is 1 MB
    budget = 1_000_000 if mode == "stream" else 1_600_000
    tokens, m = _run(tiny_target, prompts, mode=mode, device_kv_bytes=budget, **OFFLOAD)
    assert tokens == reference
    assert m["device_kv_peak_bytes"] <= budget
    longest = max(len(p) for p in prompts)
    assert m["host_kv_peak_bytes"] >= (longest - 128) * TOKEN_BYTES  # history really offloaded
    assert m["link_bytes_h2d"] > 0 and m["link_bytes_d2h"] > 0


def test_stream_handles_history_several_times_the_budget(tiny_target, reference, prompts):
    budget = 600_000  # a quarter of the longest history
    tokens, m = _run(tiny_target, prompts, mode="stream", device_kv_bytes=budget, **OFFLOAD)
    assert tokens == reference
    assert m["device_kv_peak_bytes"] <= budget


@pytest.mark.parametrize("q", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_speculative_resident_equals_target_only(tiny_target, tiny_draft, prompts, reference,
                                                 proposer, q):
    kw = dict(draft_model=tiny_draft) if proposer == "draft" else dict(proposer="ngram")
    tokens, m = _run(tiny_target, prompts, mode="resident", device_kv_bytes=16 << 20,
                     num_speculative_tokens=q, **kw)
    assert tokens == reference
    assert m["proposed_tokens"] > 0
    assert m["rounds"] > 0


@pytest.mark.parametrize("mode", ["offload-spec", "specstream"])
@pytest.mark.parametrize("q", [1, 4, 8])
def test_speculative_offloaded_equals_target_only(tiny_target, tiny_draft, prompts, reference,
                                                  mode, q):
    tokens, m = _run(tiny_target, prompts, mode=mode, device_kv_bytes=1_600_000,
                     draft_model=tiny_draft, num_speculative_tokens=q, **OFFLOAD)
    assert tokens == reference
    assert m["device_kv_peak_bytes"] <= 1_600_000
    assert m["link_bytes_h2d"] > 0


def test_draft_equal_to_target_accepts_everything(tiny_target, prompts, reference):
    """With the target as its own draft (full cache) every draft is accepted."""
    tokens, m = _run(tiny_target, prompts[:2], mode="resident", device_kv_bytes=16 << 20,
                     draft_model=tiny_target, num_speculative_tokens=4, draft_cache="full",
                     speculative_policy="fixed")
    assert tokens == reference[:2]
    assert m["acceptance_rate"] == 1.0
    assert m["mean_accepted_len"] > 4.0


@pytest.mark.parametrize("mode", ["specstream", "parallel-spec"])
def test_overlapped_modes_two_groups(tiny_target, tiny_draft, reference, mode):
    """Eight requests: two groups alternate verify and draft; output still target-only greedy."""
    prompts = _prompts((5, 300, 1200)) + _prompts((40, 90, 200, 260, 700), seed=1)
    ref_tail, _ = _run(tiny_target, prompts[3:], mode="resident", device_kv_bytes=16 << 20)
    tokens, m = _run(tiny_target, prompts, mode=mode, device_kv_bytes=1_600_000,
                     draft_model=tiny_draft, num_speculative_tokens=3, link_gbps=2.0, **OFFLOAD)
    assert tokens == reference + ref_tail
    assert m["rounds"] > 0 and m["link_utilization"] > 0
    # no decode step moves its bytes faster than the emulated link's rate
    assert m["decode_link_floor_s"] > 0 and m["decode_time_over_link_floor"] >= 0.999


def test_restore_room_is_reserved_up_to_the_guaranteed_room(tiny_target, tiny_draft):
    """Restore modes reserve pool blocks for two layers of the admitted requests' history, but
    together no more than the room the budget guarantees (beyond it, layers come in pieces):
    a budget that once held one such request at a time holds both, stays within the budget
    (restored layers included), and both decode exactly; a budget too small for one is refused
    with the reason."""
    prompts = _prompts((600, 580), seed=5)
    ref, _ = _run(tiny_target, prompts, mode="resident", device_kv_bytes=16 << 20)
    kw = dict(mode="offload-spec", draft_model=tiny_draft, num_speculative_tokens=3,
              speculative_topk=1, block_size=16, chunk_tokens=64, resident_tail_tokens=32,
              offload_after_tokens=64, max_prefill_tokens=32, residency="tail")
    tokens, m = _run(tiny_target, prompts, device_kv_bytes=1_000_000, **kw)
    assert tokens == ref
    assert m["max_concurrency"] == 2 and m["device_kv_peak_bytes"] <= 1_000_000
    with pytest.raises(ValueError, match="room for its restored history"):
        _run(tiny_target, prompts, device_kv_bytes=400_000, **kw)
    # `fill` reserves only the resident tail beyond the restore room: both fit at once, and
    # the restored layers still stay within the budget
    tokens, m = _run(tiny_target, prompts, device_kv_bytes=1_000_000, **{**kw, "residency": "fill"})
    assert tokens == ref
    assert m["max_concurrency"] == 2 and m["device_kv_peak_bytes"] <= 1_000_000
