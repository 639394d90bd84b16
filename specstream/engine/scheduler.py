"""Continuous batching: admission against the KV budgets, chunked prefill, decode rounds.

The scheduler owns the requests and the pure-Python KV manager. Each step it hands the executor
one :class:`StepPlan` (the only thing the executor sees) and afterwards folds the executor's
:class:`StepResult` back into the requests (accepted tokens, KV commits, write-back plans).

Admission reserves, per request, the device blocks its resident tail can ever need and the host
blocks its history can ever need (prompt + max_tokens), so an admitted request never runs out of
memory mid-way: when memory runs short new requests wait; nothing admitted is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from specstream.config import EngineConfig
from specstream.engine.request import Request, Status
from specstream.kvcache.manager import KVManager
from specstream.sampling_params import SamplingParams
from specstream.spec.proposer import Proposal


@dataclass(frozen=True)
class SeqWork:
    """One request's share of a step."""

    request_id: str
    # Input tokens: a prefill chunk, or the last sampled token followed by the drafts.
    token_ids: tuple[int, ...]
    # Absolute position of token_ids[0] (= tokens already in the cache).
    start_pos: int
    # Trailing draft tokens among token_ids (verified this step).
    num_drafts: int
    # Whether the step ends at the newest known token, so logits are sampled.
    sample: bool
    # KV placement: host history tokens, and the device blocks of the tail.
    host_tokens: int
    device_blocks: tuple[int, ...]
    # Host history as restore chunks of (host block ids).
    restore_chunks: tuple[tuple[int, ...], ...]
    # Processed draft distribution [num_drafts, V], None for point-mass drafts.
    draft_probs: torch.Tensor | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class StepPlan:
    seqs: tuple[SeqWork, ...]
    # Two-group modes, in a step that carries a prefill chunk: every request with drafts ready
    # is verified (not one group), and the verified requests get their next drafts right after
    # the step. The chunk's compute hides the link anyway, so alternating groups would only
    # halve the decode rounds that ride along with it.
    draft_after: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class StepResult:
    # request id -> tokens appended this step (accepted drafts + recovered/bonus token).
    new_tokens: dict[str, list[int]] = field(default_factory=dict)
    # request id -> error message, for requests whose step failed (e.g. a transfer).
    errors: dict[str, str] = field(default_factory=dict)
    # Drafts made during the step for requests that were not verified in it.
    proposals: list[Proposal] | None = None
    # Timings (perf_counter seconds): step start, wall time, time waiting on the link, drafting.
    start: float = 0.0
    wall_s: float = 0.0
    wait_s: float = 0.0
    draft_s: float = 0.0


