"""Logits -> processed probabilities -> tokens, vectorised over the batch.

Greedy is a special case everywhere: rows with temperature 0 become a one-hot distribution at the
argmax, so acceptance and sampling need no separate greedy branch to be correct.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specstream.backends.base import to_device
from specstream.sampling_params import SamplingParams

RowParam = Tensor | Sequence[float] | float


@dataclass(frozen=True)
class SamplingTensors:
    """The per-row sampling parameters of a batch, as tensors on the logits' device."""

    temperature: Tensor  # [N] fp32, 0 = greedy
    top_k: Tensor  # [N] int64, <= 0 = off
    top_p: Tensor  # [N] fp32, 1 = off

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu"
    ) -> SamplingTensors:
        """Stack one SamplingParams per row."""
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                     device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        )

    @property
    def greedy(self) -> Tensor:
        """[N] bool: rows decoded by argmax (temperature 0 or top_k 1)."""
        return (self.temperature == 0) | (self.top_k == 1)

    def repeat_interleave(self, repeats: int) -> SamplingTensors:
        """Each row repeated ``repeats`` times (one row per query position)."""
        return SamplingTensors(
            self.temperature.repeat_interleave(repeats),
            self.top_k.repeat_interleave(repeats),
            self.top_p.repeat_interleave(repeats),
        )


def make_generator(params: SamplingParams, device: torch.device | str = "cpu"
                   ) -> torch.Generator | None:
    """The request's own generator (seeded, on ``device``), or None to use the global one."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def _row_tensor(x: RowParam, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    if isinstance(x, Tensor):
        t = x.to(device=device, dtype=dtype)
    else:
        t = to_device([x] if isinstance(x, (int, float)) else list(x), dtype, device)
    return t.expand(n) if t.numel() == 1 and n != 1 else t


def _as_list(x: RowParam, n: int) -> list[float]:
    return [float(x)] * n if isinstance(x, (int, float)) else [float(v) for v in x]


def logits_to_probs(
    logits: Tensor,  # [N, V] any float dtype
    temperature: RowParam,  # [N] or scalar
    top_k: RowParam,  # [N] or scalar, <= 0 = off
    top_p: RowParam,  # [N] or scalar, 1 = off
    *,
    filters: bool | None = None,  # any row with top-k or top-p (None: found from the values)
    any_greedy: bool | None = None,  # any row with temperature 0 (None: likewise)
) -> Tensor:  # [N, V] fp32
    """Apply temperature, then top-k, then top-p (nucleus), and return fp32 probabilities.

    Top-p keeps the smallest set of most likely tokens whose cumulative probability (after top-k)
    is >= top_p; the most likely token is always kept. Rows with temperature 0 are one-hot at
    the argmax of the logits.
    """
    n, vocab = logits.shape
    dev = logits.device
    temp = _row_tensor(temperature, n, torch.float32, dev)
    k = _row_tensor(top_k, n, torch.int64, dev)
    p = _row_tensor(top_p, n, torch.float32, dev)
    x = logits.float()
    greedy = temp == 0
    x = x / torch.where(greedy, torch.ones_like(temp), temp)[:, None]

    use_k = k > 0
    use_p = p < 1
    # Whether any row filters or is greedy: given by the caller, or from the host values when
    # given as numbers (no device sync), else read from the tensors.
    if filters is None or any_greedy is None:
        if not any(isinstance(x, Tensor) for x in (temperature, top_k, top_p)):
            rows = [_as_list(x, n) for x in (temperature, top_k, top_p)]
            found = (any(kk > 0 or pp < 1 for kk, pp in zip(rows[1], rows[2])),
                     any(t == 0 for t in rows[0]))
        else:
            found = (bool((use_k | use_p).any()), bool(greedy.any()))
        filters = found[0] if filters is None else filters
        any_greedy = found[1] if any_greedy is None else any_greedy
    if filters:
        # Stable sort: among equal logits the lower token id ranks first, as in argmax.
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=dev)
        k_eff = torch.where(use_k, k.clamp(max=vocab), torch.full_like(k, vocab))
        sorted_x = sorted_x.masked_fill(rank[None, :] >= k_eff[:, None], float("-inf"))
        sorted_probs = sorted_x.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (mass_before >= p[:, None]) & use_p[:, None]
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)

    probs = x.softmax(dim=-1)
    if any_greedy:
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def sample(
    probs: Tensor,  # [N, V] probabilities (need not be normalised)
    generators: Sequence[torch.Generator | None] | None = None,
) -> Tensor:  # [N] int64
    """Draw one token per row by the exponential race.

    token = argmax_v probs[v] / E[v] with E[v] ~ Exp(1) i.i.d. (equivalent to Gumbel-max; the
    winner is distributed exactly as probs / sum(probs)). Zero-probability tokens never win, and
    one-hot rows always return their token. Rows with a generator draw their V exponentials from
    it (one draw of V values per call, whatever the batch), the rest share one batched draw from
    the global generator.
    """
    n, vocab = probs.shape
    noise = torch.empty_like(probs, dtype=torch.float32)
    gens = list(generators) if generators is not None else [None] * n
    if len(gens) != n:
        raise ValueError(f"got {len(gens)} generators for {n} rows")
    own = [i for i, g in enumerate(gens) if g is not None]
    if len(own) < n:
        noise.exponential_()
    for i in own:
        noise[i].exponential_(generator=gens[i])
    # An exact 0 from the exponential would turn 0/0 into NaN, which argmax would pick.
    noise.clamp_(min=torch.finfo(torch.float32).tiny)
    return (probs.float() / noise).argmax(dim=-1)


def uniform(
    num: Sequence[int],  # per row, how many values
    max_num: int,
    generators: Sequence[torch.Generator | None] | None,
    device: torch.device | str = "cpu",
) -> Tensor:  # [N, max_num] fp32 in [0, 1); entries past num[i] are unspecified
    """Uniform draws for acceptance tests; rows with a generator draw exactly num[i] values."""
    u = torch.rand(len(num), max_num, device=device)
    if generators is not None:
        for i, g in enumerate(generators):
            if g is not None and num[i] > 0:
                u[i, : num[i]] = torch.rand(num[i], generator=g, device=device)
    return u
