"""Draft-model proposer: a small LM with its own KV cache drafts q tokens per round.

Cache policies:
- ``window`` (default): attention sinks (the first few tokens) plus a recent window. The draft's
  memory and per-token cost stay bounded however long the context grows (a draft's cache is not
  small: Qwen3-0.6B needs 112 KiB a token), and a new request only prefills its sinks and last
  window. Drafts may get slightly worse at long range; verification keeps the output exact.
- ``full``: every token, like the target.

The draft KV of all requests lives in one pool, ``[layers, 2, slots, capacity, kv_heads, D]``, a
slot per request (taken on its first draft, given back by ``free``). A draft forward writes the
new tokens' K/V into their slots with one copy per layer and attends each query bucket (the
1-token draft steps together, each long window prefill alone: ``engine.attention.buckets_of``)
with one call of the ``WaveAttention`` backend over the bucket's slots (a view of the pool when
the slots are consecutive).

Draft steps never read a tensor value on the host: the next step's input ids are the tensor the
previous step sampled, index lists reach the device in one pinned, non-blocking copy per step,
and which request drafts in which step follows from the requested counts. ``DraftJob.result``
brings every drafted token back in one read-back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from specstream.attention.waves import TorchWaves, WaveAttention, WaveShape
from specstream.backends.base import upload
from specstream.engine.attention import buckets_of
from specstream.engine.request import RequestError
from specstream.models.decoder import CausalLM
from specstream.sampling import SamplingTensors, logits_to_probs, make_generator, sample
from specstream.sampling_params import derive_seed
from specstream.spec.proposer import (
    Proposal,
    ProposeJob,
    Proposer,
    ProposeRequest,
    register_proposer,
)


def _consecutive(xs: Sequence[int]) -> bool:
    return all(b == a + 1 for a, b in zip(xs, xs[1:]))


class _KVPool:
    """The draft KV of every request: ``kv`` ``[layers, 2, slots, capacity, kv_heads, D]``.

    It grows (one copy of everything) when a request needs a slot and none is free, or a slot
    needs more than ``capacity`` entries; the window policy sizes ``capacity`` so that the
    latter does not happen in steady state. A freed slot's memory waits for the next request.
    """

    def __init__(self, model: CausalLM, capacity: int) -> None:
        cfg, weight = model.config, next(model.parameters())
        self.kv = weight.new_zeros(
            (len(model.layers), 2, 0, capacity, cfg.num_kv_heads, cfg.head_dim))
        self.free: list[int] = []

    @property
    def num_slots(self) -> int:
        return self.kv.shape[2]

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def take(self, count: int) -> list[int]:
        """``count`` free slots, lowest first (a batch's slots then tend to be consecutive)."""
        if len(self.free) < count:
            first = self.num_slots
            self._grow(first + count - len(self.free), self.capacity)
            self.free += range(first, self.num_slots)
        self.free.sort()
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def give_back(self, slot: int) -> None:
        self.free.append(slot)

    def reserve(self, entries: int) -> None:
        """Room for ``entries`` entries in every slot."""
        if entries > self.capacity:
            self._grow(self.num_slots, max(2 * self.capacity, entries))

    def _grow(self, num_slots: int, capacity: int) -> None:
        old = self.kv
        # zeros, not garbage: a batch's keys are padded with entries past a slot's length, and
        # a NaN there would leak through its zero attention weight
        self.kv = old.new_zeros((old.shape[0], 2, num_slots, capacity, *old.shape[4:]))
        self.kv[:, :, : old.shape[2], : old.shape[3]] = old
        if old.is_cuda and old.numel():  # the copy may run on another stream than old's
            old.record_stream(torch.cuda.current_stream(old.device))

    def write(self, layer: int, index: Tensor, k: Tensor, v: Tensor) -> None:
        """New tokens' ``k``, ``v`` ``[n, kv_heads, D]`` into the flat rows ``index`` ``[n]``
        (``slot * capacity + entry``)."""
        _, _, s, c, h, d = self.kv.shape
        self.kv[layer, 0].view(s * c, h, d).index_copy_(0, index, k)
        self.kv[layer, 1].view(s * c, h, d).index_copy_(0, index, v)

    def keys(self, layer: int, slots: Tensor | None, first: int, count: int, num_keys: int
             ) -> tuple[Tensor, Tensor]:
        """K and V ``[count, num_keys, kv_heads, D]`` of ``count`` slots: a view of slots
        ``first`` onwards when ``slots`` is None, else a gather of ``slots`` ``[count]``."""
        if slots is None:
            x = self.kv[layer, :, first : first + count, :num_keys]
        else:
            x = self.kv[layer, :, :, :num_keys].index_select(1, slots)
        return x[0], x[1]

    def evict(self, slot: int, length: int, keep_head: int, keep_recent: int) -> None:
        """Keep the first ``keep_head`` and the last ``keep_recent`` of a slot's ``length``
        entries, in every layer."""
        x = self.kv[:, :, slot]  # [layers, 2, capacity, kv_heads, D]
        recent = x[:, :, length - keep_recent : length].clone()
        x[:, :, keep_head : keep_head + keep_recent] = recent


class _SeqCache:
    """One request's draft KV: its slot in the pool, filled to ``length`` (every layer holds the
    same number). The window policy evicts in batches, so a step attends over between
    ``window`` and ``window + slack`` recent tokens (plus the sinks)."""

    def __init__(self, pool: _KVPool, slot: int, generator: torch.Generator | None) -> None:
        self.pool, self.slot, self.generator = pool, slot, generator
        self.length = 0  # cached entries
        self.num_tokens = 0  # request tokens processed (evicted ones included)

    @property
    def k(self) -> Tensor:  # [layers, capacity, kv_heads, D], filled to length
        return self.pool.kv[:, 0, self.slot]

    @property
    def v(self) -> Tensor:  # [layers, capacity, kv_heads, D]
        return self.pool.kv[:, 1, self.slot]


@dataclass
class _Bucket:
    """Requests of one forward attended in one call, queries padded to ``num_q``."""

    num_rows: int  # W requests
    num_q: int  # P query positions each
    q_first: int  # the queries are token rows q_first .. + W * P (when q_index is None)
    q_index: Tensor | None  # [W * P] else: the token row of each padded query position
    first_slot: int  # the slots are first_slot .. + W (when slots is None: a view)
    slots: Tensor | None  # [W] else
    num_keys: int  # N: the most entries among them, new tokens included
    shape: WaveShape


class _DraftForward:
    """One draft forward over a batch of requests' slots, as the model's AttentionContext.

    Laid out on the host from lengths alone; its index tensors reach the device in one transfer
    (with ``extra``, int lists the caller wants there too). Per layer, ``attend`` writes the new
    tokens' K/V into their slots and makes one attention call per query bucket.
    """

    def __init__(self, pool: _KVPool, caches: list[_SeqCache], counts: list[int],
                 positions: list[int], attention: type[WaveAttention], scale: float,
                 extra: Sequence[Sequence[int] | None]) -> None:
        self.pool, self.attention, self.scale = pool, attention, scale
        cap = pool.capacity
        rows = [0, *accumulate(counts)]  # request i's tokens are rows rows[i] .. rows[i + 1]
        write = [c.slot * cap + c.length + t for c, n in zip(caches, counts) for t in range(n)]
        last = None if all(n == 1 for n in counts) else [r - 1 for r in rows[1:]]
        out_index = [0] * rows[-1]  # token row -> row of the buckets' concatenated outputs
        layout, lists, base = [], [], 0
        for members in buckets_of(counts):
            seqs = [caches[i] for i in members]
            w, p = len(members), max(counts[i] for i in members)
            for j, i in enumerate(members):
                for t in range(counts[i]):
                    out_index[rows[i] + t] = base + j * p + t
            base += w * p
            dense = _consecutive(members) and all(counts[i] == p for i in members)
            slots = [c.slot for c in seqs]
            key_len = [c.length + counts[i] for c, i in zip(seqs, members)]
            n_keys = max(key_len)
            layout.append((w, p, rows[members[0]] if dense else -1,
                           slots[0] if _consecutive(slots) else -1, n_keys,
                           p == 1 and all(n == n_keys for n in key_len)))
            lists += [
                None if dense else [rows[i] + min(t, counts[i] - 1)
                                    for i in members for t in range(p)],
                None if _consecutive(slots) else slots,
                key_len,
                # a single query sees all its request's keys: no causal offset needed
                None if p == 1 else [c.length for c in seqs],
            ]
        identity = base == rows[-1] and out_index == list(range(base))  # no padding
        sent = upload([positions, write, last, None if identity else out_index, *extra, *lists],
                       torch.long, pool.kv.device)
        self.positions, self.write, self.last, self.out_index = sent[:4]
        self.extra = sent[4 : 4 + len(extra)]
        self.buckets = []
        for b, (w, p, q_first, first_slot, n_keys, full) in enumerate(layout):
            q_index, slot_index, key_len_t, offset = sent[4 + len(extra) + 4 * b :][:4]
            assert key_len_t is not None
            self.buckets.append(_Bucket(w, p, q_first, q_index, first_slot, slot_index, n_keys,
                                        WaveShape(None, key_len_t, offset, full)))

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q: [num_tokens, heads, D]; k, v: [num_tokens, kv_heads, D] -> [num_tokens, heads, D]
        assert self.write is not None
        self.pool.write(layer, self.write, k, v)
        outs = []
        for b in self.buckets:
            w, p = b.num_rows, b.num_q
            qb = q[b.q_first : b.q_first + w * p] if b.q_index is None else q.index_select(
                0, b.q_index)
            kb, vb = self.pool.keys(layer, b.slots, b.first_slot, w, b.num_keys)
            att = self.attention(qb.reshape(w, p, *q.shape[1:]), k.shape[1], self.scale)
            att.add(kb, vb, b.shape)
            outs.append(att.result().flatten(0, 1))  # [W * P, heads, D]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if self.out_index is None else out.index_select(0, self.out_index)


@register_proposer("draft")
class DraftModelProposer(Proposer):
    def __init__(
        self, model: CausalLM, cache: str = "window", window_tokens: int = 1024,
        sink_tokens: int = 4, max_draft_tokens: int = 16,
        attention: type[WaveAttention] = TorchWaves,
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
        self.capacity = (sink_tokens + window_tokens + self.slack + 2 * max_draft_tokens
                         if cache == "window" else 2048)
        self.device = next(model.parameters()).device
        self.pool = _KVPool(model, self.capacity)
        self.caches: dict[str, _SeqCache] = {}
        self.forward_s = 0.0

    # ---- cache maintenance ----------------------------------------------------------
    def _catch_up(self, c: _SeqCache, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """Tokens (and positions) the draft has not processed yet; at least the last token (a
        request with nothing new feeds its last token again, its cache rolled back by one)."""
        if c.num_tokens >= len(tokens) > 0:
            self._rollback(c, len(tokens) - 1)
        start = c.num_tokens
        todo = list(range(start, len(tokens)))
        if self.policy == "window" and start == 0 and len(todo) > self.sinks + self.window:
            todo = todo[: self.sinks] + todo[-self.window :]
        return [tokens[p] for p in todo], todo

    def _evict(self, c: _SeqCache) -> None:
        if self.policy == "window" and c.length > self.sinks + self.window + self.slack:
            self.pool.evict(c.slot, c.length, self.sinks, self.window)
            c.length = self.sinks + self.window

    def rollback(self, request_id: str, num_tokens_kept: int) -> None:
        c = self.caches.get(request_id)
        if c is not None:
            self._rollback(c, num_tokens_kept)

    @staticmethod
    def _rollback(c: _SeqCache, num_tokens_kept: int) -> None:
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
    def _prepare(self, caches: list[_SeqCache], counts: list[int], positions: list[int],
                 extra: Sequence[Sequence[int] | None]) -> _DraftForward:
        """The layout of a forward feeding ``counts[i]`` tokens to request i (``positions``
        flattened), with the pool grown to hold them."""
        self.pool.reserve(max(c.length + n for c, n in zip(caches, counts)))
        return _DraftForward(self.pool, caches, counts, positions, self.attention,
                             self.model.config.head_dim**-0.5, extra)

    @torch.no_grad()
    def _forward(self, fwd: _DraftForward, ids: Tensor, caches: list[_SeqCache],
                 counts: list[int], last_pos: list[int]) -> Tensor:
        """Run the forward (``ids`` ``[num_tokens]``); returns last-position logits ``[B, V]``
        (fp32)."""
        assert fwd.positions is not None
        hidden = self.model(ids, fwd.positions, fwd)  # [num_tokens, hidden]
        for c, n, pos in zip(caches, counts, last_pos):
            c.length += n
            c.num_tokens = pos + 1
            self._evict(c)
        return self.model.compute_logits(
            hidden if fwd.last is None else hidden.index_select(0, fwd.last))

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        return self.start(requests).result()

    def start(self, requests: Sequence[ProposeRequest]) -> DraftJob:
        """Drafting as a job that advances one draft forward pass per ``step()``, so the engine
        can run it in the gaps that transfers leave."""
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
        self.active = [r for r in self.requests if r.num_tokens > 0]
        new = {r.request_id: r for r in self.active if r.request_id not in p.caches}
        gens = [_draft_generator(r, p.device) for r in new.values()]  # may refuse a request
        for rid, gen, slot in zip(new, gens, p.pool.take(len(new))):
            p.caches[rid] = _SeqCache(p.pool, slot, gen)
        self.caches = [p.caches[r.request_id] for r in self.active]
        feeds = [p._catch_up(c, r.token_ids) for c, r in zip(self.caches, self.active)]
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
        fwd = self.p._prepare(caches, counts, positions, [feed, rows])
        ids = fwd.extra[0]
        if s > 0:
            prev_tokens = self.steps[-1].tokens
            ids = prev_tokens if ids is None else prev_tokens.index_select(0, ids)
        assert ids is not None
        last_pos = [pos[-1] for pos in self.positions] if s == 0 else positions
        logits = self.p._forward(fwd, ids, caches, counts, last_pos)
        if self.sampling is None:
            tokens, probs = logits.argmax(dim=-1), None
        else:
            params = [active[i].params for i in live]
            st = _rows(self.sampling, fwd.extra[1])
            probs = logits_to_probs(
                logits, st.temperature, st.top_k, st.top_p,
                filters=any(x.top_k > 0 or x.top_p < 1 for x in params),
                any_greedy=any(x.temperature == 0 for x in params))
            tokens = sample(probs, [c.generator for c in caches])
        self.steps.append(_Step(live, tokens, probs))
        self.live = [i for i in live if active[i].num_tokens > s + 1]
        self.num_steps += 1
        return bool(self.live)

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


def _rows(t: SamplingTensors, rows: Tensor | None) -> SamplingTensors:
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
