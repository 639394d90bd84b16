"""No single request can kill or hang the engine; speculation is never silently off."""

from __future__ import annotations

import pytest
import torch

from specstream import LLM, SamplingParams
from specstream.config import (
    AUTO_MAX_DEPTH,
    CPU_DEVICE_KV_BYTES,
    DEFAULT_TREE_NODES,
    DEFAULT_TREE_TOPK,
    EngineConfig,
    spare_host_cores,
)
from specstream.sampling_params import derive_seed

OFFLOAD = dict(block_size=16, chunk_tokens=64, resident_tail_tokens=32, offload_after_tokens=64,
               max_prefill_tokens=64, device_kv_bytes=1_600_000)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MAX_STEPS = 400  # far more than any request here needs: a hang fails instead of spinning


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def _drive(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, object]:
    """Add requests and step until they finish (bounded); final outputs by request id."""
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p, sp in requests]
    final: dict[str, object] = {}
    for _ in range(MAX_STEPS):
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        if all(i in final for i in ids):
            return {i: final[i] for i in ids}
    raise AssertionError(f"requests did not finish in {MAX_STEPS} steps: no progress")


def _tokens(out) -> list[int]:
    return out.outputs[0].token_ids


@pytest.fixture(scope="module")
def reference(tiny_target) -> list[list[int]]:
    llm = LLM(tiny_target, mode="resident", device_kv_bytes=16 << 20)
    try:
        outs = llm.generate(_prompts((1, 200, 300)), GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.close()


@pytest.mark.parametrize("mode", ["specstream", "parallel-spec", "offload-spec", "resident"])
@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_one_token_prompt_finishes(tiny_target, tiny_draft, reference, mode, proposer):
    """A one-token prompt used to wait forever in the two-group modes (never prefilled, so
    never put into a group)."""
    kw = dict(draft_model=tiny_draft) if proposer == "draft" else dict(proposer="ngram")
    llm = LLM(tiny_target, mode=mode, num_speculative_tokens=3, **OFFLOAD, **kw)
    try:
        alone = _drive(llm, [(_prompts((1,))[0], GREEDY)])
        assert [_tokens(o) for o in alone.values()] == reference[:1]
        mixed = _drive(llm, [(p, GREEDY) for p in _prompts((1, 200, 300))])
        assert [_tokens(o) for o in mixed.values()] == reference
    finally:
        llm.close()


def test_seed_at_the_top_of_the_range_samples_with_a_draft(tiny_target, tiny_draft):
    """seed = 2**64 - 1 with sampling used to overflow the draft's derived seed and kill the
    engine; derived seeds now wrap."""
    params = SamplingParams(temperature=0.8, seed=(1 << 64) - 1, max_tokens=12, ignore_eos=True,
                            n=2)
    llm = LLM(tiny_target, mode="specstream", draft_model=tiny_draft, num_speculative_tokens=3,
              **OFFLOAD)
    try:
        out = llm.generate(_prompts((80,)), params, use_tqdm=False)[0]
        assert [o.finish_reason for o in out.outputs] == ["length", "length"]
        again = llm.generate(_prompts((80,)), params, use_tqdm=False)[0]
        assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    finally:
        llm.close()
    assert derive_seed((1 << 64) - 1, 1) == 0


def test_a_request_error_fails_that_request_alone(tiny_target, tiny_draft, reference,
                                                  monkeypatch):
    """A failure that belongs to one request (here: its draft generator cannot be seeded, as
    before derived seeds wrapped) fails it with a message; the others decode exactly."""
    import specstream.spec.draft as draft_module

    monkeypatch.setattr(draft_module, "derive_seed", lambda seed, offset: seed + offset)
    llm = LLM(tiny_target, mode="specstream", draft_model=tiny_draft, num_speculative_tokens=3,
              **OFFLOAD)
    try:
        bad = SamplingParams(temperature=0.8, seed=(1 << 64) - 1, max_tokens=12)
        prompts = _prompts((1, 200, 300))
        outs = list(_drive(llm, [(prompts[0], bad), (prompts[1], GREEDY),
                                 (prompts[2], GREEDY)]).values())
        assert outs[0].outputs[0].finish_reason == "error"
        assert "draft generator" in outs[0].outputs[0].error
        assert [_tokens(o) for o in outs[1:]] == reference[1:]
        m = llm.get_metrics()
        assert m["device_kv_blocks_used"] == 0 and m["host_kv_blocks_used"] == 0
    finally:
        llm.close()


@pytest.mark.parametrize("mode", ["specstream", "parallel-spec", "offload"])
def test_a_failed_round_fails_its_requests_and_the_engine_goes_on(
        tiny_target, tiny_draft, reference, mode, monkeypatch):
    """Any other error inside a round fails the round's requests (KV freed, error reported)
    and the engine carries on with the rest and with new requests."""
    kw = dict(draft_model=tiny_draft, num_speculative_tokens=3) if mode != "offload" else {}
    llm = LLM(tiny_target, mode=mode, **OFFLOAD, **kw)
    eng = llm.engine
    real_run, calls, failed_plan = eng.worker.run, [0], []

    def flaky_run(plan, *args):
        calls[0] += 1
        if calls[0] == 3:
            failed_plan.extend(plan.request_ids)
            raise RuntimeError("injected device fault")
        return real_run(plan, *args)

    monkeypatch.setattr(eng.worker, "run", flaky_run)
    try:
        prompts = _prompts((1, 200, 300))
        outs = _drive(llm, [(p, GREEDY) for p in prompts])
        failed = {rid for rid, o in outs.items() if o.outputs[0].finish_reason == "error"}
        assert failed_plan and set(failed_plan) == failed  # the round's requests, and only they
        assert len(failed) < len(prompts)  # and not every request
        for rid in failed:
            assert "injected device fault" in outs[rid].outputs[0].error
        for (rid, o), ref in zip(outs.items(), reference):
            if rid not in failed:
                assert _tokens(o) == ref
        m = llm.get_metrics()
        assert m["device_kv_blocks_used"] == 0 and m["host_kv_blocks_used"] == 0
        assert not eng.scheduler.requests  # nothing left behind
        later = _drive(llm, [(p, GREEDY) for p in prompts])  # the engine still serves
        assert [_tokens(o) for o in later.values()] == reference
    finally:
        llm.close()


@pytest.mark.parametrize("mode", ["specstream", "offload-spec", "stream"])
def test_a_round_failing_part_way_reports_its_own_error(tiny_target, tiny_draft, reference,
                                                        mode, monkeypatch):
    """A fault in the middle of the layer loop (waves issued, not all consumed) fails the round
    with that fault's message (not the history source's own clean-up check), and the next
    rounds stream correctly."""
    kw = dict(draft_model=tiny_draft, num_speculative_tokens=3) if mode != "stream" else {}
    llm = LLM(tiny_target, mode=mode, **OFFLOAD, **kw, residency="tail")  # history streams
    history = llm.engine.worker.history
    real, calls = history.landed, [0]

    def flaky_landed(wave):
        calls[0] += 1
        if calls[0] == 10:
            raise RuntimeError("injected fault mid-round")
        return real(wave)

    monkeypatch.setattr(history, "landed", flaky_landed)
    try:
        outs = _drive(llm, [(p, GREEDY) for p in _prompts((1, 200, 300))])
        errors = [o.outputs[0].error for o in outs.values()
                  if o.outputs[0].finish_reason == "error"]
        assert calls[0] >= 10 and errors
        assert all("injected fault mid-round" in e for e in errors), errors
        later = _drive(llm, [(p, GREEDY) for p in _prompts((1, 200, 300))])
        assert [_tokens(o) for o in later.values()] == reference
        assert calls[0] > 10  # streamed again
    finally:
        llm.close()


def test_speculative_counters(tiny_target, tiny_draft):
    llm = LLM(tiny_target, mode="resident", device_kv_bytes=16 << 20, draft_model=tiny_draft,
              num_speculative_tokens=3)
    try:
        llm.generate(_prompts((50, 90)), GREEDY, use_tqdm=False)
        m = llm.get_metrics()
    finally:
        llm.close()
    assert m["num_drafts"] > 0 and m["proposed_tokens"] >= m["num_drafts"]
    per_pos = m["accepted_per_pos"]
    assert sum(per_pos) == m["accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # a later draft needs the earlier
    assert per_pos[0] <= m["num_drafts"]


# ---- speculation never silently off -------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="offload", proposer="ngram"), "does not speculate"),
    (dict(mode="stream", proposer="ngram", num_speculative_tokens=4), "does not speculate"),
    (dict(mode="resident", num_speculative_tokens=4), "needs a proposer"),
    (dict(mode="specstream"), "needs a proposer"),
    (dict(mode="offload-spec", num_speculative_tokens=0), "needs a proposer"),
    (dict(proposer="ngram", num_speculative_tokens=0), "would never draft"),
])
def test_config_refuses_speculation_it_would_not_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_a_proposer_without_q_drafts_four_fixed_and_up_to_eight_auto():
    assert EngineConfig(proposer="ngram", speculative_policy="fixed").q == 4
    auto = EngineConfig(proposer="ngram")
    assert auto.policy == "auto" and auto.q == AUTO_MAX_DEPTH == 8 and auto.fixed_depth == 4
    assert not auto.tree  # the n-gram proposer drafts chains
    assert EngineConfig().q == 0


