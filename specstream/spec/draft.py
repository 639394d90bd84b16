"""Draft-model proposer: a small LM with its own KV cache drafts q tokens per round.

Cache policies:
- ``window`` (default): attention sinks (the first few tokens) plus a recent window. The draft's
  memory and per-token cost stay bounded however long the context grows (a draft's cache is not
  small: Qwen3-0.6B needs 112 KiB a token), and a new request only prefills its sinks and last
  window. Drafts may get slightly worse at long range; verification keeps the output exact.
- ``full``: every token, like the target.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specstream.attention import ChunkedAttention, causal_mask
from specstream.engine.request import RequestError
from specstream.models.decoder import CausalLM
from specstream.sampling import logits_to_probs, make_generator, sample
from specstream.sampling_params import derive_seed
from specstream.spec.proposer import (
    Proposal,
    ProposeJob,
    Proposer,
    ProposeRequest,
    register_proposer,
)


class _SeqCache:
    """One request's draft KV: per layer a preallocated `[capacity, kv, D]` buffer, filled to
    ``length``. New tokens are written in place (no concatenation per step); the window policy
    evicts in batches, so a step attends over between ``window`` and ``window + slack`` recent
    tokens (plus the sinks)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.length = 0  # cached entries (every layer holds the same number)
        self.num_tokens = 0  # request tokens processed (evicted ones included)
        self.generator = generator

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, min_capacity: int) -> int:
        """Write ``k``/``v`` of the new tokens after the cached ones; returns the new length."""
        n, new = self.length, k.shape[0]
        if len(self.k) <= layer:
            shape = (max(min_capacity, n + new), *k.shape[1:])
            self.k.append(k.new_empty(shape))
            self.v.append(v.new_empty(shape))
        if n + new > self.k[layer].shape[0]:
            grow = max(2 * self.k[layer].shape[0], n + new)
            for buf in (self.k, self.v):
                bigger = buf[layer].new_empty((grow, *buf[layer].shape[1:]))
                bigger[:n] = buf[layer][:n]
                buf[layer] = bigger
        self.k[layer][n : n + new] = k
        self.v[layer][n : n + new] = v
        return n + new

    def evict(self, keep_head: int, keep_recent: int) -> None:
        """Keep the first ``keep_head`` and the last ``keep_recent`` entries of every layer."""
        n = self.length
        for buf in (*self.k, *self.v):
            buf[keep_head : keep_head + keep_recent] = buf[n - keep_recent : n].clone()
        self.length = keep_head + keep_recent


class _DraftAttention:
    """AttentionContext over per-request contiguous draft caches (one piece per request)."""

    def __init__(self, caches: list[_SeqCache], rows: list[tuple[int, int]], scale: float,
                 capacity: int) -> None:
        self.caches, self.rows, self.scale, self.capacity = caches, rows, scale, capacity
        self.masks = [causal_mask(hi - lo, c.length + hi - lo) if hi - lo > 1 else None
                      for c, (lo, hi) in zip(caches, rows)]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        for c, (lo, hi), mask in zip(self.caches, self.rows, self.masks):
            n = c.append(layer, k[lo:hi], v[lo:hi], self.capacity)
            att = ChunkedAttention(q[lo:hi], k.shape[1], self.scale)
            att.add(c.k[layer][:n], c.v[layer][:n], mask)
            out[lo:hi] = att.result(q.dtype)
        return out


