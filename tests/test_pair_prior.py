"""The step-cost fit on runs whose requests are all of one length (bench/matrix.py's cells):
their attention pairs move with their query tokens, so the fit cannot price the two apart, and
a pair's price comes from the model's shape (``step_cost.fit_modes``'s ``pair_prior``)."""

from __future__ import annotations

import random

import pytest

from specstream.llm import default_model_dir
from specstream.models.config import ModelConfig
from specstream.sim.step_cost import (
    StepFeatures,
    fit_modes,
    pairs_per_query_token,
    pairs_without_spread,
)

PER_TOKEN_S, PAIRS_A_TOKEN, PER_CONTEXT_S, CONST_S = 2e-4, 2000.0, 1e-6, 0.004


def _step(query: int, start: int, seqs: int = 1) -> dict:
    """A measured step of ``seqs`` requests with ``query`` new positions each from position
    ``start``, timed by the known prices above."""
    pairs = seqs * query * (start + query)
    ctx = seqs * (start + query)
    t = CONST_S + PER_TOKEN_S * (seqs * query + pairs / PAIRS_A_TOKEN) + PER_CONTEXT_S * ctx
    return {"query_tokens": seqs * query, "attention_pairs": pairs, "context_tokens": ctx,
            "num_seqs": seqs, "compute_s": t, "prefill_tokens": seqs * query if start == 0
            else 0, "link_bytes": 0, "history_bytes": 0}


def _one_length_run(length: int, seed: int = 0) -> dict:
    """Every request ``length`` tokens, prefilled in one chunk, then decoded 1-5 positions a
    round at about that context (a matrix cell's steps), each step's time off by up to 5%
    (a loaded machine's noise)."""
    rng = random.Random(seed)
    rounds = [_step(length, 0, seqs) for seqs in (1, 2, 3)]
    rounds += [_step(q, length + k, seqs) for k in range(8) for q in (1, 3, 5)
               for seqs in (1, 2)]
    for r in rounds:
        r["compute_s"] *= 1 + rng.uniform(-0.05, 0.05)
    return {"resident": {"rounds": rounds, "prefill_steps": []}}


def _prefill_s(cost, length: int) -> float:
    f = StepFeatures(query_tokens=length, attention_pairs=length * length,
                     context_tokens=length, num_seqs=1, draft_tokens=0, draft_seqs=0)
    return cost.compute_s(f)[0]


def test_the_embedded_target_prices_a_token_at_2048_pairs():
    cfg = ModelConfig.from_dir(default_model_dir("target"))
    assert pairs_per_query_token(cfg.num_layers, cfg.hidden_size, cfg.num_heads,
                                 cfg.num_kv_heads, cfg.head_dim,
                                 cfg.intermediate_size) == pytest.approx(2048)


def test_a_one_length_run_has_no_spread_and_a_mixed_one_has():
    one = _one_length_run(1024)
    assert pairs_without_spread(one)
    mixed = {"resident": {"rounds": one["resident"]["rounds"]
                          + _one_length_run(6144)["resident"]["rounds"], "prefill_steps": []}}
    assert not pairs_without_spread(mixed)


@pytest.mark.parametrize("seed", range(5))
def test_the_prior_extrapolates_a_1k_run_to_a_6k_prefill(seed):
    """Fitted on 1K-token requests, the 6K prefill is predicted within 10% with the prior,
    whatever the noise; the free fit puts the pairs' price where the noise takes it."""
    run = _one_length_run(1024, seed)
    truth = _step(6144, 0)["compute_s"]
    tied = fit_modes(run, 1e9, pair_prior=PAIRS_A_TOKEN)["resident"]
    assert _prefill_s(tied, 6144) == pytest.approx(truth, rel=0.10)
    free = fit_modes(run, 1e9)["resident"]  # 0.36-0.38x or 2.2x of the truth on these seeds
    assert abs(_prefill_s(free, 6144) / truth - 1) > 0.2


def test_a_run_with_spread_fits_its_own_price():
    """Where the pairs moved apart from the query tokens, the prior is not used: a wrong
    prior (4x too many pairs a token) leaves the fit as it is."""
    run = {"resident": {"rounds": _one_length_run(1024)["resident"]["rounds"]
                        + _one_length_run(4096, 1)["resident"]["rounds"], "prefill_steps": []}}
    free = fit_modes(run, 1e9)["resident"]
    wrong = fit_modes(run, 1e9, pair_prior=4 * PAIRS_A_TOKEN)["resident"]
    assert wrong.coef == free.coef
    assert free.coef[2] == pytest.approx(PER_TOKEN_S / PAIRS_A_TOKEN, rel=0.15)


def test_a_mode_that_hardly_drafted_borrows_the_draft_costs():
    """Random prompts: the round-shape policy drafted in no step of ``specstream``'s run, so
    its draft columns have nothing to fit on; it takes those of the run that drafted (a zero
    would read as free drafts wherever a replay drafts)."""
    drafting = _one_length_run(1024)["resident"]["rounds"]
    for r in drafting:
        r["draft_tokens"], r["draft_seqs"] = 4 * r["num_seqs"], r["num_seqs"]
        r["compute_s"] += 0.002 * r["draft_tokens"]  # 2 ms a draft token
    modes = {"resident": {"rounds": drafting, "prefill_steps": []},
             "specstream": _one_length_run(1024, 1)["resident"]}
    costs = fit_modes(modes, 1e9, pair_prior=PAIRS_A_TOKEN)
    f = StepFeatures(query_tokens=5, attention_pairs=5 * 1030, context_tokens=1030,
                     num_seqs=1, draft_tokens=4, draft_seqs=1)
    for name in ("resident", "specstream"):
        assert costs[name].compute_s(f)[1] == pytest.approx(0.008, rel=0.15)
