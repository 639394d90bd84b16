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
from test_acceptance import C0, N_OUT, N_ROWS, Q, V, chi_square, critical_value, markov_tables
from tree_oracle import MODES, OracleTreeProposer

from specstream.config import EngineConfig
from specstream.engine.llm_engine import LLMEngine
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
def engine_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 300, 20, 90, 700)]


def generate_all(folder, prompts, params, drafter=None, **kw):
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
    return engine_prompts()


@pytest.fixture(scope="module")
def penalised_reference(tiny_target, prompts):
    """Target-only greedy decoding with the same parameters, everything resident."""
    outs, _ = generate_all(tiny_target, prompts, PENALIZED, mode="resident",
                        device_kv_bytes=16 << 20)
    return [o.outputs[0].token_ids for o in outs]


def test_the_parameters_change_the_output(tiny_target, prompts, penalised_reference):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, _ = generate_all(tiny_target, prompts, plain, mode="resident", device_kv_bytes=16 << 20)
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
    outs, m = generate_all(tiny_target, prompts, PENALIZED, oracle, **MODES[setting], **TREE)
    assert [o.outputs[0].token_ids for o in outs] == penalised_reference
    assert oracle.trees > 0 and oracle.chains > 0
    assert m["accepted_per_pos"][2] > 0  # paths three deep were accepted


@pytest.mark.parametrize("mode", ["resident", "specstream", "offload-spec"])
def test_penalised_greedy_with_a_draft_model(tiny_target, prompts, penalised_reference, mode):
    """The target as its own (unpenalised) draft: it proposes what the target would without
    the penalties, so acceptance and rejection both happen at every depth."""
    kw = MODES["resident" if mode == "resident" else f"{mode}/fill"]
    outs, m = generate_all(tiny_target, prompts, PENALIZED, **kw, draft_model=str(tiny_target),
                        proposer="draft", num_speculative_tokens=4, draft_cache="full",
                        speculative_policy="fixed")
    assert [o.outputs[0].token_ids for o in outs] == penalised_reference
    assert 0 < m["accepted_tokens"] < m["proposed_tokens"]


def test_min_tokens_holds_back_stop_tokens(tiny_target, prompts):
    """A stop token the greedy output reaches early: with min_tokens it cannot end the request
    before that many tokens (it is masked, so the output differs from there on)."""
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, _ = generate_all(tiny_target, [prompts[1]], plain, mode="resident",
                        device_kv_bytes=16 << 20)
    stop = outs[0].outputs[0].token_ids[2]
    base = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], ignore_eos=True)
    outs, _ = generate_all(tiny_target, [prompts[1]], base, mode="resident",
                        device_kv_bytes=16 << 20)
    assert outs[0].outputs[0].token_ids[-1] == stop and len(outs[0].outputs[0].token_ids) <= 3
    assert outs[0].outputs[0].stop_reason == stop
    held = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], ignore_eos=True,
                          min_tokens=10)
    ref, _ = generate_all(tiny_target, [prompts[1]], held, mode="resident",
                       device_kv_bytes=16 << 20)
    toks = ref[0].outputs[0].token_ids
    assert stop not in toks[:10] and len(toks) >= 10
    assert ref[0].outputs[0].finish_reason in ("stop", "length")
    oracle = OracleTreeProposer([prompts[1] + toks], chain_share=0.3)
    spec, _ = generate_all(tiny_target, [prompts[1]], held, oracle, **MODES["specstream/tail"],
                        **TREE)
    assert spec[0].outputs[0].token_ids == toks
