"""Verification of draft tokens against the target model: one function for the whole batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specstream.backends.base import to_device
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


def accept_mask(
    u: Tensor,  # [B, Q] uniform in [0, 1)
    p_x: Tensor,  # [B, Q] target probability of each draft token
    q_x: Tensor,  # [B, Q] draft probability of each draft token
) -> Tensor:  # [B, Q] bool
    # Accept x with probability min(1, p(x) / q(x)), i.e. iff u < p(x) / q(x). Written as
    # u * q(x) < p(x) so that q(x) = 0 needs no division and p(x) = 0 always rejects.
    return u * q_x < p_x


def residual(
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
    distribution and q the draft distribution. The target logits come processed by
    ``sampling.process_logits`` where a request has a bias, a penalty or min_tokens (each draft
    position as if the drafts before it had been generated); temperature, min-p, top-k and top-p
    are applied here. ``draft_probs`` are what the drafts were drawn from (any distribution
    keeps the output exact; the closer to p, the more is accepted).

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
    num_accepted, tokens = accept_drafts_on_device(
        target_logits, draft_tokens, num_drafts, draft_probs, params, generators)
    rows = torch.cat([num_accepted[:, None], tokens], dim=1).tolist()  # the one sync
    out = [r[1 : 1 + r[0]] + [r[1 + r[0]]] for r in rows]
    return AcceptOutput(num_accepted=torch.tensor([r[0] for r in rows]), output_tokens=out)


def accept_drafts_on_device(
    target_logits: Tensor,  # [B, Q+1, V]
    draft_tokens: Tensor,  # [B, Q] int64, padded past num_drafts[b] (any value)
    num_drafts: Tensor | Sequence[int],  # [B], 0 <= num_drafts[b] <= Q
    draft_probs: Tensor | None,  # [B, Q, V] or None (point-mass drafts)
    params: Sequence[SamplingParams] | SamplingTensors,  # one per row
    generators: Sequence[torch.Generator | None] | None = None,
) -> tuple[Tensor, Tensor]:  # num_accepted [B] int64, tokens [B, Q+1] int64, on the device
    """``accept_drafts`` without reading anything back: request b's tokens are
    ``tokens[b, :num_accepted[b] + 1]`` (accepted drafts, then the recovered or bonus token).

    Nothing here waits for the device when ``num_drafts`` is a host sequence (or CPU tensor) and
    ``params`` are SamplingParams: lengths, greedy rows and filters are known on the host.
    """
    bsz, q_plus_1, vocab = target_logits.shape
    q = q_plus_1 - 1
    dev = target_logits.device
    if draft_tokens.shape != (bsz, q):
        raise ValueError(f"draft_tokens shape {tuple(draft_tokens.shape)} != {(bsz, q)}")
    # host values (reading a device tensor here would cost a sync)
    counts = [int(c) for c in (num_drafts.tolist() if isinstance(num_drafts, Tensor)
                               else num_drafts)]
    if len(counts) != bsz or any(not 0 <= c <= q for c in counts):
        raise ValueError(f"num_drafts must be [B] ints in [0, {q}], got {counts}")
    n_drafts = to_device(counts, torch.int64, dev)
    temp: Tensor | list[float]
    top_k: Tensor | list[int]
    top_p: Tensor | list[float]
    min_p: Tensor | list[float] | float
    if isinstance(params, SamplingTensors):
        st = params.repeat_interleave(q_plus_1)
        greedy_rows = params.greedy.tolist()  # tensors given: reading them costs a sync
        temp, top_k, top_p = st.temperature, st.top_k, st.top_p
        min_p = 0.0 if st.min_p is None else st.min_p
    else:
        greedy_rows = [p.greedy for p in params]
        temp = [p.temperature for p in params for _ in range(q_plus_1)]
        top_k = [p.top_k for p in params for _ in range(q_plus_1)]
        top_p = [p.top_p for p in params for _ in range(q_plus_1)]
        min_p = [p.min_p for p in params for _ in range(q_plus_1)]
    greedy = to_device(greedy_rows, torch.bool, dev)  # [B]

    p = logits_to_probs(target_logits.reshape(-1, vocab), temp, top_k, top_p, min_p=min_p)
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
    gens = [None if g else gen for g, gen in zip(greedy_rows, gens, strict=True)]
    u = uniform(counts, q, gens, dev)
    ok = torch.where(greedy[:, None], drafts == p[:, :q].argmax(-1), accept_mask(u, p_x, q_x))
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
        res = residual(p_k, q_k)
        # p == q leaves no residual; a rejection then has probability 0, fall back to p.
        res = torch.where(res.sum(-1, keepdim=True) > 0, res, p_k)
        dist = torch.where(rejected[:, None], res, p_k)
    else:
        dist = p_k
    extra = torch.where(greedy, p_k.argmax(-1), sample(dist, gens))  # [B]
    tokens = torch.cat([drafts, drafts.new_zeros(bsz, 1)], dim=1)  # [B, Q+1]
    tokens = tokens.scatter(1, num_accepted[:, None], extra[:, None])
    return num_accepted, tokens