def test_the_default_mode_streams_and_speculates_where_it_can():
    assert EngineConfig().mode == "stream" and not EngineConfig().speculative
    cfg = EngineConfig(proposer="draft", draft_model="d")
    assert cfg.mode == "specstream" and cfg.policy == "auto"
    # trees are the policy's to choose, within the documented limits
    assert cfg.trees_by_default and cfg.topk == DEFAULT_TREE_TOPK == 4
    assert cfg.num_draft_tokens == DEFAULT_TREE_NODES == 32 and cfg.verify_tokens == 33
    chain = EngineConfig(proposer="draft", draft_model="d", speculative_topk=1)
    assert not chain.tree and chain.num_draft_tokens == 8
    fixed = EngineConfig(proposer="draft", draft_model="d", speculative_policy="fixed")
    assert not fixed.tree and fixed.q == 4
    assert EngineConfig(device="cpu").device_budget() == CPU_DEVICE_KV_BYTES
    cuda = EngineConfig(device="cuda", gpu_memory_utilization=0.5)
    assert cuda.device_budget(8 << 30) == 4 << 30
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_host_attention_is_auto_where_the_engine_leaves_cores(monkeypatch):
    import os

    for cores in (1, 2, 3, 16):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        # the cpu backend's compute threads idle while a round waits on the link: only the
        # copy thread counts; on CUDA the driver thread and the copy thread
        assert EngineConfig().host_attention == ("auto" if cores >= 2 else "off")
        assert spare_host_cores() == cores - 1
        assert spare_host_cores("cuda") == max(0, cores - 2)
    assert EngineConfig(host_attention="off").host_attention == "off"


