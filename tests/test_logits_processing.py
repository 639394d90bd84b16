"""vLLM's sampling parameters under speculation: logit_bias, min_tokens, the penalties and min_p
stay lossless (every draft position processed as if the drafts before it had been generated),
and logprobs / prompt logprobs are the target's raw log-softmax, equal to target-only
decoding's in every mode.

References are written the plain way: a per-row loop for the processors, the exact joint of a
Markov model for the distribution, target-only decoding (resident, no proposer) and a full
forward over the whole sequence for the engine.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import our_logits
from test_acceptance import C0, N_OUT, N_ROWS, Q, V, chi_square, critical_value, markov_tables
from test_tree_engine import MODES, OracleTreeProposer

from specstream.config import EngineConfig
from specstream.engine.llm_engine import LLMEngine
from specstream.models.loader import load_model
from specstream.sampling import TokenContext, logits_to_probs, process_logits, sample
from specstream.sampling_params import SamplingParams
from specstream.spec.acceptance import accept_drafts

PENALIZED = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                           repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.4,
                           logit_bias={5: 1.5, 9: -2.0, 17: 0.8}, min_p=0.05)
TREE = dict(proposer="draft", draft_model="unused: the engine gets the fake proposer",
            num_speculative_tokens=4, speculative_topk=3, speculative_num_draft_tokens=12,
            speculative_policy="fixed")
# every mode, chains and trees in one run (the oracle drafts both), host attention included
SETTINGS = ["resident", "offload-spec/fill", "specstream/tail", "specstream/fill",
            "parallel-spec/fill", "specstream/tail/host"]


# ---- the processors against a plain per-row loop ------------------------------------------
def _reference_row(x: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
                   stops: set[int], generated: int | None = None) -> torch.Tensor:
    """vLLM's processors for one position, written out: bias, min_tokens (``generated``
    tokens so far, default len(output)), repetition, frequency, presence."""
    x = x.clone().float()
    for tok, b in (p.logit_bias or {}).items():
        x[tok] += b
    if (len(output) if generated is None else generated) < p.min_tokens:
        for tok in set(p.stop_token_ids) | (set() if p.ignore_eos else stops):
            x[tok] = -math.inf
    for tok in set(prompt) | set(output):
        x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok in set(output):
        x[tok] -= p.frequency_penalty * output.count(tok) + p.presence_penalty
    return x


def test_processors_equal_the_per_row_loop() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 12
    params = [
        SamplingParams(repetition_penalty=1.7, frequency_penalty=0.5, presence_penalty=-0.3),
        SamplingParams(),  # untouched rows between processed ones
        SamplingParams(logit_bias={3: 2.5, 0: -1.0}, min_tokens=4, stop_token_ids=[7]),
        SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[5], presence_penalty=1.0),
    ]
    contexts = [TokenContext(3, [1, 2, 2, 4], [4, 4, 6]), TokenContext(0),
                TokenContext(2, [], []), TokenContext(1, [3], [9])]
    # a chain (row j: drafts 0..j-1) and a tree (row 1 + i: the path to node i)
    paths = [[(), (4,), (4, 8), (4, 8, 4)], [(), (1,)], [(), (2,), (2, 0)],
             [(), (5,), (6,), (5, 5)]]
    logits = torch.randn(sum(map(len, paths)), vocab, generator=g) * 3
    got = process_logits(logits, params, contexts, paths, stop_ids={0, 11})
    row = 0
    for p, ctx, rows in zip(params, contexts, paths):
        for path in rows:
            want = _reference_row(logits[row], p, list(ctx.prompt),
                                  list(ctx.output) + list(path), {0, 11},
                                  generated=ctx.output_len + len(path))
            torch.testing.assert_close(got[row], want, msg=f"row {row}")
            row += 1
    # nothing to do: the logits themselves, untouched
    plain = [SamplingParams()] * 4
    assert process_logits(logits, plain, contexts, paths) is logits


def test_min_p_keeps_tokens_within_a_factor_of_the_most_likely() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 20, generator=g) * 2
    for min_p, temp in [(0.1, 1.0), (0.3, 0.7), (0.0, 1.0)]:
        probs = logits_to_probs(logits, temp, 0, 1.0, min_p=min_p)
        plain = torch.softmax(logits / temp, dim=-1)
        keep = plain >= min_p * plain.max(dim=-1, keepdim=True).values
        want = torch.where(keep, plain, 0.0)
        torch.testing.assert_close(probs, want / want.sum(-1, keepdim=True))


# ---- the exact distribution with penalties on --------------------------------------------
DIST = SamplingParams(temperature=1.0, repetition_penalty=1.8, frequency_penalty=0.7,
                      presence_penalty=0.5, logit_bias={1: 0.8}, min_tokens=2,
                      stop_token_ids=[3], min_p=0.02)
PROMPT = [4, C0]


def _probs(target: torch.Tensor, prev: int, output: list[int]) -> torch.Tensor:
    x = _reference_row(target[prev], DIST, PROMPT, output, set())
    return logits_to_probs(x[None], DIST.temperature, DIST.top_k, DIST.top_p,
                           min_p=DIST.min_p)[0]


def _exact_joint(target: torch.Tensor) -> torch.Tensor:  # [V**3]
    joint = torch.zeros(V**N_OUT, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=N_OUT):
        prob, prev, out = 1.0, C0, []
        for tok in seq:
            prob *= float(_probs(target, prev, out)[tok])
            prev, out = tok, out + [tok]
        joint[(seq[0] * V + seq[1]) * V + seq[2]] = prob
    return joint


def _run_speculative(target: torch.Tensor, draft: torch.Tensor, draft_aware: bool,
                     seed: int) -> torch.Tensor:
    """The speculative loop of test_acceptance, each row's target logits processed with the
    row's history; ``draft_aware=False`` forgets the drafts before each position (the mistake
    this guards against)."""
    torch.manual_seed(seed)
    draft_p = torch.softmax(draft, dim=-1)  # the draft ignores the penalties: still lossless
    outs: list[list[int]] = [[] for _ in range(N_ROWS)]
    last = torch.full((N_ROWS,), C0)
    for _ in range(N_OUT):
        num = torch.randint(0, Q + 1, (N_ROWS,))
        cur, drafts = last, []
        for _ in range(Q):
            cur = sample(draft_p[cur])
            drafts.append(cur)
        draft_tokens = torch.stack(drafts, dim=1)  # [N, Q]
        inputs = torch.cat([last[:, None], draft_tokens], dim=1)  # [N, Q+1]
        lists = draft_tokens.tolist()
        paths = [[tuple(d[:j]) if draft_aware else () for j in range(Q + 1)] for d in lists]
        contexts = [TokenContext(len(o), PROMPT, o) for o in outs]
        logits = process_logits(target[inputs].reshape(-1, V), [DIST] * N_ROWS, contexts,
                                paths).view(N_ROWS, Q + 1, V)
        res = accept_drafts(logits, draft_tokens, num, draft_p[inputs[:, :Q]], [DIST] * N_ROWS)
        for o, new in zip(outs, res.output_tokens, strict=True):
            o.extend(new)
        last = torch.tensor([o[-1] for o in outs])
    return torch.tensor([o[:N_OUT] for o in outs])


@pytest.mark.parametrize("draft_aware", [True, False], ids=["lossless", "drafts-forgotten"])
def test_penalised_speculative_sampling_matches_target(draft_aware: bool) -> None:
    target, draft = markov_tables(seed=1234)
    tokens = _run_speculative(target, draft, draft_aware, seed=0)
    cells = (tokens * torch.tensor([V * V, V, 1])).sum(-1)
    counts = torch.bincount(cells, minlength=V**N_OUT).double()
    stat, df = chi_square(counts, _exact_joint(target))
    crit = critical_value(df)
    if draft_aware:
        assert stat < crit, f"chi2 {stat:.1f} >= critical {crit:.1f}"
    else:
        assert stat > crit, f"forgetting the drafts passed: chi2 {stat:.1f} <= {crit:.1f}"


# ---- the engine ----------------------------------------------------------------------------
def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 300, 20, 90, 700)]


def _generate(folder, prompts, params, drafter=None, **kw):
    eng = LLMEngine(folder, EngineConfig(**kw), proposer=drafter)
    try:
        ids = [eng.add_request(p, params) for p in prompts]
        done = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    assert o.outputs[0].error is None, o.outputs[0].error
                    done[o.request_id] = o
        return [done[i] for i in ids], eng.get_metrics()
    finally:
        eng.close()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompts()


@pytest.fixture(scope="module")
def penalised_reference(tiny_target, prompts):
    """Target-only greedy decoding with the same parameters, everything resident."""
    outs, _ = _generate(tiny_target, prompts, PENALIZED, mode="resident",
                        device_kv_bytes=16 << 20)
    return [o.outputs[0].token_ids for o in outs]


def test_the_parameters_change_the_output(tiny_target, prompts, penalised_reference):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, _ = _generate(tiny_target, prompts, plain, mode="resident", device_kv_bytes=16 << 20)
    assert [o.outputs[0].token_ids for o in outs] != penalised_reference
    # the repetition penalty bites: the plain greedy output repeats more
    def repeats(seqs: list[list[int]]) -> int:
        return sum(len(s) - len(set(s)) for s in seqs)
    assert repeats(penalised_reference) < repeats([o.outputs[0].token_ids for o in outs])


@pytest.mark.parametrize("setting", SETTINGS)
def test_penalised_greedy_equals_target_only(tiny_target, prompts, penalised_reference,
                                             setting):
    """Chains and trees (the oracle proposes the reference's tokens at random sibling slots),
    so accepted paths run deep and every depth's processing matters."""
    oracle = OracleTreeProposer([p + r for p, r in zip(prompts, penalised_reference)],
                                chain_share=0.3)
    outs, m = _generate(tiny_target, prompts, PENALIZED, oracle, **MODES[setting], **TREE)
    assert [o.outputs[0].token_ids for o in outs] == penalised_reference
    assert oracle.trees > 0 and oracle.chains > 0
    assert m["accepted_per_pos"][2] > 0  # paths three deep were accepted


@pytest.mark.parametrize("mode", ["resident", "specstream", "offload-spec"])
def test_penalised_greedy_with_a_draft_model(tiny_target, prompts, penalised_reference, mode):
    """The target as its own (unpenalised) draft: it proposes what the target would without
    the penalties, so acceptance and rejection both happen at every depth."""
    kw = MODES["resident" if mode == "resident" else f"{mode}/fill"]
    outs, m = _generate(tiny_target, prompts, PENALIZED, **kw, draft_model=str(tiny_target),
                        proposer="draft", num_speculative_tokens=4, draft_cache="full",
                        speculative_policy="fixed")
    assert [o.outputs[0].token_ids for o in outs] == penalised_reference
    assert 0 < m["accepted_tokens"] < m["proposed_tokens"]


def test_min_tokens_holds_back_stop_tokens(tiny_target, prompts):
    """A stop token the greedy output reaches early: with min_tokens it cannot end the request
    before that many tokens (it is masked, so the output differs from there on)."""
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, _ = _generate(tiny_target, [prompts[1]], plain, mode="resident",
                        device_kv_bytes=16 << 20)
    stop = outs[0].outputs[0].token_ids[2]
    base = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], ignore_eos=True)
    outs, _ = _generate(tiny_target, [prompts[1]], base, mode="resident",
                        device_kv_bytes=16 << 20)
    assert outs[0].outputs[0].token_ids[-1] == stop and len(outs[0].outputs[0].token_ids) <= 3
    assert outs[0].outputs[0].stop_reason == stop
    held = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], ignore_eos=True,
                          min_tokens=10)
    ref, _ = _generate(tiny_target, [prompts[1]], held, mode="resident",
                       device_kv_bytes=16 << 20)
    toks = ref[0].outputs[0].token_ids
    assert stop not in toks[:10] and len(toks) >= 10
    assert ref[0].outputs[0].finish_reason in ("stop", "length")
    oracle = OracleTreeProposer([prompts[1] + toks], chain_share=0.3)
    spec, _ = _generate(tiny_target, [prompts[1]], held, oracle, **MODES["specstream/tail"],
                        **TREE)
    assert spec[0].outputs[0].token_ids == toks


# ---- logprobs ------------------------------------------------------------------------------
LOGPROBS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3,
                          prompt_logprobs=2)


@pytest.fixture(scope="module")
def full_forward(tiny_target):
    model = load_model(tiny_target, torch.float32, "cpu")
    return lambda ids: torch.log_softmax(our_logits(model, ids), dim=-1)


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
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
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
        assert entry[prompt[t]].rank == int((row > row[prompt[t]]).sum()) + 1
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
    outs, _ = _generate(tiny_target, prompts[1:4], LOGPROBS, mode="resident",
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
    outs, m = _generate(tiny_target, prompts[1:4], LOGPROBS, oracle, **kw)
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
    outs, _ = _generate(tiny_target, prompts[:2], params, mode="specstream",
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
