"""Acceptance: greedy prefixes by hand, and a chi-square test that speculative sampling is lossless.

The statistical tests run the whole speculative loop (draft from a draft model, verify with
``accept_drafts``, continue from the last output token) on a first-order Markov "language model"
over a tiny vocabulary, for many independent rows at once, and compare the empirical joint
distribution of the first three generated tokens with the target model's exact joint.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from specstream.sampling import logits_to_probs, make_generator, sample
from specstream.sampling_params import SamplingParams
from specstream.spec import acceptance
from specstream.spec.acceptance import accept_drafts

V = 5  # vocabulary
C0 = 2  # the last prompt token
Q = 3  # drafts per round (each row drafts a random number 0..Q of them)
N_OUT = 3  # tokens compared with the exact joint: V**3 = 125 cells
N_ROWS = 30_000
ALPHA_Z = 3.0902  # standard normal quantile for significance 1e-3

DEFAULT = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)


def critical_value(df: int, z: float = ALPHA_Z) -> float:
    """Upper quantile of chi2(df) by the Wilson-Hilferty approximation.

    (X / df) ** (1/3) is close to normal with mean 1 - 2/(9 df) and variance 2/(9 df); accurate
    to about 1% for df >= 10, which is far below the margins these tests rely on.
    """
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi_square(counts: Tensor, probs: Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; cells with expected count < 5 are pooled."""
    n = counts.sum().item()
    if counts[probs == 0].sum() > 0:
        return math.inf, 1  # a token sequence the target can never produce
    expected = probs * n
    big = expected >= 5
    stat = (((counts[big] - expected[big]) ** 2) / expected[big]).sum().item()
    bins = int(big.sum())
    pooled_e = expected[~big].sum().item()
    if pooled_e >= 5:
        stat += (counts[~big].sum().item() - pooled_e) ** 2 / pooled_e
        bins += 1
    return stat, bins - 1


def markov_tables(seed: int) -> tuple[Tensor, Tensor]:
    """Target and (deliberately different) draft logits: next-token logits given the previous."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, generator=g) * 1.5  # [V_prev, V]
    draft = torch.randn(V, V, generator=g) * 1.5 + 2.0 * torch.eye(V)
    return target, draft


def exact_joint(target: Tensor, params: SamplingParams) -> Tensor:  # [V**3]
    p = logits_to_probs(target, params.temperature, params.top_k, params.top_p)  # [V, V]
    joint = p[C0][:, None, None] * p[:, :, None] * p[None, :, :]
    return joint.reshape(-1).double()


def run_speculative(
    target: Tensor, draft: Tensor, params: SamplingParams, point_mass: bool, seed: int
) -> Tensor:  # [N_ROWS, N_OUT]
    """The full speculative loop, vectorised over N_ROWS independent requests."""
    torch.manual_seed(seed)
    draft_p = logits_to_probs(draft, params.temperature, params.top_k, params.top_p)  # [V, V]
    rows_params = [params] * N_ROWS
    outs: list[list[int]] = [[] for _ in range(N_ROWS)]
    last = torch.full((N_ROWS,), C0)
    for _ in range(N_OUT):  # every round yields at least one token
        num = torch.randint(0, Q + 1, (N_ROWS,))
        cur, drafts = last, []
        for _ in range(Q):
            cur = draft_p[cur].argmax(-1) if point_mass else sample(draft_p[cur])
            drafts.append(cur)
        draft_tokens = torch.stack(drafts, dim=1)  # [N, Q]
        inputs = torch.cat([last[:, None], draft_tokens], dim=1)  # [N, Q+1]
        draft_probs = None if point_mass else draft_p[inputs[:, :Q]]  # [N, Q, V]
        res = accept_drafts(target[inputs], draft_tokens, num, draft_probs, rows_params)
        counts = res.num_accepted.tolist()
        assert all(len(o) == n + 1 for o, n in zip(res.output_tokens, counts, strict=True))
        for o, new in zip(outs, res.output_tokens, strict=True):
            o.extend(new)
        last = torch.tensor([o[-1] for o in outs])
    return torch.tensor([o[:N_OUT] for o in outs])


def joint_statistic(tokens: Tensor, target: Tensor, params: SamplingParams
                    ) -> tuple[float, float]:
    """Chi-square of the first N_OUT generated tokens of every row ([rows, N_OUT]) against the
    target's exact joint, and the critical value."""
    cells = (tokens * torch.tensor([V * V, V, 1])).sum(-1)
    counts = torch.bincount(cells, minlength=V**N_OUT).double()
    stat, df = chi_square(counts, exact_joint(target, params))
    return stat, critical_value(df)


