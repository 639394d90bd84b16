"""Log-probabilities and prompt log-probabilities are the target's raw log-softmax, equal to a
full forward over the whole sequence and to target-only decoding's in every mode; prompt
log-probabilities bypass the prefix cache; the offline API hands them back with the cached
token count."""

from __future__ import annotations

import pytest
import torch
from helpers import our_logits
from test_logits_processing import SETTINGS, TREE, engine_prompts, generate_all
from tree_oracle import MODES, OracleTreeProposer

from specstream.config import EngineConfig
from specstream.engine.llm_engine import LLMEngine
from specstream.models.loader import load_model
from specstream.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return engine_prompts()


LOGPROBS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3,
                          prompt_logprobs=2)


@pytest.fixture(scope="module")
def full_forward(tiny_target):
    model = load_model(tiny_target, torch.float32, "cpu")
    return lambda ids: torch.log_softmax(our_logits(model, ids), dim=-1)


def _rank_fits(rank: int, row: torch.Tensor, value: float, tol: float) -> bool:
    """``rank`` is the token's rank in ``row`` up to values within ``tol`` of its own: a near
    tie may order either way when the terms are added in another order."""
    return int((row > value + tol).sum()) + 1 <= rank <= int((row > value - tol).sum()) + 1


def _check_logprobs(out, full_forward, tol: float = 1e-4) -> None:
    """Every generated token's and every prompt token's entry against a full forward over the
    whole sequence: the chosen token's log-probability and rank, and the top tokens (within
    ``tol``: a full forward adds the attention terms in another order than the cached,
    chunked one)."""
    prompt, comp = out.prompt_token_ids, out.outputs[0]
    seq = prompt + comp.token_ids
    lp = full_forward(seq)  # [T, V]: row t predicts token t + 1
    assert len(comp.logprobs) == len(comp.token_ids)
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = lp[len(prompt) + i - 1]
        assert abs(entry[tok].logprob - float(row[tok])) < tol
        assert _rank_fits(entry[tok].rank, row, float(row[tok]), tol)
        top = row.topk(3)
        for rank, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
            assert abs(entry[t].logprob - v) < tol
            assert entry[t].rank == rank
        assert set(entry) <= set(top.indices.tolist()) | {tok}
    assert comp.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)), abs=1e-6)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for t in range(1, len(prompt)):
        entry, row = out.prompt_logprobs[t], lp[t - 1]
        assert abs(entry[prompt[t]].logprob - float(row[prompt[t]])) < tol
        assert _rank_fits(entry[prompt[t]].rank, row, float(row[prompt[t]]), tol)
        assert len(set(entry) - {prompt[t]}) <= 2


def _same_logprobs(a, b, tol: float = 1e-5) -> None:
    """Two runs' log-probabilities: the same tokens at every position, values within ``tol``
    relative (streamed attention's exactness contract: 1e-5 relative in fp32)."""
    pairs = list(zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True))
    pairs += list(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True))
    for x, y in pairs:
        assert set(x) == set(y)
        for t in x:
            assert abs(x[t].logprob - y[t].logprob) <= tol * (1 + abs(y[t].logprob))
            assert x[t].rank == y[t].rank


@pytest.fixture(scope="module")
def logprobs_reference(tiny_target, prompts):
    """Target-only greedy decoding with logprobs, everything resident, 64-token chunks."""
    outs, _ = generate_all(tiny_target, prompts[1:4], LOGPROBS, mode="resident",
                        device_kv_bytes=16 << 20, max_prefill_tokens=64)
    return outs


def test_target_only_logprobs_equal_a_full_forward(logprobs_reference, full_forward):
    for out in logprobs_reference:
        _check_logprobs(out, full_forward)


