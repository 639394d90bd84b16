"""Continuous batching: admission against the KV budgets, chunked prefill, decode rounds.

The scheduler owns the requests and the pure-Python KV manager. Each step it hands the worker
one :class:`StepPlan` (the only thing the worker sees) and afterwards ``update`` folds the
worker's :class:`StepOutput` back into the requests: emitted tokens and stop checks, KV commits
(rejected drafts roll back), write-back plans, drafts for the next round, errors.

Admission reserves, per request, the device blocks its resident tail can ever need and the host
blocks its history can ever need (prompt + max_tokens), so an admitted request never runs out of
memory mid-way: when memory runs short new requests wait; nothing admitted is dropped.

With ``residency = "fill"`` the device blocks nobody reserved are not left idle: before each
step ``_rebalance`` shares them among the running requests as residency targets (equal shares,
``kvcache.manager.residency_targets``); a request over its target drops its oldest device
blocks (they have host copies), one well under it gets some of its streamed blocks promoted
back as they pass.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

from specstream.config import EngineConfig
from specstream.engine.contract import (
    DraftWork,
    SeqWork,
    StepOutput,
    StepPlan,
    StepUpdate,
    Writebacks,
)
from specstream.engine.layout import RuntimeLayout
from specstream.engine.policy.round_shape import Shape
from specstream.engine.policy.shaping import RoundShaper
from specstream.engine.request import Request, Status, TextCodec, TokenLogprobs
from specstream.engine.sched.host_split import by_layer, split_for_host
from specstream.kvcache.manager import KVManager, OffloadPolicy, residency_targets

# host_attention "auto": the host's share of each request's cold blocks until the link and
# the host have both been measured
UNMEASURED_HOST_SHARE = 0.25


@dataclass
class _Reservation:
    device_blocks: int  # the steady tail
    host_blocks: int  # the whole history
    restore_blocks: int = 0  # `restore` modes: its share of the two layers a step restores

    @property
    def device_total(self) -> int:
        return self.device_blocks + self.restore_blocks


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVManager,
        restore_layers: int | None = None,
        max_model_len: int = 1 << 62,
        eos_token_ids: Collection[int] = (),
        tokenizer: TextCodec | None = None,
        history_token_bytes: int = 0,
        num_layers: int = 1,
    ) -> None:
        self.config = config
        self.kv = kv
        # the model's layers (host_attention splits a request's cold blocks by layer)
        self.layers = num_layers
        # `restore` modes: the model's layer count. A step holds two layers of its requests'
        # history on the device (the one attended, the next one prefetched), in pool blocks
        # lent to the step; each request reserves its share (2 / layers of its host blocks).
        self.restore_layers = restore_layers
        # Runtime facts of the model: its context, its end-of-sequence ids, its tokenizer (the
        # output text, stop strings; None for a folder without one).
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._reserved: dict[str, _Reservation] = {}
        self._reserved_device = 0
        self._reserved_host = 0
        self._finished: list[str] = []  # since the last plan: the worker drops their state
        self.max_concurrency = 0
        self._rr = 0  # round-robin start when a step cannot take every running request
        # Overlapped modes verify one group per step while the other group drafts.
        spec = config.mode_spec
        self.two_groups = config.speculative and spec.two_groups
        self._parity = 0
        # speculative_policy "auto": the shape of each step's drafts (engine/shaping.py; the
        # engine feeds it what every round measured)
        self.shaper = (RoundShaper(config.q, spec.drafting, config.speculative_topk,
                                   config.num_draft_tokens)
                       if config.speculative and config.speculative_policy == "auto" else None)
        self._shape = Shape(config.q, config.speculative_topk,
                            config.num_draft_tokens if config.tree else 0)
        # What the engine last measured (note_step): the link's bytes/s and the compute time
        # of a step that carried a prefill chunk; with the bytes of one token of history,
        # whether a prefill chunk hides the history of every decoding request.
        self.history_token_bytes = history_token_bytes
        self._link_bps = 0.0
        self._chunk_s = 0.0
        # host_attention "auto" (engine/host_split.py): the worker's seconds per KV byte by
        # query positions per request (set by the engine once there is a worker), the device
        # time per round the host can have nothing to do (EWMA over decode rounds), whether
        # the last decode round was link-bound (else no host share), and the share of cold
        # blocks the last step with cold history gave the host
        self.host_cost: Callable[[int], float] | None = None
        self.host_serial_s = 0.0
        self.host_pays = True
        self.host_share = 0.0
        # `fill`: what the step needs beyond the shares, counted by _rebalance before it
        # allocates anything: restore-mode room for its history (pool blocks lent to it) and
        # the decode rounds' new blocks
        self._step_room = 0
        # prefix-cache hits of the requests admitted for the next step (StepPlan.cache_copies)
        self._cache_copies: list[tuple[str, int, int]] = []

    @classmethod
    def for_layout(cls, config: EngineConfig, layout: RuntimeLayout,
                   tokenizer: TextCodec | None = None) -> Scheduler:
        """The scheduler and its KV manager as the engine runs them on ``layout`` (the
        simulator's replay builds them the same way, without a model)."""
        policy = OffloadPolicy(offload=config.mode_spec.offload,
                               resident_tail_tokens=config.resident_tail_tokens,
                               offload_after_tokens=layout.offload_after_tokens,
                               chunk_tokens=config.chunk_tokens, residency=config.residency)
        kv = KVManager(config.block_size, layout.num_device_blocks, layout.num_host_blocks,
                       policy, prefix_caching=config.enable_prefix_caching)
        return cls(config, kv, restore_layers=layout.restore_layers,
                   max_model_len=layout.max_model_len, eos_token_ids=layout.eos_token_ids,
                   tokenizer=tokenizer,
                   history_token_bytes=layout.block_bytes // config.block_size,
                   num_layers=layout.num_layers)

    # ---- admission ----------------------------------------------------------------------
    @property
    def scratch_blocks(self) -> int:
        """Blocks kept free for prefill chunks beyond the tails' steady size (offload modes)."""
        if not self.kv.policy.offload:
            return 0
        want = -(-self.config.max_prefill_tokens // self.config.block_size) + 1
        # two blocks guarantee progress; chunks grow into whatever else is free
        return min(want, max(2, self.kv.device.num_blocks // 4))

    def reservation(self, req: Request) -> _Reservation:
        """Device blocks of the request's steady tail; host blocks of its whole history."""
        total = len(req.prompt_token_ids) + req.params.max_tokens
        bs, p = self.config.block_size, self.kv.policy
        step = self.config.verify_tokens
        if p.fill:  # the tail is the minimum; blocks beyond it are shared (_rebalance)
            tail = min(p.resident_tail_tokens, total) + step
        elif p.offload:
            tail = max(min(total, p.offload_after_tokens), p.resident_tail_tokens + bs) + step
            tail = min(tail, total + step)
        else:
            tail = total + step
        streamed = max(0, (total - p.resident_tail_tokens) // bs) if p.offload else 0
        return _Reservation(-(-tail // bs) + 1, self.kv.host_blocks_needed(total),
                            self._restore_blocks(streamed))

    def _restore_blocks(self, host_blocks: int) -> int:
        """Pool blocks that hold two layers of ``host_blocks`` blocks of history."""
        layers = self.restore_layers
        return -(-2 * host_blocks // layers) if layers else 0

    def _outstanding(self) -> int:
        """Blocks that admitted requests may still claim from the free pool (`tail`)."""
        held = {rid: len(s.device_blocks) for rid, s in self.kv.seqs.items()}
        return sum(max(0, r.device_blocks - held.get(rid, 0)) + r.restore_blocks
                   for rid, r in self._reserved.items())

    def _prefill_room(self, req: Request) -> int:
        """Tokens a prefill chunk of ``req`` may write now without touching others' reserve
        (`fill`: the free blocks beyond the step's working room, which _rebalance made at least
        the prefill scratch)."""
        rid, bs = req.request_id, self.config.block_size
        seq = self.kv.seqs.get(rid)
        held = len(seq.device_blocks) if seq else 0
        if self.kv.policy.fill:
            blocks = max(0, self.kv.device.num_free - self._step_room)
        else:
            own = max(0, self._reserved[rid].device_blocks - held)
            blocks = own + max(0, self.kv.device.num_free - self._outstanding())
        tail = req.num_computed_tokens - (seq.first * bs if seq else 0)
        return blocks * bs + (held * bs - tail)

    def check_fits(self, req: Request) -> None:
        """Raise if the request could never be admitted, even on an idle engine."""
        r = self.reservation(req)
        if r.device_total + self.scratch_blocks > self.kv.device.num_blocks:
            p = self.kv.policy
            if p.fill:
                remedy = (f"or lower resident_tail_tokens (now {p.resident_tail_tokens}: "
                          "every request keeps at least that many tokens on the device)")
            elif p.offload:
                remedy = (f"or lower offload_after_tokens (now {p.offload_after_tokens}: the "
                          "device keeps a request's KV until it passes that many tokens)")
            else:
                remedy = "or use an offloading mode"
            if r.restore_blocks:
                remedy += (f"; {r.restore_blocks} of them hold two restored layers of its "
                           "history (a streaming mode needs none)")
            raise ValueError(
                f"request needs {r.device_total + self.scratch_blocks} device KV blocks but the "
                f"device budget holds {self.kv.device.num_blocks}; raise device_kv_bytes "
                + remedy)
        if r.host_blocks > self.kv.host.num_blocks:
            raise ValueError(
                f"request needs {r.host_blocks} host KV blocks but host_kv_bytes holds "
                f"{self.kv.host.num_blocks}"
            )

    def add(self, req: Request) -> None:
        self.check_fits(req)
        if self.tokenizer is not None:
            req.text_stream = self.tokenizer.decode_stream(req.params.skip_special_tokens)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            r = self.reservation(req)
            limit = self.kv.device.num_blocks - self.scratch_blocks
            if (self._reserved_device + r.device_total > limit
                    or self._reserved_host + r.host_blocks > self.kv.host.num_blocks):
                break
            if not self.kv.policy.offload and self.kv.device.num_free < r.device_blocks - 1:
                break  # cached blocks a prefix hit of this step copies from: next step
            self.waiting.popleft()
            if not self.kv.policy.offload:
                # resident: hold the whole reservation now, as one run of consecutive blocks
                self.kv.allocate(req.request_id, (r.device_blocks - 1) * self.config.block_size)
            # prefix-cache hit: copies, not prefill (not with prompt_logprobs, which need the
            # logits of every prompt position, as vLLM)
            if not req.num_computed_tokens and req.params.prompt_logprobs is None:
                hit, copies = self.kv.adopt_prefix(req.request_id, req.prompt_token_ids)
                req.num_computed_tokens = req.num_cached_tokens = hit
                self._cache_copies += copies
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.perf_counter()
            self._reserved[req.request_id] = r
            self._reserved_device += r.device_total
            self._reserved_host += r.host_blocks
            req.status = Status.RUNNING
            self.running.append(req)
        self.max_concurrency = max(self.max_concurrency, len(self.running))

    def note_step(self, link_bps: float, prefill_compute_s: float | None) -> None:
        """The link's measured rate, and the compute time of the step just run if it carried
        a prefill chunk."""
        self._link_bps = link_bps
        if prefill_compute_s is not None:
            self._chunk_s = (prefill_compute_s if not self._chunk_s
                             else 0.7 * self._chunk_s + 0.3 * prefill_compute_s)

    def _split_host(self, seqs: list[SeqWork]) -> list[SeqWork]:
        """Each request's cold blocks: the oldest ``_host_counts`` of them attended on the host
        (``host_blocks``), the rest over the link (``restore_chunks``, re-cut into chunks)."""
        cold = [[b for c in s.restore_chunks for b in c] for s in seqs]
        total = sum(map(len, cold))
        if not (total and self.config.host_attends):
            return seqs
        counts = self._host_counts(seqs, [len(c) for c in cold])
        self.host_share = sum(counts) / total
        per = max(1, self.config.chunk_tokens // self.config.block_size)
        layers = self.layers
        out = []
        for s, blocks, x in zip(seqs, cold, counts, strict=True):
            # whole blocks by layer (a fractional share alternates between two counts)
            n_by_layer = by_layer(x, layers)
            n = max(n_by_layer)
            if n:
                s = replace(s, host_blocks=tuple(blocks[:n]),
                            host_layers=n_by_layer if min(n_by_layer) < n else (),
                            restore_chunks=tuple(tuple(blocks[i : i + per])
                                                 for i in range(n, len(blocks), per)))
            out.append(s)
        return out

    def _host_counts(self, seqs: list[SeqWork], blocks: list[int]) -> list[float]:
        """How many cold blocks of each request the host attends (fractions of a block: the
        layers take turns): the fixed host_attention_fraction of each; under "auto", where
        the last decode round was link-bound, the split that lets the link and the host
        finish together from their measured rates (a quarter of each until both are
        measured), else none."""
        fraction = self.config.host_attention_fraction
        if fraction is not None:
            return [fraction * n for n in blocks]
        if not self.host_pays:  # compute-bound: moving history off the link buys nothing
            return [0.0] * len(blocks)
        cost = [self.host_cost(len(s.token_ids)) if self.host_cost else 0.0 for s in seqs]
        if not (self._link_bps and all(cost) and self.history_token_bytes):
            return [UNMEASURED_HOST_SHARE * n for n in blocks]
        return split_for_host(blocks, cost, self.history_token_bytes * self.config.block_size,
                              self._link_bps, self.host_serial_s)

    def _chunk_hides_history(self) -> bool:
        """Whether a prefill chunk's compute hides streaming every decoding request's history
        (then a two-group step that carries one verifies them all; else the groups alternate
        as in any other step: with the link dominating, verifying everyone would put all
        their history on the link behind every chunk). True until both are measured."""
        if not (self._link_bps and self._chunk_s and self.history_token_bytes):
            return True
        tokens = sum(self.kv.host_tokens(r.request_id) for r in self.running
                     if not r.in_prefill and r.request_id in self.kv.seqs)
        return tokens * self.history_token_bytes / self._link_bps <= self._chunk_s

    @property
    def draft_shape(self) -> Shape:
        """The shape this step's drafts were asked for (the policy's last choice)."""
        return self._shape

    # ---- residency (`fill`) ---------------------------------------------------------------
    def _rebalance(self) -> None:
        """Share the device blocks among the running requests: each keeps at least its
        resident tail (and its blocks without a host copy); the rest of the pool, less this
        step's working room (prefill scratch, the new tokens' blocks, restore-mode room for
        the history that still streams), goes to equal shares.

        Hysteresis: a request over its share keeps its blocks until the step needs the room
        (then those furthest over drop their oldest, which have host copies); one under its
        share gets streamed blocks promoted once the step's allocations are made
        (``_promote``). A share that moves by a block for a step, or a request that comes and
        goes, moves no more blocks than the room it needs."""
        kv, bs = self.kv, self.config.block_size
        if not kv.policy.fill:
            return
        reqs = [r for r in self.running if r.request_id in kv.seqs]
        tail = -(-kv.policy.resident_tail_tokens // bs) + 1
        floors, caps, growth = [], [], 0
        for r in reqs:
            seq = kv.seqs[r.request_id]
            blocks = seq.first + len(seq.device_blocks)
            if r.in_prefill:  # room for the whole prompt: its chunks land in the share
                blocks = max(blocks, -(-len(r.prompt_token_ids) // bs))
            else:
                growth += kv.device_blocks_needed(r.request_id, self.config.verify_tokens)
            pinned = len(seq.device_blocks) - seq.droppable
            floors.append(min(blocks, max(tail, pinned)))
            caps.append(blocks)
        prefill = bool(self.waiting) or any(r.in_prefill for r in self.running)
        scratch = self.scratch_blocks if prefill else 0
        pool = kv.device.num_blocks - growth - scratch
        layers = self.restore_layers

        def room(targets: list[int]) -> int:  # lent blocks for the history that streams
            streamed = sum(c - t for c, t in zip(caps, targets))
            return -(-2 * streamed // layers) if layers else 0

        targets = residency_targets(floors, caps, pool, room if layers else None)
        self._step_room = room(targets) + growth
        for r, t in zip(reqs, targets):
            kv.set_target(r.request_id, t)
        # the step's working room must be free: those furthest over their share make it
        self._free_up(scratch + self._step_room)

    def _promote(self, seqs: list[SeqWork]) -> list[SeqWork]:
        """Give requests of the step under their share device blocks for the newest of their
        streamed blocks (the step copies them there as they pass: no link bytes)."""
        kv = self.kv
        if not kv.policy.fill:
            return seqs
        out = []
        planned = {s.request_id for s in seqs}  # their windows are fixed for this step
        for s in seqs:
            seq = kv.seqs[s.request_id]
            short = (seq.target or 0) - len(seq.device_blocks)
            # only blocks that cross the link can be promoted on the way (not host-attended)
            short = min(short, sum(len(c) for c in s.restore_chunks))
            if s.restore_chunks and short > 0:
                self._free_up(short, keep=planned)
                s = replace(s, promote=tuple(kv.plan_promotion(s.request_id, short)))
            out.append(s)
        return out

    def _free_up(self, blocks: int, keep: Collection[str] = ()) -> None:
        """Make ``blocks`` device blocks free, as far as requests over their share can (those
        furthest over drop their oldest first; none of ``keep``)."""
        kv = self.kv
        short = blocks - kv.device.num_free
        for rid in sorted((r.request_id for r in self.running
                           if r.request_id in kv.seqs and r.request_id not in keep),
                          key=kv.excess, reverse=True):
            if short <= 0:
                break
            short -= kv.drop(rid, min(short, kv.excess(rid)))

    # ---- one step -----------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def assign_group(self, req: Request) -> None:
        """Put a request that starts decoding into the smaller of the two groups."""
        sizes = [0, 0]
        for r in self.running:
            if r.group >= 0:
                sizes[r.group] += 1
        req.group = 0 if sizes[0] <= sizes[1] else 1

    def _verify_group(self) -> int | None:
        """The group verified this step (two-group modes), falling back to the other group."""
        if not self.two_groups:
            return None
        ready = {r.group for r in self.running if not r.in_prefill and not r.needs_draft}
        group = self._parity if self._parity in ready or not ready else 1 - self._parity
        self._parity = 1 - group
        return group

    def schedule(self) -> StepPlan:
        self._admit()
        self._rebalance()
        if self.shaper is not None:  # requests verified per round: a group, or all of them
            decoding = sum(not r.in_prefill for r in self.running)
            self._shape = self.shaper.shape(-(-decoding // (2 if self.two_groups else 1)),
                                            catch_up=self._draft_catch_up())
            for req in self.running:  # waiting for drafts the new shape does not make
                if req.needs_draft and self._draft(req, after_verify=False).count(0) == 0:
                    req.needs_draft = False  # verifies without drafts instead of stalling
        prefilling = (self.two_groups and any(r.in_prefill for r in self.running)
                      and self._chunk_hides_history())
        group = None if prefilling else self._verify_group()
        seqs: list[SeqWork] = []
        prefill_budget = self.config.max_prefill_tokens
        n = len(self.running)
        order = [self.running[(self._rr + i) % n] for i in range(n)] if n else []
        self._rr += 1
        # The rotation shares a step between requests fairly; the prefill slots in it go to the
        # oldest prompts first (FCFS, as vLLM), so the first request finishes its prefill and
        # starts decoding while the later ones still prefill, instead of all prompts advancing
        # a chunk at a time and every request decoding only after the last prompt is done.
        fcfs = iter([r for r in self.running if r.in_prefill])
        order = [next(fcfs) if r.in_prefill else r for r in order]
        for req in order:
            rid = req.request_id
            if not req.in_prefill and (
                req.needs_draft or (group is not None and req.group != group)
            ):
                continue  # its drafts are being made, or the other group verifies now
            if req.in_prefill:
                todo = req.num_tokens - 1 - req.num_computed_tokens
                take = min(todo + 1, prefill_budget, self._prefill_room(req))
                if take <= 0:
                    continue
                prefill_budget -= take
                tokens = req.all_token_ids[req.num_computed_tokens : req.num_computed_tokens + take]
                drafts: list[int] = []
                parents: tuple[int, ...] = ()
                sample = req.num_computed_tokens + take == req.num_tokens
            else:
                tokens = [req.all_token_ids[-1]]
                drafts = list(req.draft_token_ids)
                parents = tuple(req.draft_parents or ())
                sample = True
            inputs = tuple(tokens) + tuple(drafts)
            self.kv.allocate(rid, len(inputs))
            seq = self.kv.seqs[rid]
            seqs.append(SeqWork(
                **self._sampling_inputs(req, len(tokens), sample),
                request_id=rid,
                token_ids=inputs,
                start_pos=req.num_computed_tokens,
                num_drafts=len(drafts),
                prefill=req.in_prefill,
                sample=sample,
                host_tokens=seq.first * self.config.block_size,
                device_blocks=tuple(seq.device_blocks),
                restore_chunks=tuple(c.host_blocks for c in self.kv.restore_chunks(rid)),
                params=req.params,
                parents=parents,
            ))
        seqs = self._split_host(seqs)
        finished, self._finished = tuple(self._finished), []
        # `restore` modes: pool blocks for two layers of the step's history, lent for the step
        # (the admitted requests' reservations keep them free)
        history = sum(s.max_link_blocks for s in seqs)
        lent = tuple(self.kv.device.allocate(self._restore_blocks(history))) if history else ()
        seqs = self._promote(seqs)
        moving = tuple((rid, tuple(seq.moving)) for rid, seq in self.kv.seqs.items()
                       if seq.moving)
        copies, self._cache_copies = tuple(self._cache_copies), []
        return StepPlan(tuple(seqs), self._draft_work(seqs, prefilling), finished, lent, moving,
                        cache_copies=copies)

    @staticmethod
    def _sampling_inputs(req: Request, num_inputs: int, sample: bool) -> dict[str, Any]:
        """What the worker needs besides the tokens for the request's logits: the tokens
        generated so far (min_tokens, penalties; the history only with a penalty) and the prompt
        tokens a prefill chunk's inputs predict (prompt_logprobs)."""
        p, start, out = req.params, req.num_computed_tokens, len(req.output_token_ids)
        fields: dict[str, Any] = {"output_len": out}
        if sample and p.penalized:
            fields["history"] = tuple(req.all_token_ids)
        if p.prompt_logprobs is not None and req.in_prefill:
            prompt = req.prompt_token_ids
            fields["prompt_targets"] = tuple(prompt[start + 1 : start + num_inputs + 1])
        return fields

    def _draft_work(self, seqs: list[SeqWork], prefilling: bool) -> tuple[DraftWork, ...]:
        """Who drafts in this step. Requests not verified in it and still without drafts
        draft while it runs (the other group, in the two-group modes); in the one-group modes,
        and in a two-group step that carries a prefill chunk, the requests it verifies draft
        right after, from the tokens their verification emits (the chunk's compute hides the
        link anyway, so alternating groups would only halve the decode rounds riding along)."""
        if not self.config.speculative:
            return ()
        verified = {s.request_id for s in seqs}
        work = []
        for req in self.running:
            rid = req.request_id
            if rid in verified:
                sampled = any(s.request_id == rid and s.sample for s in seqs)
                after = sampled and (prefilling or not self.two_groups)
                if after:
                    work.append(self._draft(req, after_verify=True))
            elif req.needs_draft and not req.in_prefill:
                work.append(self._draft(req, after_verify=False))
        work = [w for w in work if w.count(0) > 0]
        shaped = [w for w in work if self._shaped(self.requests[w.request_id])]
        if self.shaper is not None and self.shaper.probing and shaped:
            # a probe drafts for one request, the one the draft has seen most of (the others'
            # first drafts would make the draft prefill their windows before the policy knows
            # whether drafting pays), and an exploration not at all where that costs too much
            shaped.sort(key=lambda w: w.unseen)
            keep = 1 if self.shaper.worth_exploring(shaped[0].unseen, len(shaped)) else 0
            dropped = {w.request_id for w in shaped[keep:]}
            for rid in dropped:
                self.requests[rid].needs_draft = False
            work = [w for w in work if w.request_id not in dropped]
        return tuple(work)

    def _draft_catch_up(self) -> float:
        """What a draft model must feed before drafting for the requests of a round, each
        request's divided by the tokens it may still generate (RoundShaper.shape)."""
        share = sum(self._unseen(r) / max(1, self._room(r))
                    for r in self.running if not r.in_prefill)
        return share / (2 if self.two_groups else 1)

    def _draft_window(self) -> int:
        """The most tokens a draft model catches up on at once (its sinks and window)."""
        cfg = self.config
        return (cfg.draft_sink_tokens + cfg.draft_window_tokens
                if cfg.draft_cache == "window" else 1 << 62)

    def _shaped(self, req: Request) -> bool:
        """Whether the round-shape policy shapes the request's drafts. Not a seeded sampled
        request's: which tokens it draws depends on how many drafts each round verifies, and
        the policy's choices depend on measured times, while a seed must give the same
        output every time; it drafts its chain of the configured depth."""
        return self.shaper is not None and (req.params.greedy or req.params.seed is None)

    def _draft(self, req: Request, after_verify: bool) -> DraftWork:
        cfg, q = self.config, req.params.num_speculative_tokens
        depth = cfg.q if q is None else q
        topk, nodes = cfg.speculative_topk, cfg.num_draft_tokens
        if self._shaped(req):  # the policy's shape, within the request's own depth
            shape = self._shape
            depth, topk, nodes = min(depth, shape.depth), shape.topk, shape.num_nodes
            if not req.params.greedy:  # a sampled request verifies a tree's children as
                topk = 1  # point masses, which accept far less than a sampled chain
        elif self.shaper is not None:  # seeded sampling: its chain, whatever was measured
            topk = 1
        tree = topk > 1
        return DraftWork(
            request_id=req.request_id, token_ids=tuple(req.all_token_ids),
            num_tokens=depth, room=self._room(req), params=req.params,
            after_verify=after_verify, topk=topk,
            # a request's own depth may exceed the engine's node budget: a chain that deep
            max_nodes=max(nodes, depth) if tree else None, unseen=self._unseen(req))

    def _unseen(self, req: Request) -> int:
        """Tokens a draft model would feed before drafting for ``req``: what it has not seen
        (a request that never drafted: its sinks and window at most)."""
        if self.config.proposer != "draft":
            return 0
        return min(req.num_tokens - req.draft_seen if req.draft_seen else req.num_tokens,
                   self._draft_window())

    def _room(self, req: Request) -> int:
        """Tokens the request may still generate (its max_tokens and the model's context)."""
        return min(req.params.max_tokens - len(req.output_token_ids),
                   self.max_model_len - req.num_tokens)

    # ---- results ------------------------------------------------------------------------
    def update(self, plan: StepPlan, output: StepOutput) -> StepUpdate:
        """Fold a step's output into its requests: tokens and stop checks, KV commits (rejected
        drafts roll back), write-back plans, drafts for the next round, errors. A sampling
        request with neither tokens nor an error in the output did not run: it stays as it was
        and is scheduled again."""
        result = StepUpdate()
        self.kv.release_pins()  # the step made its prefix-cache copies
        self.kv.device.free(list(plan.restore_blocks))
        for work in plan.seqs:  # promoted blocks the step's stream filled join the window
            if work.promote and work.request_id in self.kv.seqs:
                self.kv.complete_promotion(work.request_id, work.request_id not in output.errors)
        for rid, _ in plan.writebacks:  # copied during the step: the blocks join the host tier
            req = self.requests.get(rid)
            if req is None or req.finished:
                continue
            if rid in output.errors:
                self.finish(req, "error", output.errors[rid])
            else:
                self.kv.complete_writeback(rid)
        drafted_after = {d.request_id for d in plan.drafts if d.after_verify}
        for work in plan.seqs:
            req = self.requests.get(work.request_id)
            if req is None or req.finished:
                continue
            result.touched.append(req)
            if work.request_id in output.errors:
                self.finish(req, "error", output.errors[work.request_id])
                continue
            new = output.new_tokens.get(work.request_id)
            if work.sample and new is None:
                continue
            new = new or []
            if req.prompt_logprobs is not None:
                req.prompt_logprobs += output.prompt_logprobs.get(work.request_id, [])
            if work.sample:
                self._count_round(req, work, len(new))
            self._commit(work, req, len(new))
            result.num_appended += self._append(req, new, output.logprobs.get(work.request_id))
            pairs = [] if req.finished else self.kv.plan_writeback(req.request_id)
            if pairs and work.prefill:
                result.writebacks[req.request_id] = pairs
            if work.sample and not req.finished and self.config.speculative:
                if req.group < 0 and self.two_groups:
                    self.assign_group(req)
                # drafts follow: made in this step (after verification; the loop below takes
                # them) or, in the two-group modes, while the other group verifies
                req.needs_draft = (work.request_id in drafted_after or self.two_groups) and (
                    self._draft(req, after_verify=False).count(0) > 0)
                req.draft_token_ids, req.draft_parents = [], None
        for d in plan.drafts:
            req = self.requests.get(d.request_id)
            if req is None or req.finished:
                continue
            if req not in result.touched:
                result.touched.append(req)
            if d.request_id in output.errors:
                self.finish(req, "error", output.errors[d.request_id])
            elif d.request_id in output.drafts:
                req.draft_token_ids = list(output.drafts[d.request_id])
                req.draft_parents = output.draft_parents.get(d.request_id)
                req.needs_draft = False
                req.draft_seen = req.num_tokens
        return result

    def complete_writebacks(self, writebacks: Writebacks, errors: dict[str, str]) -> None:
        """The worker copied ``writebacks``: free their device blocks; fail requests whose copy
        failed."""
        for rid in writebacks:
            req = self.requests.get(rid)
            if req is None or req.finished:
                continue
            if rid in errors:
                self.finish(req, "error", errors[rid])
            else:
                self.kv.complete_writeback(rid)

    def _commit(self, work: SeqWork, req: Request, num_new_tokens: int) -> None:
        """Record a step's KV for one request (drafts past the accepted ones roll back)."""
        if work.sample:
            # the inputs up to the accepted drafts now have KV; the newest token does not (a
            # tree's accepted path: the worker moved its KV to the slots right after the root)
            kept = work.start_pos + len(work.token_ids) - work.num_drafts + num_new_tokens - 1
        else:
            kept = work.start_pos + len(work.token_ids)
        req.num_computed_tokens = kept
        self.kv.commit(req.request_id, kept)

    def _count_round(self, req: Request, work: SeqWork, num_new: int) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
            return  # the prefill's first token is not a verification round
        req.num_rounds += 1
        req.num_proposed += work.num_drafts
        req.num_accepted += num_new - 1

    def _append(self, req: Request, new: list[int],
                logprobs: list[TokenLogprobs] | None = None) -> int:
        """Append emitted tokens (and their log-probabilities) up to the first that ends the
        request; returns how many."""
        if new:
            req.last_token_time = time.perf_counter()
        for i, tok in enumerate(new, 1):
            reason = req.append(tok, self.eos_token_ids, logprobs[i - 1] if logprobs else None)
            if reason is not None:
                self.finish(req, reason)
                return i
        return len(new)

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End a request (stop, length, abort, error): free its KV and its reservation. The
        text is final: cut at a stop string, else the whole output decoded once (what the
        incremental decoder holds back of an unfinished character included)."""
        if self.tokenizer is not None and reason != "error" and not isinstance(
                req.stop_reason, str):
            ids = req.output_token_ids
            if reason == "stop" and not req.params.include_stop_str_in_output and ids and (
                    ids[-1] in req.params.stop_token_ids or ids[-1] in self.eos_token_ids):
                ids = ids[:-1]  # eos or a stop token ended it: its text is left out
            req.output_text = self.tokenizer.decode(
                ids, skip_special_tokens=req.params.skip_special_tokens)
        req.finish_time = time.perf_counter()
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error
        rid = req.request_id
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        # the prefix cache keeps its full blocks (not a failed request's: its KV may be bad)
        self.kv.free(rid, req.all_token_ids if reason != "error" else None)
        self._finished.append(rid)
        r = self._reserved.pop(rid, None)
        if r is not None:
            self._reserved_device -= r.device_total
            self._reserved_host -= r.host_blocks
