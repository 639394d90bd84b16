"""Verification of draft tokens against the target model: one function for the whole batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specstream.sampling import SamplingTensors, logits_to_probs, sample, uniform
from specstream.sampling_params import SamplingParams


@dataclass
class AcceptOutput:
    """What one verification round produced for each request of the batch."""

    # [B] int64 on CPU: how many draft tokens were accepted (0 <= num_accepted[b] <= num_drafts[b]).
    num_accepted: Tensor
    # Per request: the accepted drafts followed by exactly one target token (recovered or bonus);
    # len(output_tokens[b]) == num_accepted[b] + 1.
    output_tokens: list[list[int]]


def _accept_mask(
    u: Tensor,  # [B, Q] uniform in [0, 1)
    p_x: Tensor,  # [B, Q] target probability of each draft token
    q_x: Tensor,  # [B, Q] draft probability of each draft token
) -> Tensor:  # [B, Q] bool
    # Accept x with probability min(1, p(x) / q(x)), i.e. iff u < p(x) / q(x). Written as
    # u * q(x) < p(x) so that q(x) = 0 needs no division and p(x) = 0 always rejects.
    return u * q_x < p_x


def _residual(
    p: Tensor,  # [B, V] target distribution at the rejected position
    q: Tensor,  # [B, V] draft distribution at the rejected position
) -> Tensor:  # [B, V] unnormalised
    # After a rejection the output must be drawn from norm(max(0, p - q)): the part of p that
    # the accept step under-sampled. Together the two steps sample exactly p.
    return (p - q).clamp_min(0)


def accept_drafts(
    target_logits: Tensor,  # [B, Q+1, V]
    draft_tokens: Tensor,  # [B, Q] int64, padded past num_drafts[b] (any value)
    num_drafts: Tensor | Sequence[int],  # [B], 0 <= num_drafts[b] <= Q
    draft_probs: Tensor | None,  # [B, Q, V] or None (point-mass drafts)
    params: Sequence[SamplingParams] | SamplingTensors,  # one per row
    generators: Sequence[torch.Generator | None] | None = None,
) -> AcceptOutput:
    """Verify the drafts of a batch with lossless speculative sampling.

    Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
    Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling".

    ``target_logits[b, j]`` is the target's prediction after input position j of request b: the
    inputs are the last accepted token followed by the drafts, so position j checks draft j and
    position ``num_drafts[b]`` predicts the token after the last draft. Let p be the target
    distribution and q the draft distribution, both after the SAME temperature/top-k/top-p
    processing (``draft_probs`` must already be processed).

    - accepted tokens: drafts x_0..x_{n-1} taken in order while each passes the test
      u < p(x)/q(x), u ~ U[0, 1) (so x is kept with probability min(1, p(x)/q(x)));
    - recovered token: at the first rejected position, one token drawn from norm(max(0, p - q));
    - bonus token: when every draft is accepted, one token drawn from p at position num_drafts[b].

    So each request gets ``num_accepted + 1`` tokens, distributed exactly as target-only
    sampling. Greedy rows (temperature 0 or top_k 1) have one-hot p: accepted is the longest
    prefix equal to the target argmax, the extra token is the argmax at the first mismatch.
    ``draft_probs=None`` means each draft is a point mass (q(x) = 1), as for deterministic
    proposers (n-gram); this is still lossless. In a batch mixing point-mass and model drafts,
    pass one-hot rows of ``draft_probs`` for the point-mass requests.

    Randomness: a row with a generator draws exactly num_drafts[b] uniforms, then V exponentials
    (see ``sampling.sample``), so a seeded request's output does not depend on its batch.
    """
    bsz, q_plus_1, vocab = target_logits.shape
    q = q_plus_1 - 1
    dev = target_logits.device
    if draft_tokens.shape != (bsz, q):
        raise ValueError(f"draft_tokens shape {tuple(draft_tokens.shape)} != {(bsz, q)}")
    n_drafts = torch.as_tensor(num_drafts, dtype=torch.int64, device=dev)
    if n_drafts.shape != (bsz,) or bool(((n_drafts < 0) | (n_drafts > q)).any()):
        raise ValueError(f"num_drafts must be [B] ints in [0, {q}], got {n_drafts.tolist()}")
    st = params if isinstance(params, SamplingTensors) else SamplingTensors.from_params(params, dev)
    greedy = st.greedy  # [B]

    pos = st.repeat_interleave(q_plus_1)
    p = logits_to_probs(target_logits.reshape(-1, vocab), pos.temperature, pos.top_k, pos.top_p)
    p = p.view(bsz, q_plus_1, vocab)  # [B, Q+1, V]
    rows = torch.arange(bsz, device=dev)
    valid = torch.arange(q, device=dev)[None, :] < n_drafts[:, None]  # [B, Q]
    drafts = torch.where(valid, draft_tokens.to(dev), 0)  # [B, Q], padding made indexable

    # Accept step. Greedy rows compare with the argmax; their generators are left untouched.
    p_x = p[:, :q].gather(-1, drafts[..., None]).squeeze(-1)  # [B, Q]
    dprobs = None if draft_probs is None else draft_probs.to(dev, torch.float32)  # [B, Q, V]
    if dprobs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = dprobs.gather(-1, drafts[..., None]).squeeze(-1)
    gens = list(generators) if generators is not None else [None] * bsz
    gens = [None if g else gen for g, gen in zip(greedy.tolist(), gens, strict=True)]
    u = uniform(n_drafts.tolist(), q, gens, dev)
    ok = torch.where(greedy[:, None], drafts == p[:, :q].argmax(-1), _accept_mask(u, p_x, q_x))
    ok &= valid
    num_accepted = ok.long().cumprod(dim=-1).sum(dim=-1)  # [B] length of the accepted prefix

    # Extra token at position k = num_accepted: recovered if k < num_drafts, else bonus.
    p_k = p[rows, num_accepted]  # [B, V]
    rejected = num_accepted < n_drafts  # [B]
    if q > 0:
        k_draft = num_accepted.clamp(max=q - 1)
        if dprobs is None:
            q_k = torch.zeros_like(p_k).scatter_(-1, drafts[rows, k_draft][:, None], 1.0)
        else:
            q_k = dprobs[rows, k_draft]
        res = _residual(p_k, q_k)
        # p == q leaves no residual; a rejection then has probability 0, fall back to p.
        res = torch.where(res.sum(-1, keepdim=True) > 0, res, p_k)
        dist = torch.where(rejected[:, None], res, p_k)
    else:
        dist = p_k
    extra = torch.where(greedy, p_k.argmax(-1), sample(dist, gens))  # [B]

    num_accepted_cpu = num_accepted.cpu()
    drafts_cpu = drafts.cpu().tolist()
    extra_cpu = extra.cpu().tolist()
    counts = num_accepted_cpu.tolist()
    out = [d[:n] + [e] for d, n, e in zip(drafts_cpu, counts, extra_cpu, strict=True)]
    return AcceptOutput(num_accepted=num_accepted_cpu, output_tokens=out)