def test_embedded_target_speculates_when_asked():
    """`LLM(mode="specstream", num_speculative_tokens=4)` and `LLM(proposer="ngram")` on the
    embedded target used to run without speculation; now they draft."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for kwargs, proposer in [(dict(mode="specstream", num_speculative_tokens=4), "draft"),
                             (dict(mode="specstream"), "draft"), ({}, "draft"),
                             (dict(proposer="ngram"), "ngram")]:
        llm = LLM(**kwargs)
        try:
            assert llm.config.proposer == proposer and llm.config.mode == "specstream"
            assert llm.config.q == (4 if kwargs.get("num_speculative_tokens") else 8)
            llm.generate(["def f(x):\n    return x\n" * 4], params, use_tqdm=False)
            assert llm.get_metrics()["proposed_tokens"] > 0
        finally:
            llm.close()


def test_embedded_defaults_offload_past_a_quarter_of_the_context():
    llm = LLM(mode="stream")
    try:
        assert llm.engine.max_model_len == 8192
        assert llm.engine.kv.policy.offload_after_tokens == 2048
    finally:
        llm.close()


# ---- clear errors ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens="5"), "max_tokens must be an integer, got str"),
    (dict(temperature="0.5"), "temperature must be a number"),
    (dict(n=True), "n must be an integer, got bool"),
    (dict(seed=1 << 64), "seed must be in"),
    (dict(seed=-(1 << 63) - 1), "seed must be in"),
    (dict(seed=1.5), "seed must be an integer"),
])
def test_sampling_params_type_and_range_errors(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        SamplingParams(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_is_a_clear_error(tiny_target):
    with pytest.raises(ValueError, match="sees no CUDA device"):
        LLM(tiny_target, device="cuda")


@pytest.mark.parametrize("residency, remedy", [("tail", "offload_after_tokens"),
                                                ("fill", "resident_tail_tokens")])
def test_too_small_budget_in_an_offloading_mode_names_the_right_remedy(tiny_target, residency,
                                                                       remedy):
    llm = LLM(tiny_target, mode="stream", block_size=16, chunk_tokens=64,
              device_kv_bytes=400_000, offload_after_tokens=2048, residency=residency,
              resident_tail_tokens=2048)
    try:
        with pytest.raises(ValueError) as err:
            llm.engine.add_request(_prompts((1500,))[0], GREEDY)
        assert remedy in str(err.value)
        assert "use an offloading mode" not in str(err.value)
    finally:
        llm.close()