@pytest.mark.parametrize("setting", ["offload", "stream", *SETTINGS])
def test_logprobs_equal_target_only(tiny_target, prompts, logprobs_reference, full_forward,
                                    setting):
    """Greedy with logprobs and prompt logprobs (chunked prefill: 64-token chunks) in every
    mode, speculative ones with chains and trees: the same tokens as target-only decoding and
    its log-probabilities within 1e-5."""
    ref = logprobs_reference
    kw = (dict(**MODES[setting], **TREE) if setting in SETTINGS
          else dict(mode=setting, device_kv_bytes=1_600_000, block_size=16, chunk_tokens=64,
                    resident_tail_tokens=32, offload_after_tokens=64, max_prefill_tokens=64))
    oracle = (OracleTreeProposer([p + o.outputs[0].token_ids for p, o in zip(prompts[1:4], ref)],
                                 chain_share=0.3) if setting in SETTINGS else None)
    outs, m = generate_all(tiny_target, prompts[1:4], LOGPROBS, oracle, **kw)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    for out, want in zip(outs, ref):
        _same_logprobs(out, want)
        _check_logprobs(out, full_forward)
    if oracle is not None:
        assert m["accepted_tokens"] > 0 and oracle.trees > 0


def test_sampled_logprobs_are_the_raw_distribution(tiny_target, prompts, full_forward):
    """Sampling at temperature 0.7 with a penalty: the reported log-probabilities are the
    raw model's (vLLM's default logprobs_mode), not the processed distribution's."""
    params = SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True, logprobs=0,
                            seed=5, repetition_penalty=1.3)
    outs, _ = generate_all(tiny_target, prompts[:2], params, mode="specstream",
                        device_kv_bytes=1_000_000, draft_model=str(tiny_target),
                        proposer="draft", num_speculative_tokens=3, link_gbps=2.0,
                        block_size=16, chunk_tokens=64, resident_tail_tokens=32)
    for out in outs:
        comp = out.outputs[0]
        lp = full_forward(out.prompt_token_ids + comp.token_ids)
        for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            assert list(entry) == [tok]  # logprobs=0: the sampled token's alone
            assert abs(entry[tok].logprob - float(lp[len(out.prompt_token_ids) + i - 1, tok])) \
                < 1e-4


def test_the_offline_api_hands_back_prompt_logprobs_and_cached_tokens(tiny_target, prompts):
    """``LLM.generate`` keeps what the engine reported for the prompt."""
    from specstream.llm import LLM

    llm = LLM(tiny_target, mode="resident", device_kv_bytes=16 << 20, block_size=16)
    try:
        (out,) = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=2,
                                                           prompt_logprobs=1), use_tqdm=False)
        (again,) = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=2),
                                use_tqdm=False)
    finally:
        llm.close()
    assert len(out.prompt_logprobs) == 300 and out.prompt_logprobs[0] is None
    assert out.num_cached_tokens == 0 and again.num_cached_tokens == 288


def test_prompt_logprobs_skip_the_prefix_cache(tiny_target, prompts):
    """A prompt whose blocks are cached still gets every prompt position's log-probability
    (it is prefilled, as in vLLM); a plain request with the same prompt takes the hit."""
    eng = LLMEngine(tiny_target, EngineConfig(mode="resident", device_kv_bytes=16 << 20,
                                              block_size=16))
    try:
        def run(params):
            rid = eng.add_request(prompts[1], params)
            while eng.has_unfinished():
                for o in eng.step():
                    if o.finished and o.request_id == rid:
                        out = o
            return out
        plain = SamplingParams(temperature=0, max_tokens=4)
        first = run(plain)
        assert first.num_cached_tokens == 0
        hit = run(plain)
        assert hit.num_cached_tokens == 288  # the prompt's full blocks (300 tokens, 16 a block)
        with_lp = run(SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0))
        assert with_lp.num_cached_tokens == 0
        assert len(with_lp.prompt_logprobs) == 300 and with_lp.prompt_logprobs[0] is None
        assert with_lp.outputs[0].token_ids == first.outputs[0].token_ids == \
            hit.outputs[0].token_ids
    finally:
        eng.close()
