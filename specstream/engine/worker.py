"""Runs one StepPlan on the device: the target forward, verification, drafting, write-backs.

The worker reads the plan and never touches requests; it returns a StepOutput. What has device
state lives here, keyed by request id: the proposer's draft caches, each request's generator,
the draft probabilities its pending drafts were sampled from.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from specstream.attention.waves import WaveAttention
from specstream.backends.base import (
    TransferBackend,
    TransferError,
    TransferHandle,
    sync_point,
    upload,
)
from specstream.engine.drafting import Drafting
from specstream.engine.history import HistorySource
from specstream.engine.request import RequestError
from specstream.engine.round import run_round
from specstream.engine.step import DraftWork, SeqWork, StepOutput, StepPlan
from specstream.engine.trace import Tracer
from specstream.kvcache.storage import KVStore
from specstream.models.decoder import CausalLM
from specstream.sampling import make_generator
from specstream.sampling_params import SamplingParams
from specstream.spec.acceptance import accept_drafts_on_device
from specstream.spec.proposer import ProposeJob, Proposer, ProposeRequest


@dataclass
class _Verdict:
    """A round's acceptance, still on the device."""

    seqs: list[SeqWork]  # the verified requests
    # [B * (q + 1 + 1)]: per request its accepted-draft count, then q + 1 tokens (the accepted
    # drafts and the recovered or bonus token, padded)
    packed: torch.Tensor


