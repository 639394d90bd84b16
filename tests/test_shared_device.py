"""Prefix sharing under `fill`: one device copy of a shared run serves all its sharers
(kvcache/shared_device.py). Outputs equal `resident`'s in every offloading mode, chains, trees
and host attention; once the document is on the device the rounds stream none of it; a budget
that holds only part of it keeps its oldest blocks there and streams the rest; the copies are
bitwise the host's blocks, and none outlives its readers."""

# ruff: noqa: F811  (the tests take the imported fixture as an argument)
from __future__ import annotations

from typing import Any

import pytest
import torch
from test_prefix_sharing import GREEDY, OFFLOAD, _prompts, resident_out  # noqa: F401

from specstream import LLM, SamplingParams
from specstream.kvcache.blocks import CopyKind

FILL = dict(OFFLOAD, residency="fill", device_kv_bytes=1_500_000)  # the unique KV fits
MODES = {
    "offload": {}, "stream": {}, "offload-spec": dict(proposer="ngram"),
    "parallel-spec": dict(proposer="ngram"), "specstream": dict(proposer="ngram"),
    "specstream-host": dict(proposer="ngram", host_attention="auto",
                            host_attention_fraction=0.5),
}


class Watch:
    """Each step's plan: its shared-block placements, and the history its requests stream."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.steps, self.held, self.copied = llm, [], {}, 0
        self.real, llm.engine.scheduler.schedule = llm.engine.scheduler.schedule, self.schedule

    def schedule(self, est: Any = None) -> Any:
        plan = self.real(est)
        shared = self.llm.engine.kv.shared
        # the shared blocks newly held this step: copied from the host, or taken over from
        # the first sharer's window
        placed = [(h, d) for h, (d, _) in shared.copies.items() if h not in self.held]
        self.held = dict(shared.copies)
        streamed = sum(len(c) for s in plan.seqs for c in s.restore_chunks)
        self.steps.append((placed, streamed, shared.held))
        copied = {h for k, h, _ in plan.cache_copies if k is CopyKind.HOST_TO_DEVICE}
        self.copied += len(copied)
        return plan


def _run(path: Any, case: str, **kw: Any) -> tuple[list[list[int]], dict[str, Any], Watch]:
    mode = case.split("-host")[0]
    llm = LLM(path, mode=mode, **{**FILL, **MODES[case], **kw})
    watch = Watch(llm)
    try:
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.get_metrics(), watch
    finally:
        llm.close()


@pytest.mark.parametrize("case", list(MODES))
def test_a_shared_document_is_held_once_and_not_streamed(tiny_target, resident_out, case):
    out, m, watch = _run(tiny_target, case)
    assert out == resident_out
    placed = [p for step in watch.steps for p in step[0]]
    doc_blocks = 300 // OFFLOAD["block_size"]
    assert len(placed) == len({h for h, _ in placed}) <= doc_blocks  # each block once
    assert max(held for _, _, held in watch.steps) >= doc_blocks - 2
    last = max(i for i, step in enumerate(watch.steps) if step[0])
    # once the document is placed the sharers' rounds stream nothing
    running = [i for i, (_, _, held) in enumerate(watch.steps) if i > last and held]
    assert running and all(watch.steps[i][1] == 0 for i in running)
    assert m["device_kv_blocks_used"] == 0  # the copies went with their last reader
    # the first sharer's window still held the document when the others joined: taken over
    # as it was, nothing copied from the host
    assert watch.copied == 0


def test_without_sharing_nothing_is_held_for_all(tiny_target, resident_out):
    llm = LLM(tiny_target, mode="specstream", proposer="ngram", prefix_sharing=False, **FILL)
    try:
        assert llm.engine.kv.shared is None
        assert [o.outputs[0].token_ids
                for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)] == resident_out
    finally:
        llm.close()


def test_trees_read_the_shared_copy(tiny_target, tiny_draft, resident_out):
    out, _, watch = _run(tiny_target, "specstream", proposer="draft",
                         draft_model=tiny_draft, speculative_topk=2,
                         speculative_num_draft_tokens=6, num_speculative_tokens=3)
    assert out == resident_out
    assert any(step[0] for step in watch.steps)


def test_a_budget_short_of_the_document_holds_its_oldest_blocks(tiny_target, resident_out):
    """Room for about half the document beside the tails: its oldest blocks stay on the device
    (for every sharer), the rest streams once a round."""
    out, m, watch = _run(tiny_target, "specstream", device_kv_bytes=900_000)
    assert out == resident_out
    held = max(h for _, _, h in watch.steps)
    assert 0 < held < 300 // OFFLOAD["block_size"]
    assert watch.copied > 0  # the window had let the document go: copied back once
    assert any(streamed for _, streamed, h in watch.steps if h)
    assert m["link_bytes_per_round"] <= 1.15 * m["link_bytes_unique_per_round"]


@pytest.mark.parametrize("budget", [1_500_000, 900_000])
def test_the_device_copy_is_bitwise_the_host_block(tiny_target, budget):
    """After every step, each held copy (taken over from a window, or copied from the host)
    equals the host's block bit for bit."""
    llm = LLM(tiny_target, mode="specstream", proposer="ngram", **{**FILL,
                                                                     "device_kv_bytes": budget})
    eng, seen = llm.engine, []
    real = eng.worker.run

    def run(plan: Any, *args: Any) -> Any:
        out = real(plan, *args)
        for h, (d, _) in eng.kv.shared.copies.items():
            seen.append(torch.equal(eng.store.device[:, :, d], eng.store.host[:, :, h]))
        return out

    eng.worker.run = run
    try:
        llm.generate(_prompts(), GREEDY, use_tqdm=False)
    finally:
        llm.close()
    assert seen and all(seen)


def test_a_sharer_that_ends_first_leaves_the_others_on_the_copy(tiny_target):
    prompts = _prompts()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 12, 12, 12)]
    ref = LLM(tiny_target, mode="resident", block_size=16, device_kv_bytes=4_000_000)
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    finally:
        ref.close()
    llm = LLM(tiny_target, mode="specstream", proposer="ngram", **FILL)
    watch = Watch(llm)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert llm.get_metrics()["device_kv_blocks_used"] == 0
    finally:
        llm.close()
    assert any(held for _, _, held in watch.steps)