@dataclass
class _Reservation:
    device_blocks: int
    host_blocks: int


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVManager,
        restore_token_cap: int | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        # In `restore` modes a step can only restore this many history tokens (two layers of
        # them must fit in the device budget's restore share).
        self.restore_token_cap = restore_token_cap
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._reserved: dict[str, _Reservation] = {}
        self._reserved_device = 0
        self._reserved_host = 0
        self.max_concurrency = 0
        self._rr = 0  # round-robin start when a step cannot take every running request
        # Overlapped modes verify one group per step while the other group drafts.
        spec = config.mode_spec
        self.two_groups = config.speculative and spec.drafting in ("gaps", "parallel")
        self._parity = 0

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
        step = self.config.q + 1
        if p.offload:
            tail = max(min(total, p.offload_after_tokens), p.resident_tail_tokens + bs) + step
            tail = min(tail, total + step)
        else:
            tail = total + step
        return _Reservation(-(-tail // bs) + 1, self.kv.host_blocks_needed(total))

    def _outstanding(self) -> int:
        """Blocks that admitted requests may still claim from the free pool."""
        held = {rid: len(s.device_blocks) for rid, s in self.kv.seqs.items()}
        return sum(max(0, r.device_blocks - held.get(rid, 0)) for rid, r in self._reserved.items())

    def _prefill_room(self, req: Request) -> int:
        """Tokens a prefill chunk of ``req`` may write now without touching others' reserve."""
        rid, bs = req.request_id, self.config.block_size
        seq = self.kv.seqs.get(rid)
        held = len(seq.device_blocks) if seq else 0
        own = max(0, self._reserved[rid].device_blocks - held)
        blocks = own + max(0, self.kv.device.num_free - self._outstanding())
        tail = req.num_computed_tokens - (len(seq.host_blocks) * bs if seq else 0)
        return blocks * bs + (held * bs - tail)

    def check_fits(self, req: Request) -> None:
        """Raise if the request could never be admitted, even on an idle engine."""
        r = self.reservation(req)
        if r.device_blocks + self.scratch_blocks > self.kv.device.num_blocks:
            p = self.kv.policy
            remedy = (f"or lower offload_after_tokens (now {p.offload_after_tokens}: the "
                      "device keeps a request's KV until it passes that many tokens)"
                      if p.offload else "or use an offloading mode")
            raise ValueError(
                f"request needs {r.device_blocks + self.scratch_blocks} device KV blocks but the "
                f"device budget holds {self.kv.device.num_blocks}; raise device_kv_bytes "
                + remedy)
        if r.host_blocks > self.kv.host.num_blocks:
            raise ValueError(
                f"request needs {r.host_blocks} host KV blocks but host_kv_bytes holds "
                f"{self.kv.host.num_blocks}"
            )
        if self.restore_token_cap is not None:
            hist = r.host_blocks * self.config.block_size
            if hist > self.restore_token_cap:
                raise ValueError(
                    f"mode {self.config.mode!r} restores whole layers of history: {hist} "
                    f"tokens exceed the device budget's restore share of "
                    f"{self.restore_token_cap} tokens; raise device_kv_bytes"
                )

    def add(self, req: Request) -> None:
        self.check_fits(req)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            r = self.reservation(req)
            limit = self.kv.device.num_blocks - self.scratch_blocks
            if (self._reserved_device + r.device_blocks > limit
                    or self._reserved_host + r.host_blocks > self.kv.host.num_blocks):
                return
            self.waiting.popleft()
            if not self.kv.policy.offload:
                # resident: hold the whole reservation now, as one run of consecutive blocks
                self.kv.allocate(req.request_id, (r.device_blocks - 1) * self.config.block_size)
            self._reserved[req.request_id] = r
            self._reserved_device += r.device_blocks
            self._reserved_host += r.host_blocks
            req.status = Status.RUNNING
            self.running.append(req)
        self.max_concurrency = max(self.max_concurrency, len(self.running))

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
        prefilling = self.two_groups and any(r.in_prefill for r in self.running)
        group = None if prefilling else self._verify_group()
        seqs: list[SeqWork] = []
        prefill_budget = self.config.max_prefill_tokens
        history_budget = self.restore_token_cap
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
            host_tokens = self.kv.host_tokens(rid) if rid in self.kv.seqs else 0
            if history_budget is not None and host_tokens > history_budget:
                continue  # waits for a step with room to restore its history
            if req.in_prefill:
                todo = req.num_tokens - 1 - req.num_computed_tokens
                take = min(todo + 1, prefill_budget, self._prefill_room(req))
                if take <= 0:
                    continue
                prefill_budget -= take
                tokens = req.all_token_ids[req.num_computed_tokens : req.num_computed_tokens + take]
                drafts: list[int] = []
                sample = req.num_computed_tokens + take == req.num_tokens
            else:
                tokens = [req.all_token_ids[-1]]
                drafts = list(req.draft_token_ids)
                sample = True
            if history_budget is not None:
                history_budget -= host_tokens
            inputs = tuple(tokens) + tuple(drafts)
            self.kv.allocate(rid, len(inputs))
            seq = self.kv.seqs[rid]
            seqs.append(SeqWork(
                request_id=rid,
                token_ids=inputs,
                start_pos=req.num_computed_tokens,
                num_drafts=len(drafts),
                sample=sample,
                host_tokens=len(seq.host_blocks) * self.config.block_size,
                device_blocks=tuple(seq.device_blocks),
                restore_chunks=tuple(c.host_blocks for c in self.kv.restore_chunks(rid)),
                draft_probs=req.draft_probs if drafts else None,
                params=req.params,
                generator=req.generator,
            ))
        return StepPlan(tuple(seqs), draft_after=prefilling)

    def commit(self, work: SeqWork, req: Request, num_new_tokens: int) -> list[tuple[int, int]]:
        """Record a step's KV for one request (drafts past the accepted ones roll back).

        Returns the (device block, host block) write-backs its tail now needs; the caller
        copies them and then calls ``kv.complete_writeback``.
        """
        if work.sample:
            # the inputs up to the accepted drafts now have KV; the newest token does not
            kept = work.start_pos + len(work.token_ids) - work.num_drafts + num_new_tokens - 1
        else:
            kept = work.start_pos + len(work.token_ids)
        req.num_computed_tokens = kept
        self.kv.commit(req.request_id, kept)
        return self.kv.plan_writeback(req.request_id)

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error
        rid = req.request_id
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(rid)
        r = self._reserved.pop(rid, None)
        if r is not None:
            self._reserved_device -= r.device_blocks
            self._reserved_host -= r.host_blocks
