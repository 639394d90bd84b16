"""Logits -> processed probabilities -> tokens, vectorised over the batch.

Greedy is a special case everywhere: rows with temperature 0 become a one-hot distribution at the
argmax, so acceptance and sampling need no separate greedy branch to be correct.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
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
    min_p: Tensor | None = None  # [N] fp32, 0 = off (None: off for every row)

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
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
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
            None if self.min_p is None else self.min_p.repeat_interleave(repeats),
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
    min_p: RowParam = 0.0,  # [N] or scalar, 0 = off
) -> Tensor:  # [N, V] fp32
    """Apply temperature, then min-p, then top-k, then top-p (nucleus), and return fp32
    probabilities (vLLM's order).

    Min-p drops the tokens whose probability is below ``min_p`` times the most likely one's.
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
    if isinstance(min_p, Tensor) or any(m > 0 for m in _as_list(min_p, n)):
        # p(v) >= min_p * max p  <=>  x(v) >= max x + log(min_p) (min_p = 0: log is -inf)
        floor = x.max(dim=-1, keepdim=True).values + _row_tensor(
            min_p, n, torch.float32, dev).log()[:, None]
        x = x.masked_fill(x < floor, float("-inf"))

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


@dataclass(frozen=True)
class TokenContext:
    """What the logits processing of one request's positions in a round needs besides the
    logits: the tokens before its first position."""

    # Tokens generated before the first position (min_tokens counts them).
    output_len: int = 0
    # The prompt and the generated tokens before the first position; only read with a penalty
    # (repetition counts both, presence and frequency the generated ones).
    prompt: Sequence[int] = ()
    output: Sequence[int] = ()


def process_logits(
    logits: Tensor,  # [R, V], every request's rows consecutive
    params: Sequence[SamplingParams],  # one per request
    contexts: Sequence[TokenContext],  # one per request
    paths: Sequence[Sequence[Sequence[int]]],  # per request, per row: draft tokens before it
    stop_ids: Collection[int] = (),  # end-of-sequence ids (min_tokens masks them too)
) -> Tensor:  # [R, V] fp32; ``logits`` itself where no request processes its logits
    """vLLM's logits processors before temperature: ``logit_bias``, ``min_tokens``, then the
    repetition, frequency and presence penalties (``SamplingParams``).

    Row r of a request sees the tokens generated before the round (``contexts``) followed by
    the draft tokens on its path (``paths``: row 0, the last accepted token's prediction, has
    none; in a chain row j has drafts 0..j-1, in a tree row 1 + i the nodes from the root to
    node i). So every draft position is processed as if the drafts before it had been generated,
    and acceptance against it is as lossless as against target-only decoding with the same
    parameters: the target's distribution at each position is the one that decoding has there.
    """
    if not any(p.processes_logits for p in params):
        return logits
    rows_of = [len(r) for r in paths]
    if sum(rows_of) != logits.shape[0] or not len(params) == len(paths) == len(contexts):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(params)} requests of "
                         f"{rows_of} rows")
    x = logits.float().clone()
    dev, vocab = x.device, x.shape[-1]
    cells: list[int] = []  # flat (row * V + token) of additions and their values
    adds: list[float] = []
    masked: list[int] = []  # flat cells set to -inf (min_tokens)
    start = 0
    for p, ctx, rows in zip(params, contexts, paths):
        if p.logit_bias:
            for r in range(len(rows)):
                for tok, value in p.logit_bias.items():
                    if tok < vocab:
                        cells.append((start + r) * vocab + tok)
                        adds.append(value)
        if p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(stop_ids))
            for r, path in enumerate(rows):
                if ctx.output_len + len(path) < p.min_tokens:
                    masked += [(start + r) * vocab + t for t in stops if t < vocab]
        start += len(rows)
    flat = x.view(-1)
    if cells:
        idx, val = to_device(cells, torch.int64, dev), to_device(adds, torch.float32, dev)
        flat.index_add_(0, idx, val)
    if masked:
        flat.index_fill_(0, to_device(masked, torch.int64, dev), float("-inf"))
    if any(p.penalized for p in params):
        _penalize(x, params, contexts, paths)
    return x


def _penalize(
    x: Tensor,  # [R, V] fp32, changed in place
    params: Sequence[SamplingParams],
    contexts: Sequence[TokenContext],
    paths: Sequence[Sequence[Sequence[int]]],
) -> None:
    """Repetition (prompt and generated tokens), frequency and presence penalties (generated
    tokens), on the rows of the penalised requests."""
    dev, vocab = x.device, x.shape[-1]
    rows: list[int] = []  # the penalised rows
    count_cells: list[int] = []  # (k * V + token) per generated token, k the row's index here
    seen_cells: list[int] = []  # (k * V + token) per prompt token (repetition only)
    rep: list[float] = []
    freq: list[float] = []
    pres: list[float] = []
    start = 0
    for p, ctx, req_rows in zip(params, contexts, paths):
        if p.penalized:
            out = [t for t in ctx.output if t < vocab]
            prompt = ([t for t in ctx.prompt if t < vocab] if p.repetition_penalty != 1.0
                      else [])
            for r, path in enumerate(req_rows):
                k = len(rows)
                rows.append(start + r)
                count_cells += [k * vocab + t for t in out]
                count_cells += [k * vocab + t for t in path if t < vocab]
                seen_cells += [k * vocab + t for t in prompt]
                rep.append(p.repetition_penalty)
                freq.append(p.frequency_penalty)
                pres.append(p.presence_penalty)
        start += len(req_rows)
    n = len(rows)
    counts = torch.zeros(n * vocab, dtype=torch.float32, device=dev)
    if count_cells:
        counts.index_add_(0, to_device(count_cells, torch.int64, dev),
                          torch.ones(len(count_cells), dtype=torch.float32, device=dev))
    counts = counts.view(n, vocab)
    seen = counts > 0
    if seen_cells:
        prompt_seen = torch.zeros(n * vocab, dtype=torch.bool, device=dev)
        prompt_seen[to_device(seen_cells, torch.int64, dev)] = True
        seen |= prompt_seen.view(n, vocab)
    row_t = to_device(rows, torch.int64, dev)
    rep_t, freq_t, pres_t = (to_device(v, torch.float32, dev)[:, None] for v in (rep, freq, pres))
    sub = x.index_select(0, row_t)  # [n, V]
    # CTRL's repetition penalty as vLLM applies it: a positive logit divided, a negative one
    # multiplied, for every token of the prompt or the output
    penalised = torch.where(sub > 0, sub / rep_t, sub * rep_t)
    sub = torch.where(seen, penalised, sub)
    sub = sub - freq_t * counts - pres_t * (counts > 0).float()
    x.index_copy_(0, row_t, sub)
