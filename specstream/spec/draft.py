"""Draft-model proposer: a small LM with its own KV cache drafts q tokens per round.

Cache policies:
- ``window`` (default): attention sinks (the first few tokens) plus a recent window. The draft's
  memory and per-token cost stay bounded however long the context grows (a draft's cache is not
  small: Qwen3-0.6B needs 112 KiB a token), and a new request only prefills its sinks and last
  window. Drafts may get slightly worse at long range; verification keeps the output exact.
- ``full``: every token, like the target.

The draft KV of all requests lives in one pool, a slot per request, and a draft forward attends
each query bucket of requests with one call per layer (``draft_kv.py``).

Draft steps never read a tensor value on the host: the next step's input ids are the tensor the
previous step sampled, index lists reach the device in one pinned, non-blocking copy per step,
and which request drafts in which step follows from the requested counts. ``DraftJob.result``
brings every drafted token back in one read-back.

Requests with ``topk > 1`` draft token trees instead (``draft_tree.py``): still one batched
forward per level, but each level's top-k comes back to the host to choose the next one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specstream.attention.waves import TorchWaves, WaveAttention
from specstream.backends.base import upload
from specstream.errors import RequestError
from specstream.models.decoder import CausalLM
from specstream.sampling import SamplingTensors, logits_to_probs, make_generator, sample
from specstream.sampling_params import derive_seed
from specstream.spec.draft_kv import DraftForward, DraftKVPool, DraftSeqCache, TreeQueries
from specstream.spec.proposer import (
    Proposal,
    ProposeJob,
    Proposer,
    ProposeRequest,
    register_proposer,
)
from specstream.structured.matcher import mask_logits


@register_proposer("draft")
class DraftModelProposer(Proposer):
    def __init__(
        self, model: CausalLM, cache: str = "window", window_tokens: int = 1024,
        sink_tokens: int = 4, max_draft_tokens: int = 16,
        attention: type[WaveAttention] = TorchWaves, max_draft_topk: int = 1,
    ) -> None:
        if cache not in ("window", "full"):
            raise ValueError(f"draft cache policy must be 'window' or 'full', got {cache!r}")
        if cache == "window" and window_tokens <= max_draft_tokens:
            raise ValueError("draft window must exceed the number of draft tokens")
        self.model, self.policy, self.attention = model, cache, attention
        self.window, self.sinks = window_tokens, sink_tokens
        # window policy: evict once the window overgrows by this much (one copy per `slack`
        # tokens instead of one per step)
        self.slack = 64
        # entries a round adds to an evicted window: a chain's catch-up and drafts (2 q); a
        # tree's catch-up (q + 1) and the nodes it feeds (topk per level but the last), which
        # stay until the round ends (``max_draft_topk``: the widest tree to size for; wider
        # ones grow the pool)
        self.capacity = (sink_tokens + window_tokens + self.slack
                         + (max(max_draft_topk, 1) + 1) * max_draft_tokens
                         if cache == "window" else 2048)
        self.device = next(model.parameters()).device
        self.pool = DraftKVPool(model, self.capacity)
        self.caches: dict[str, DraftSeqCache] = {}
        self.forward_s = 0.0

    # ---- cache maintenance ----------------------------------------------------------
    def catch_up(self, c: DraftSeqCache, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """Tokens (and positions) the draft has not processed yet; at least the last token (a
        request with nothing new feeds its last token again, its cache rolled back by one)."""
        c.drop_tree()  # a tree round's nodes (normally dropped when its job ended)
        if c.num_tokens >= len(tokens) > 0:
            self._rollback(c, len(tokens) - 1)
        start = c.num_tokens
        todo = list(range(start, len(tokens)))
        if self.policy == "window" and start == 0 and len(todo) > self.sinks + self.window:
            todo = todo[: self.sinks] + todo[-self.window :]
        return [tokens[p] for p in todo], todo

    def evict(self, c: DraftSeqCache) -> None:
        # never while tree nodes are cached: they would move into the window
        if (self.policy == "window" and c.tree_entries == 0
                and c.length > self.sinks + self.window + self.slack):
            self.pool.evict(c.slot, c.length, self.sinks, self.window)
            c.length = self.sinks + self.window

    def rollback(self, request_id: str, num_tokens_kept: int) -> None:
        c = self.caches.get(request_id)
        if c is not None:
            self._rollback(c, num_tokens_kept)

    @staticmethod
    def _rollback(c: DraftSeqCache, num_tokens_kept: int) -> None:
        c.drop_tree()
        if c.num_tokens <= num_tokens_kept:
            return
        drop = c.num_tokens - num_tokens_kept
        c.length = max(0, c.length - drop)
        c.num_tokens = num_tokens_kept

    def free(self, request_id: str) -> None:
        c = self.caches.pop(request_id, None)
        if c is not None:
            self.pool.give_back(c.slot)

    # ---- drafting -------------------------------------------------------------------
    def prepare(self, caches: list[DraftSeqCache], counts: list[int], positions: list[int],
                 extra: Sequence[Sequence[int] | None],
                 tree: Sequence[TreeQueries | None] | None = None) -> DraftForward:
        """The layout of a forward feeding ``counts[i]`` tokens to request i (``positions``
        flattened), with the pool grown to hold them; ``tree``: see ``DraftForward``."""
        self.pool.reserve(max(c.length + n for c, n in zip(caches, counts)))
        return DraftForward(self.pool, caches, counts, positions, self.attention,
                             self.model.config.head_dim**-0.5, extra, tree)

    @torch.no_grad()
    def forward(self, fwd: DraftForward, ids: Tensor, caches: list[DraftSeqCache],
                 counts: list[int], last_pos: list[int]) -> Tensor:
        """Run the forward (``ids`` ``[num_tokens]``); returns last-position logits ``[B, V]``
        (fp32)."""
        assert fwd.positions is not None
        hidden = self.model(ids, fwd.positions, fwd)  # [num_tokens, hidden]
        for c, n, pos in zip(caches, counts, last_pos):
            c.length += n
            c.num_tokens = pos + 1
            self.evict(c)
        return self.model.compute_logits(
            hidden if fwd.last is None else hidden.index_select(0, fwd.last))

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        return self.start(requests).result()

    def start(self, requests: Sequence[ProposeRequest]) -> DraftJob:
        """Drafting as a job that advances one draft forward pass per ``step()``, so the engine
        can run it in the gaps that transfers leave. A batch with a tree request (``topk > 1``)
        is a ``DraftTreeJob`` (its chain requests draft as chains there)."""
        if any(r.topk > 1 for r in requests):
            from specstream.spec.draft_tree import DraftTreeJob  # it builds on DraftJob

            return DraftTreeJob(self, requests)
        return DraftJob(self, requests)


@dataclass
class _Step:
    live: list[int]  # the job's requests this step drafted for, in row order
    tokens: Tensor  # [len(live)] int64 on the device: the drafted tokens
    probs: Tensor | None  # [len(live), V] fp32: what they were sampled from (None: all greedy)


class DraftJob(ProposeJob):
    """Drafts for a batch of requests, one batched draft forward per ``step``."""

    def __init__(self, proposer: DraftModelProposer, requests: Sequence[ProposeRequest]) -> None:
        super().__init__(proposer, requests)
        self.p = p = proposer
        self.active = [r for r in self.requests if r.num_tokens > 0 and (
            r.topk == 1 or request_max_nodes(r) > 0)]
        new = {r.request_id: r for r in self.active if r.request_id not in p.caches}
        gens = [_draft_generator(r, p.device) for r in new.values()]  # may refuse a request
        for rid, gen, slot in zip(new, gens, p.pool.take(len(new))):
            p.caches[rid] = DraftSeqCache(p.pool, slot, gen)
        self.caches = [p.caches[r.request_id] for r in self.active]
        feeds = [p.catch_up(c, r.token_ids) for c, r in zip(self.caches, self.active)]
        self.tokens = [f[0] for f in feeds]
        self.positions = [f[1] for f in feeds]
        params = [r.params for r in self.active]
        # all greedy: the draft is the argmax (what sampling a one-hot row gives), no probs
        self.greedy = all(x.temperature == 0 for x in params)
        self.sampling: SamplingTensors | None = None
        if not self.greedy:
            temp, top_p = upload([[x.temperature for x in params], [x.top_p for x in params]],
                                  torch.float32, p.device)
            (top_k,) = upload([[x.top_k for x in params]], torch.long, p.device)
            assert temp is not None and top_p is not None and top_k is not None
            self.sampling = SamplingTensors(temp, top_k, top_p)
        self.steps: list[_Step] = []
        self.live = list(range(len(self.active)))

    @property
    def done(self) -> bool:
        return not self.live

    def step(self) -> bool:
        """One draft forward for every request still drafting; True while work remains.

        Reads no tensor value: the first step feeds the host's catch-up tokens, every later one
        the tokens the step before sampled, still on the device."""
        if not self.live:
            return False
        live, s, active = self.live, len(self.steps), self.active
        caches = [self.caches[i] for i in live]
        if s == 0:
            counts = [len(t) for t in self.tokens]
            positions = [x for pos in self.positions for x in pos]
            feed: list[int] | None = [x for t in self.tokens for x in t]
        else:
            prev = self.steps[-1].live
            counts = [1] * len(live)
            positions = [len(active[i].token_ids) + s - 1 for i in live]
            feed = None if prev == live else [prev.index(i) for i in live]
        rows = None if self.greedy or len(live) == len(active) else live
        fwd = self.p.prepare(caches, counts, positions, [feed, rows])
        ids = fwd.extra[0]
        if s > 0:
            prev_tokens = self.steps[-1].tokens
            ids = prev_tokens if ids is None else prev_tokens.index_select(0, ids)
        assert ids is not None
        last_pos = [pos[-1] for pos in self.positions] if s == 0 else positions
        logits = self.p.forward(fwd, ids, caches, counts, last_pos)
        if any(active[i].allowed is not None for i in live):
            logits = self._grammar_masked(logits, live)
        if self.sampling is None:
            tokens, probs = logits.argmax(dim=-1), None
        else:
            params = [active[i].params for i in live]
            st = sampling_rows(self.sampling, fwd.extra[1])
            probs = logits_to_probs(
                logits, st.temperature, st.top_k, st.top_p,
                filters=any(x.top_k > 0 or x.top_p < 1 for x in params),
                any_greedy=any(x.temperature == 0 for x in params))
            tokens = sample(probs, [c.generator for c in caches])
        self.steps.append(_Step(live, tokens, probs))
        self.live = [i for i in live if active[i].num_tokens > s + 1]
        self.num_steps += 1
        return bool(self.live)

    def _grammar_masked(self, logits: Tensor, live: list[int]) -> Tensor:
        """Each constrained row masked by its grammar after the drafts made so far (reading
        them back: a structured request's draft step waits for the one before)."""
        drafted = [dict(zip(st.live, st.tokens.tolist())) for st in self.steps]
        rows = []
        for i in live:
            allowed = self.active[i].allowed
            rows.append(torch.ones(logits.shape[-1], dtype=torch.bool) if allowed is None
                        else allowed([d[i] for d in drafted]))
        return mask_logits(logits, torch.stack(rows))

    def device_tokens(self) -> Tensor | None:
        while self.step():
            pass
        return torch.cat([st.tokens for st in self.steps]) if self.steps else None

    def result(self, read: list[int] | None = None) -> list[Proposal]:
        if self._result is None:
            while self.step():
                pass
            self._result = self._collect(read)
        return self._result

    def _collect(self, read: list[int] | None) -> list[Proposal]:
        # the one read-back (unless the engine did it): every drafted token of every request
        flat = read if read is not None else (
            torch.cat([st.tokens for st in self.steps]).tolist() if self.steps else [])
        drafted: list[list[int]] = [[] for _ in self.active]
        probs: list[list[Tensor]] = [[] for _ in self.active]
        at = 0
        for st in self.steps:
            for j, i in enumerate(st.live):
                drafted[i].append(flat[at])
                at += 1
                if st.probs is not None:
                    probs[i].append(st.probs[j])
        out = {r.request_id: Proposal([]) for r in self.requests}
        for i, r in enumerate(self.active):
            out[r.request_id] = Proposal(
                drafted[i], None if r.params.greedy else torch.stack(probs[i]))
        return [out[r.request_id] for r in self.requests]


def request_max_nodes(r: ProposeRequest) -> int:
    """The node budget of a tree request (None: ``num_tokens``)."""
    return r.num_tokens if r.max_nodes is None else r.max_nodes


def sampling_rows(t: SamplingTensors, rows: Tensor | None) -> SamplingTensors:
    """The sampling parameters of ``rows`` ``[n]`` (all of them when None)."""
    if rows is None:
        return t
    return SamplingTensors(t.temperature.index_select(0, rows), t.top_k.index_select(0, rows),
                           t.top_p.index_select(0, rows))


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