@register_proposer("draft")
class DraftModelProposer(Proposer):
    def __init__(
        self, model: CausalLM, cache: str = "window", window_tokens: int = 1024,
        sink_tokens: int = 4, max_draft_tokens: int = 16,
    ) -> None:
        if cache not in ("window", "full"):
            raise ValueError(f"draft cache policy must be 'window' or 'full', got {cache!r}")
        if cache == "window" and window_tokens <= max_draft_tokens:
            raise ValueError("draft window must exceed the number of draft tokens")
        self.model, self.policy = model, cache
        self.window, self.sinks = window_tokens, sink_tokens
        # window policy: evict once the window overgrows by this much (one copy per `slack`
        # tokens instead of one per step)
        self.slack = 64
        self.capacity = (sink_tokens + window_tokens + self.slack + 2 * max_draft_tokens
                         if cache == "window" else 2048)
        self.device = next(model.parameters()).device
        self.caches: dict[str, _SeqCache] = {}
        self.forward_s = 0.0

    # ---- cache maintenance ----------------------------------------------------------
    def _catch_up(self, c: _SeqCache, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """Tokens (and positions) the draft has not processed yet."""
        start = c.num_tokens
        todo = list(range(start, len(tokens)))
        if self.policy == "window" and start == 0 and len(todo) > self.sinks + self.window:
            todo = todo[: self.sinks] + todo[-self.window :]
        return [tokens[p] for p in todo], todo

    def _evict(self, c: _SeqCache) -> None:
        if self.policy == "window" and c.length > self.sinks + self.window + self.slack:
            c.evict(self.sinks, self.window)

    def rollback(self, request_id: str, num_tokens_kept: int) -> None:
        c = self.caches.get(request_id)
        if c is None or c.num_tokens <= num_tokens_kept:
            return
        drop = c.num_tokens - num_tokens_kept
        c.length = max(0, c.length - drop)
        c.num_tokens = num_tokens_kept

    def free(self, request_id: str) -> None:
        self.caches.pop(request_id, None)

    # ---- drafting -------------------------------------------------------------------
    @torch.no_grad()
    def _forward(
        self, caches: list[_SeqCache], tokens: list[list[int]], positions: list[list[int]]
    ) -> torch.Tensor:
        """Feed each request its tokens; returns last-position logits [B, V] (fp32)."""
        rows, row = [], 0
        for t in tokens:
            rows.append((row, row + len(t)))
            row += len(t)
        ids = torch.tensor([x for t in tokens for x in t], dtype=torch.long, device=self.device)
        pos = torch.tensor([x for p in positions for x in p], dtype=torch.long, device=self.device)
        ctx = _DraftAttention(caches, rows, self.model.config.head_dim**-0.5, self.capacity)
        hidden = self.model(ids, pos, ctx)
        for c, p, (lo, hi) in zip(caches, positions, rows):
            c.length += hi - lo
            c.num_tokens = p[-1] + 1 if p else c.num_tokens
            self._evict(c)
        last = torch.tensor([hi - 1 for _, hi in rows], device=self.device)
        return self.model.compute_logits(hidden[last])

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        job = self.start(requests)
        while job.step():
            pass
        return job.result()

    def start(self, requests: Sequence[ProposeRequest]) -> DraftJob:
        """Drafting as a job that advances one draft forward pass per ``step()``, so the engine
        can run it in the gaps that transfers leave."""
        return DraftJob(self, requests)


class DraftJob(ProposeJob):
    """Drafts for a batch of requests, one batched draft forward per ``step``."""

    def __init__(self, proposer: DraftModelProposer, requests: Sequence[ProposeRequest]) -> None:
        super().__init__(proposer, requests)
        self.p = proposer
        self.active = [r for r in self.requests if r.num_tokens > 0]
        self.caches = []
        for r in self.active:
            c = proposer.caches.get(r.request_id)
            if c is None:
                c = proposer.caches[r.request_id] = _SeqCache(_draft_generator(r, proposer.device))
            self.caches.append(c)
        feeds = [proposer._catch_up(c, r.token_ids) for c, r in zip(self.caches, self.active)]
        self.tokens = [f[0] for f in feeds]
        self.positions = [f[1] for f in feeds]
        self.drafted: list[list[int]] = [[] for _ in self.active]
        self.probs: list[list[torch.Tensor]] = [[] for _ in self.active]
        self.live = list(range(len(self.active)))
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return not self.live

    def step(self) -> bool:
        """One draft forward for every request still drafting; True while work remains."""
        if not self.live:
            return False
        live, active, caches = self.live, self.active, self.caches
        logits = self.p._forward([caches[i] for i in live], [self.tokens[i] for i in live],
                                 [self.positions[i] for i in live])
        params = [active[i].params for i in live]
        p = logits_to_probs(
            logits, [x.temperature for x in params], [x.top_k for x in params],
            [x.top_p for x in params],
        )
        nxt = sample(p, [caches[i].generator for i in live])
        still = []
        for j, i in enumerate(live):
            self.drafted[i].append(int(nxt[j]))
            self.probs[i].append(p[j])
            if len(self.drafted[i]) < active[i].num_tokens:
                pos = len(active[i].token_ids) + len(self.drafted[i]) - 1
                self.tokens[i], self.positions[i] = [int(nxt[j])], [pos]
                still.append(i)
        self.live = still
        self.num_steps += 1
        return bool(self.live)

    def result(self) -> list[Proposal]:
        while self.step():
            pass
        out = {r.request_id: Proposal([]) for r in self.requests}
        for i, r in enumerate(self.active):
            probs = None if r.params.greedy else torch.stack(self.probs[i])
            out[r.request_id] = Proposal(self.drafted[i], probs)
        return [out[r.request_id] for r in self.requests]


def _draft_generator(r: ProposeRequest, device: torch.device) -> torch.Generator | None:
    """The request's draft generator: seeded apart from the target's stream, so drafts and
    verification draw independent randomness."""
    gen = make_generator(r.params, device)
    if gen is not None:
        try:
            gen.manual_seed(derive_seed(r.params.seed or 0, 0x5EED))
        except (RuntimeError, ValueError, OverflowError) as exc:
            raise RequestError(r.request_id, f"cannot seed the draft generator: {exc}") from exc
    return gen