class Worker:
    """``drafting`` decides where the drafts of requests not verified in a step run (after
    verification, in the link's gaps, or on a second device); see ``engine/drafting.py``."""

    def __init__(
        self, model: CausalLM, store: KVStore, backend: TransferBackend, history: HistorySource,
        proposer: Proposer | None, drafting: Drafting, attention: type[WaveAttention],
        tracer: Tracer | None = None,
    ) -> None:
        self.model, self.store, self.backend, self.history = model, store, backend, history
        self.attention = attention
        self.proposer, self.drafting = proposer, drafting
        self.device = store.device.device
        self.tracer = tracer or Tracer(False)
        self.generators: dict[str, torch.Generator | None] = {}
        # [num_drafts, V] fp32 per request with pending sampled drafts (None: point masses)
        self.draft_probs: dict[str, torch.Tensor | None] = {}

    # ---- the step -----------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        """Run the plan. Drafts for requests not verified in the step run per the drafting
        strategy; drafts for requests it verifies run after their verification.

        In inference mode: no autograd bookkeeping per op (a round is thousands of small ops,
        and on a GPU each one's host cost is the round's overhead)."""
        t0 = time.perf_counter()
        out = StepOutput(start=t0)
        for rid in plan.finished:
            self.release(rid)
        # decode rounds' write-backs, at low priority: they overlap this round, which still
        # attends the blocks on the device
        writebacks = self._copy_to_host(plan.writebacks)
        wait0 = self.history.wait_s
        during = [d for d in plan.drafts if not d.after_verify]
        job = self._start(during, {}, out)
        self.drafting.begin(job)
        verdict: _Verdict | None = None
        try:
            if plan.seqs:
                with self.tracer.span("verify", "verify", tokens=plan.num_tokens):
                    verdict = self._forward_and_verify(plan, out)
        except BaseException:
            self.drafting.abort()
            for d in plan.drafts:  # their draft caches may be part-advanced: start them anew
                self.release(d.request_id)
            raise
        finally:  # no copy may still be writing when its blocks change hands
            out.errors.update(self._wait(writebacks))
        out.wait_s = self.history.wait_s - wait0
        out.draft_s = self.drafting.end()
        self._read_back(verdict, job, out)
        after = [d for d in plan.drafts if d.after_verify and d.request_id not in out.errors]
        job = self._start(after, out.new_tokens, out)
        if job is not None:
            d0 = time.perf_counter()
            self.drafting.run_now(job)
            out.draft_s += time.perf_counter() - d0
            self._take(job, out)
        out.wall_s = time.perf_counter() - t0
        return out

    def writeback(self, moves: dict[str, list[tuple[int, int]]]) -> dict[str, str]:
        """Copy tail blocks to the host tier now and wait for them; returns errors per
        request."""
        return self._wait(self._copy_to_host(moves.items()))

    def _copy_to_host(self, moves: Iterable[tuple[str, Sequence[tuple[int, int]]]]
                      ) -> list[tuple[str, list[TransferHandle]]]:
        """Issue device-to-host copies of (device block, host block) pairs, low priority."""
        return [(rid, self.store.writeback(list(pairs), rid)) for rid, pairs in moves]

    @staticmethod
    def _wait(copies: list[tuple[str, list[TransferHandle]]]) -> dict[str, str]:
        errors: dict[str, str] = {}
        for rid, handles in copies:
            for h in handles:
                try:
                    h.wait()
                except TransferError as exc:
                    errors.setdefault(rid, f"KV write-back failed: {exc}")
        return errors

    def release(self, request_id: str) -> None:
        """Drop everything held for a request (finished, or its drafting state is stale)."""
        self.generators.pop(request_id, None)
        self.draft_probs.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.free(request_id)

    # ---- drafting -----------------------------------------------------------------------
    def _start(self, work: list[DraftWork], new_tokens: dict[str, list[int]],
               out: StepOutput) -> ProposeJob | None:
        """The proposer's job for ``work`` (tokens emitted this step appended); a request the
        proposer refuses fails alone, with its error in ``out``."""
        batch = []
        for d in work:
            new = new_tokens.get(d.request_id, [])
            if d.count(len(new)) > 0:
                batch.append(ProposeRequest(d.request_id, d.token_ids + tuple(new),
                                            d.count(len(new)), d.params))
            else:
                out.drafts[d.request_id] = []
        while batch:
            assert self.proposer is not None  # the scheduler plans drafts only with one
            try:
                return self.proposer.start(batch)
            except RequestError as exc:
                out.errors[exc.request_id] = f"drafting failed: {exc}"
                batch = [b for b in batch if b.request_id != exc.request_id]
        return None

    def _read_back(self, verdict: _Verdict | None, job: ProposeJob | None,
                   out: StepOutput) -> None:
        """The round's one read-back: the verified requests' tokens and counts and the other
        group's drafts come to the host in a single copy (``sync_point``)."""
        drafted = job.device_tokens() if job is not None else None
        parts = [] if verdict is None else [verdict.packed]
        parts += [] if drafted is None else [drafted]
        with sync_point():
            values: list[int] = torch.cat(parts).tolist() if parts else []
        if verdict is not None:
            self._apply(verdict, values[: verdict.packed.numel()], out)
        if job is not None:
            rest = values[len(values) - drafted.numel():] if drafted is not None else None
            self._take(job, out, rest)

    def _take(self, job: ProposeJob | None, out: StepOutput,
              read: list[int] | None = None) -> None:
        """Keep a finished job's drafts: ids for the scheduler, probabilities here. ``read``:
        its drafted tokens, already read back (else the job reads them, a sync)."""
        if job is None:
            return
        with sync_point():  # the drafts come back (nothing left to read when ``read`` is given)
            proposals = job.result(read)
        for r, prop in zip(job.requests, proposals):
            out.drafts[r.request_id] = list(prop.token_ids)
            self.draft_probs[r.request_id] = prop.probs

    # ---- verification -------------------------------------------------------------------
    def _forward_and_verify(self, plan: StepPlan, out: StepOutput) -> _Verdict | None:
        hidden, rows, failed = run_round(self.model, plan, self.store, self.history,
                                         self.drafting.gap, self.attention,
                                         self.drafting.copies_issued)
        out.errors.update(failed)
        # rows whose logits are needed: the last token and every draft of sampling requests
        sampled = [i for i, s in enumerate(plan.seqs) if s.sample and s.request_id not in
                   out.errors]
        return self._verify(plan, sampled, rows, hidden) if sampled else None

    def _verify(
        self,
        plan: StepPlan,
        sampled: list[int],
        rows: list[tuple[int, int]],
        hidden: torch.Tensor,  # [num_tokens, hidden]
    ) -> _Verdict:
        """Acceptance of the sampled requests, left on the device (nothing read back)."""
        q = max(plan.seqs[i].num_drafts for i in sampled)
        seqs = [plan.seqs[i] for i in sampled]
        index, draft_ids = [], []
        for i, s in zip(sampled, seqs):
            hi, n = rows[i][1], s.num_drafts + 1
            index += list(range(hi - n, hi)) + [hi - 1] * (q + 1 - n)  # padding: never read
            draft_ids += list(s.token_ids[len(s.token_ids) - s.num_drafts :]) + [0] * (q + 1 - n)
        index_t, drafts_t = upload([index, draft_ids], torch.long, self.device)
        assert index_t is not None and drafts_t is not None
        logits = self.model.compute_logits(hidden[index_t])
        logits = logits.view(len(sampled), q + 1, -1)  # stays on the device
        drafts = drafts_t.view(len(sampled), q)
        probs = [self.draft_probs.get(s.request_id) if s.num_drafts else None for s in seqs]
        draft_probs = None
        if any(p is not None for p in probs):
            vocab = logits.shape[-1]
            draft_probs = torch.zeros(len(seqs), q, vocab, dtype=torch.float32,
                                      device=self.device)
            for b, (s, p) in enumerate(zip(seqs, probs)):
                if p is not None:
                    draft_probs[b, : s.num_drafts] = p[: s.num_drafts].float()
                elif s.num_drafts:  # point-mass drafts in a mixed batch
                    draft_probs[b].scatter_(1, drafts[b].view(-1, 1), 1.0)
        num_accepted, tokens = accept_drafts_on_device(
            logits, drafts, [s.num_drafts for s in seqs], draft_probs,
            [s.params for s in seqs], [self._generator(s.request_id, s.params) for s in seqs],
        )
        return _Verdict(seqs, torch.cat([num_accepted[:, None], tokens], dim=1).flatten())

    def _apply(self, verdict: _Verdict, values: list[int], out: StepOutput) -> None:
        """The verified requests' tokens, read back: ``[count, tokens (q + 1)]`` each."""
        width = len(values) // len(verdict.seqs)
        for b, s in enumerate(verdict.seqs):
            r = values[b * width : (b + 1) * width]
            toks = r[1 : 2 + r[0]]
            out.new_tokens[s.request_id] = toks
            if self.proposer is not None:  # the draft forgets what the target rejected
                self.proposer.rollback(s.request_id, s.start_pos + len(s.token_ids)
                                       - s.num_drafts + len(toks) - 1)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        """The request's own generator (seeded requests), made when first needed."""
        if request_id not in self.generators:
            self.generators[request_id] = make_generator(params, self.device)
        return self.generators[request_id]
