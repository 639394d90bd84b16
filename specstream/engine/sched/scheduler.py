"""Continuous batching: admission against the KV budgets, chunked prefill, decode rounds.

The scheduler owns the requests and the pure-Python KV manager. Each step it hands the worker
one :class:`StepPlan` (the only thing the worker sees), built from the ``Estimates`` it is
handed (``policy/feedback.py``: nothing else it reads was measured); afterwards ``update``
folds the worker's :class:`StepOutput` back into the requests. Its parts, in the order a step
uses them: ``admission`` (who may start), ``residency`` (`fill`: who keeps what on the
device), ``groups`` (the overlapped modes' two groups), the batch itself (below), ``host_split``
(which cold blocks the host attends), ``drafts`` (who drafts, how many), ``update``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

from specstream.config import EngineConfig
from specstream.engine.contract import SeqWork, StepOutput, StepPlan
from specstream.engine.layout import RuntimeLayout
from specstream.engine.policy.feedback import Estimates
from specstream.engine.policy.shaping import RoundShaper
from specstream.engine.request import Request, TextCodec
from specstream.engine.sched.admission import Admission
from specstream.engine.sched.drafts import DraftPlanner
from specstream.engine.sched.groups import Groups
from specstream.engine.sched.host_split import HostSplitter, MeasuredSplit, split_steps
from specstream.engine.sched.residency import Residency
from specstream.engine.sched.restore_room import RestoreRoom
from specstream.engine.sched.update import StepUpdate, Update
from specstream.kvcache.manager import BlockCopy, KVManager
from specstream.kvcache.residency import OffloadPolicy
from specstream.options import Drafting, History


class Scheduler:
    def __init__(
        self, config: EngineConfig, kv: KVManager, max_model_len: int = 1 << 62,
        eos_token_ids: Collection[int] = (),
        tokenizer: TextCodec | None = None, history_token_bytes: int = 0, num_layers: int = 1,
        shaper: RoundShaper | None = None, host_split: HostSplitter | None = None,
        restore_room_blocks: int = 1,
    ) -> None:
        """``num_layers``: the target's layers (the `restore` modes hold two of them of a
        step's history in lent pool blocks, or pieces of a layer in ``restore_room_blocks``,
        the room the budget guarantees); ``shaper``: the round-shape policy
        (default: the config's, None unless speculative_policy is auto); ``host_split``: how
        the host's share of cold history is chosen (default: ``MeasuredSplit``)."""
        self.config, self.kv = config, kv
        self.num_layers = num_layers  # host attention splits cold blocks by layer
        self.tokenizer = tokenizer
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.max_concurrency = 0
        self.host_share = 0.0  # the host's share of the last step with cold history
        self._finished: list[str] = []  # since the last plan: the worker drops their state
        self._rr = 0  # round-robin start when a step cannot take every running request
        self._copies: list[BlockCopy] = []  # prefix-cache hits of the requests just admitted
        self.shaper = shaper if shaper is not None else RoundShaper.for_config(config)
        # `restore` modes: a step holds two of the layers of its history in lent pool blocks
        room = (RestoreRoom(num_layers, restore_room_blocks,
                            config.host_attention_fraction or 0.0)
                if config.mode_spec.history is History.RESTORE else None)
        self.admission = Admission(config, kv, room)
        self.residency = Residency(config, kv, room)
        self.groups = Groups(config.speculative and config.mode_spec.two_groups,
                             history_token_bytes,
                             merges=(config.merge_groups
                                     and config.mode_spec.drafting is Drafting.GAPS))
        self.drafts = DraftPlanner(config, self.shaper, max_model_len)
        self.host_split = host_split or MeasuredSplit(config,
                                                      history_token_bytes * config.block_size)
        self.updates = Update(kv, frozenset(eos_token_ids), tokenizer, self._release)

    @classmethod
    def for_layout(cls, config: EngineConfig, layout: RuntimeLayout,
                   tokenizer: TextCodec | None = None, shaper: RoundShaper | None = None,
                   host_split: HostSplitter | None = None) -> Scheduler:
        """The scheduler and its KV manager as the engine runs them on ``layout`` (the
        simulator's replay builds them the same way, without a model)."""
        policy = OffloadPolicy(offload=config.mode_spec.offload,
                               resident_tail_tokens=config.resident_tail_tokens,
                               offload_after_tokens=layout.offload_after_tokens,
                               chunk_tokens=layout.chunk_tokens, residency=config.residency)
        kv = KVManager(config.block_size, layout.num_device_blocks, layout.num_host_blocks,
                       policy, prefix_caching=config.enable_prefix_caching,
                       prefix_sharing=config.prefix_sharing)
        return cls(config, kv, max_model_len=layout.max_model_len,
                   eos_token_ids=layout.eos_token_ids, tokenizer=tokenizer,
                   history_token_bytes=layout.block_bytes // layout.block_size,
                   num_layers=layout.num_layers, shaper=shaper, host_split=host_split,
                   restore_room_blocks=layout.restore_room_blocks)

    # ---- requests -----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.admission.check_fits(req)
        if self.tokenizer is not None:
            req.text_stream = self.tokenizer.decode_stream(req.params.skip_special_tokens)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End a request (stop, length, abort, error): free its KV and its reservation."""
        self.updates.finish(req, reason, error)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._finished.append(req.request_id)
        self.admission.release(req.request_id)

    # ---- one step -----------------------------------------------------------------------
    def schedule(self, est: Estimates | None = None) -> StepPlan:
        """The next step's plan, from what is known of the machine (``est``; nothing
        measured when None)."""
        est = est or Estimates()
        self._copies += self.admission.admit(self.waiting, self.running)
        self.max_concurrency = max(self.max_concurrency, len(self.running))
        draft_s = None  # what drafting after a merged round would take, where sharing asks
        if self.shaper is not None and self.kv.duplicate_blocks():
            decoding = sum(not r.in_prefill for r in self.running)
            draft_s = self.shaper.draft_s(self.drafts.shape, decoding)
        two = self.groups.split(est, self.running, self.kv, draft_s)
        self.drafts.choose_shape(self.running, two)
        verify_all = not two or self.groups.prefill_verifies_all(self.running, self.kv, est)
        group = None if verify_all else self.groups.to_verify(self.running)
        # prefill scratch only for a prompt admitted and prefilling: one still waiting cannot
        # use it (admission just said so), and the shares make room the step it is admitted;
        # new blocks only for the requests this step verifies (a split round: one group)
        self._copies += self.residency.rebalance(
            self.running, self._prefill_scratch(),
            {r.request_id for r in self.running if self._verifies(r, group)})
        seqs = self._batch(group)
        if self.config.host_attends:
            per = max(1, self.kv.policy.chunk_tokens // self.config.block_size)
            seqs, share = split_steps(seqs, self.host_split, est, self.num_layers, per)
            self.host_share = self.host_share if share is None else share
        # `restore` modes: pool blocks for two layers of the step's history (or pieces of a
        # layer), lent for the step (the admitted requests' reservations keep them free)
        # (a block several of them restore, a shared prefix, once: exec/restore.py)
        history = sum(s.max_link_blocks for s in seqs)
        if self.kv.duplicate_blocks():
            history -= sum(map(len, (c for s in seqs for c in s.restore_chunks))) - len(
                {b for s in seqs for c in s.restore_chunks for b in c})
        lend = self.admission.lend(history, self.residency.restore_room)
        lent = tuple(self.kv.device.allocate(lend)) if lend else ()
        seqs = self.residency.promote(seqs, self.running)
        moving = tuple((rid, tuple(seq.moving)) for rid, seq in self.kv.seqs.items()
                       if seq.moving)
        drafts = self.drafts.work(self.running, self.requests, seqs, verify_all or not two)
        finished, self._finished = tuple(self._finished), []
        copies, self._copies = tuple(self._copies), []
        return StepPlan(tuple(seqs), drafts, finished, lent, moving, cache_copies=copies)

    def _prefill_scratch(self) -> int:
        """Device blocks the step's prefill chunks write beyond their requests' own (the
        chunks ``_batch`` takes, oldest prompts first), at most the admission's scratch: a
        last chunk of 56 tokens leaves no one 5 blocks short for room it does not use. No
        margin: a block kept free beyond the chunks is a block of history streamed."""
        budget, need = self.config.max_prefill_tokens, 0
        for r in self.running:
            if r.in_prefill and budget > 0:
                take = min(r.num_tokens - r.num_computed_tokens, budget)
                budget -= take
                need += self.kv.device_blocks_needed(r.request_id, take)
        return min(need, self.admission.scratch_blocks)

    def _batch(self, group: int | None) -> list[SeqWork]:
        """The step's target work: a prefill chunk or a verification per request (of
        ``group`` only, in the two-group modes, prefills aside)."""
        seqs: list[SeqWork] = []
        budget = self.config.max_prefill_tokens
        n = len(self.running)
        order = [self.running[(self._rr + i) % n] for i in range(n)] if n else []
        self._rr += 1
        # The rotation shares a step between requests fairly; the prefill slots in it go to the
        # oldest prompts first (FCFS, as vLLM), so the first request finishes its prefill and
        # starts decoding while the later ones still prefill, instead of all prompts advancing
        # a chunk at a time and every request decoding only after the last prompt is done.
        fcfs = iter([r for r in self.running if r.in_prefill])
        order = [next(fcfs) if r.in_prefill else r for r in order]
        # the verifications allocated before a prompt took their blocks of the step's working
        # room already (num_free counts them gone): the prompt leaves only the rest free
        verified = 0
        for req in order:
            if req.in_prefill:
                todo = req.num_tokens - 1 - req.num_computed_tokens
                room = max(0, self.residency.step_room - verified)
                take = min(todo + 1, budget, self.admission.prefill_room(req, room))
                if take <= 0:
                    continue
                budget -= take
                start = req.num_computed_tokens
                tokens, drafts = req.all_token_ids[start : start + take], []
                sample = start + take == req.num_tokens
            elif not self._verifies(req, group):
                continue  # its drafts are being made, or the other group verifies now
            else:
                tokens, drafts, sample = [req.all_token_ids[-1]], list(req.draft_token_ids), True
                verified += self.kv.device_blocks_needed(req.request_id, len(drafts) + 1)
            seqs.append(self._work(req, tokens, drafts, sample))
        return seqs

    @staticmethod
    def _verifies(req: Request, group: int | None) -> bool:
        """Whether a decoding request is verified in a step of ``group`` (None: every one)."""
        return not (req.in_prefill or req.needs_draft
                    or (group is not None and req.group != group))

    def _work(self, req: Request, tokens: list[int], drafts: list[int],
              sample: bool) -> SeqWork:
        """One request's share of the step, its KV slots allocated."""
        rid, p = req.request_id, req.params
        inputs = (*tokens, *drafts)
        self.kv.allocate(rid, len(inputs))
        seq, lead = self.kv.seqs[rid], self.kv.lead(rid)  # lead: shared blocks' device copies
        start = req.num_computed_tokens
        prompt = req.prompt_token_ids
        return SeqWork(
            request_id=rid, token_ids=inputs, start_pos=start, num_drafts=len(drafts),
            prefill=req.in_prefill, sample=sample,
            host_tokens=(seq.first - len(lead)) * self.config.block_size,
            device_blocks=(*lead, *seq.device_blocks),
            restore_chunks=tuple(c.host_blocks for c in self.kv.restore_chunks(rid)),
            params=p, parents=tuple(req.draft_parents or ()) if drafts else (),
            output_len=len(req.output_token_ids),
            # penalties and grammars read the history; prompt_logprobs the prompt tokens the
            # inputs predict
            history=(tuple(req.all_token_ids)
                     if sample and (p.penalized or p.structured is not None) else ()),
            prompt_targets=(tuple(prompt[start + 1 : start + len(tokens) + 1])
                            if p.prompt_logprobs is not None and req.in_prefill else ()))

    # ---- results ------------------------------------------------------------------------
    def update(self, plan: StepPlan, output: StepOutput) -> StepUpdate:
        """Fold a step's output into its requests (``sched/update.py``)."""
        after = {d.request_id for d in plan.drafts if d.after_verify}

        def next_drafts(req: Request) -> bool:
            if not self.config.speculative:
                return False
            if req.group < 0 and self.groups.enabled:
                self.groups.assign(req, self.running)
            return ((req.request_id in after or self.groups.enabled)
                    and self.drafts.wants_drafts(req))

        return self.updates.apply(plan, output, self.requests, next_drafts)

    def complete_writebacks(self, writebacks: dict[str, list[tuple[int, int]]],
                            errors: dict[str, str]) -> None:
        """The worker copied a prefill's ``writebacks`` right after its step."""
        self.updates.complete_writebacks(writebacks, errors, self.requests)
