"""`specstream`'s two groups merge into one where verification hides the link and stay two
where the link dominates (issue 30, item 2); greedy output equal to target-only decoding
either way."""

from __future__ import annotations

import pytest
import torch

from specstream import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# the link alone carries the history: host attention would read a slow link's share where it
# lives, and rounds whose host is faster than their verification merge (tests/test_feedback.py)
OFFLOAD = dict(block_size=16, chunk_tokens=64, device_kv_bytes=700_000, resident_tail_tokens=32,
               residency="tail", offload_after_tokens=64, max_prefill_tokens=128,
               host_attention="off")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in (300, 420, 200, 350)]


def _run(folder, **kw):
    llm = LLM(folder, **kw)
    try:
        out = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY,
                                                            use_tqdm=False)]
        return out, llm.get_metrics()
    finally:
        llm.close()


@pytest.fixture(scope="module")
def reference(tiny_target):
    return _run(tiny_target, mode="resident", device_kv_bytes=4_000_000, block_size=16)[0]


def test_a_fast_link_merges_the_groups(tiny_target, reference):
    """History over a link far faster than verification: rounds verify every request."""
    got, m = _run(tiny_target, mode="specstream", proposer="ngram", link_gbps=50.0, **OFFLOAD)
    assert got == reference
    assert m["merged_group_steps"] > 0
    assert m["link_bytes_per_round"] > 0  # history did stream


def test_a_slow_link_keeps_two_groups(tiny_target, reference):
    got, m = _run(tiny_target, mode="specstream", proposer="ngram", link_gbps=0.005,
                  **OFFLOAD)
    assert got == reference
    assert m["merged_group_steps"] == 0


def test_parallel_spec_never_merges(tiny_target, reference):
    """Its drafts run on a second device: off the round's path whatever the link."""
    got, m = _run(tiny_target, mode="parallel-spec", proposer="ngram", link_gbps=50.0,
                  **OFFLOAD)
    assert got == reference
    assert m["merged_group_steps"] == 0


def test_merging_can_be_turned_off(tiny_target, reference):
    """merge_groups=False (bench: --no-merge-groups): two groups whatever the link."""
    from specstream.cli import build_parser

    got, m = _run(tiny_target, mode="specstream", proposer="ngram", link_gbps=50.0,
                  merge_groups=False, **OFFLOAD)
    assert got == reference and m["merged_group_steps"] == 0
    args = build_parser().parse_args(["bench", "--no-merge-groups"])
    assert args.no_merge_groups


def _shared_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    doc = torch.randint(0, 128, (320,), generator=g).tolist()
    return [doc + torch.randint(0, 128, (16 + 8 * i,), generator=g).tolist() for i in range(4)]


@pytest.mark.parametrize("sharing", [True, False])
def test_a_document_both_groups_read_merges_them(tiny_target, sharing):
    """A slow link, every request reading one shared document: two groups would move it twice
    a period, more link time than drafting after a merged round costs, so they merge; without
    sharing each request moves its own copy either way, and the groups stay two."""
    prompts = _shared_prompts()
    ref = LLM(tiny_target, mode="resident", device_kv_bytes=4_000_000, block_size=16)
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        ref.close()
    llm = LLM(tiny_target, mode="specstream", proposer="ngram", link_gbps=0.005,
              prefix_sharing=sharing, **{**OFFLOAD, "device_kv_bytes": 1_500_000})  # 4 at once
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        m = llm.get_metrics()
    finally:
        llm.close()
    assert got == want
    assert m["max_concurrency"] == 4
    assert (m["merged_group_steps"] > 0) is sharing