def statistic(params: SamplingParams, point_mass: bool, seed: int = 0) -> tuple[float, float]:
    target, draft = markov_tables(seed=1234)
    return joint_statistic(run_speculative(target, draft, params, point_mass, seed), target,
                           params)


@pytest.mark.parametrize("params", [DEFAULT, FILTERED], ids=["default", "filtered"])
@pytest.mark.parametrize("point_mass", [False, True], ids=["model-draft", "point-mass"])
def test_speculative_sampling_matches_target(params: SamplingParams, point_mass: bool) -> None:
    stat, crit = statistic(params, point_mass)
    assert stat < crit, f"chi2 {stat:.1f} >= critical {crit:.1f}"


def _accept_all(u: Tensor, p_x: Tensor, q_x: Tensor) -> Tensor:
    return torch.ones_like(u, dtype=torch.bool)


def _recover_from_p(p: Tensor, q: Tensor) -> Tensor:
    return p


@pytest.mark.parametrize("params", [DEFAULT, FILTERED], ids=["default", "filtered"])
@pytest.mark.parametrize(
    "attr,wrong", [("accept_mask", _accept_all), ("residual", _recover_from_p)],
    ids=["accept-all", "recover-from-p"],
)
def test_wrong_sampler_is_detected(
    monkeypatch: pytest.MonkeyPatch, params: SamplingParams, attr: str, wrong: object
) -> None:
    monkeypatch.setattr(acceptance, attr, wrong)
    stat, crit = statistic(params, point_mass=False)
    assert stat > crit, f"wrong sampler passed: chi2 {stat:.1f} <= critical {crit:.1f}"


def test_greedy_accepts_longest_matching_prefix() -> None:
    torch.manual_seed(0)
    vocab, q = 8, 3
    argmax = torch.tensor([[1, 2, 3, 4]] * 6)  # [B, Q+1] target argmax per position
    logits = torch.randn(6, q + 1, vocab).clamp(-1, 1)
    logits.scatter_(-1, argmax[..., None], 5.0)
    drafts = torch.tensor([
        [7, 2, 3],  # first draft wrong -> 0 accepted, recovered = 1
        [1, 2, 0],  # -> 2 accepted, recovered = 3
        [1, 2, 3],  # all accepted, bonus = 4
        [-1, -1, -1],  # no drafts (plain decoding), padding is ignored
        [1, 2, 3],  # 2 drafts, padded third would match but must not count -> bonus = 3
        [1, 5, 3],  # top_k=1 at temperature 0.7 is greedy too -> 1 accepted, recovered = 2
    ])
    num = [3, 3, 3, 0, 2, 3]
    params = [SamplingParams(temperature=0.0)] * 5 + [SamplingParams(temperature=0.7, top_k=1)]
    draft_probs = torch.softmax(torch.randn(6, q, vocab), -1)  # ignored by greedy rows
    for dp in (None, draft_probs):
        out = accept_drafts(logits, drafts, num, dp, params)
        assert out.num_accepted.tolist() == [0, 2, 3, 0, 2, 1]
        assert out.output_tokens == [[1], [1, 2, 3], [1, 2, 3, 4], [1], [1, 2, 3], [1, 2]]


def test_seeded_rows_do_not_depend_on_batch() -> None:
    torch.manual_seed(0)
    vocab = 6
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(1, 3, vocab)
    drafts = torch.tensor([[1, 4]])
    dprobs = torch.softmax(torch.randn(1, 2, vocab), -1)

    alone = accept_drafts(logits, drafts, [2], dprobs, [params], [make_generator(params)])
    # The same request in a wider batch (Q = 4) next to an unseeded one.
    wide_logits = torch.cat([torch.randn(1, 5, vocab), torch.cat([logits, logits[:, :2]], 1)])
    wide_drafts = torch.tensor([[0, 1, 2, 3], [1, 4, 0, 0]])
    wide_probs = torch.softmax(torch.randn(2, 4, vocab), -1)
    wide_probs[1, :2] = dprobs[0]
    both = accept_drafts(
        wide_logits, wide_drafts, [4, 2], wide_probs, [DEFAULT, params],
        [None, make_generator(params)],
    )
    assert both.output_tokens[1] == alone.output_tokens[0]


def test_rejects_bad_shapes() -> None:
    logits = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="num_drafts"):
        accept_drafts(logits, torch.zeros(2, 2, dtype=torch.long), [1, 3], None, [DEFAULT] * 2)
    with pytest.raises(ValueError, match="draft_tokens"):
        accept_drafts(logits, torch.zeros(2, 3, dtype=torch.long), [1, 1], None, [DEFAULT] * 2)
