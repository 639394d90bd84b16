"""Runs one StepPlan on the device: write-backs, the target forward, verification.

The executor reads the plan and never touches requests; it returns a StepResult.
"""

from __future__ import annotations

import threading
import time

import torch

from specstream.backends.base import TransferBackend, TransferError
from specstream.engine.attention import StepAttention
from specstream.engine.history import HistorySource
from specstream.engine.overlap import GapFiller
from specstream.engine.scheduler import StepPlan, StepResult
from specstream.engine.trace import Tracer
from specstream.kvcache.storage import KVStore
from specstream.models.decoder import CausalLM
from specstream.spec.acceptance import accept_drafts
from specstream.spec.proposer import Proposal, ProposeJob


class _DraftWorker:
    """Runs a draft job on its own thread: the second device of parallel-spec."""

    def __init__(self, job: ProposeJob, tracer: Tracer) -> None:
        self.job, self.tracer, self.draft_s = job, tracer, 0.0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="draft-device", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            torch.set_num_threads(1)
            t0 = time.perf_counter()
            with torch.no_grad():
                self.job.result()
            self.draft_s = time.perf_counter() - t0
            self.tracer.add("draft", "draft (second device)", t0, t0 + self.draft_s)
        except BaseException as exc:  # surfaced in join()
            self.error = exc

    def join(self) -> float:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.draft_s


class Executor:
    """``drafting`` says where a step's draft job runs: "sequential" (after verification),
    "gaps" (in the transfer gaps of verification, same device) or "parallel" (a second
    worker, standing for a second device)."""

    def __init__(
        self, model: CausalLM, store: KVStore, backend: TransferBackend, history: HistorySource,
        drafting: str = "sequential", tracer: Tracer | None = None,
    ) -> None:
        self.model, self.store, self.backend, self.history = model, store, backend, history
        self.device = store.device.device
        self.drafting = drafting
        self.tracer = tracer or Tracer(False)

    def draft_now(self, job: ProposeJob) -> list[Proposal]:
        """Run a draft job to the end now, on the draft's device (the second worker in
        ``parallel`` mode, this thread otherwise), and return its proposals."""
        if self.drafting == "parallel":
            _DraftWorker(job, self.tracer).join()
            return job.result()
        with self.tracer.span("draft", "draft (sequential)"):
            return job.result()

    def writeback(self, moves: dict[str, list[tuple[int, int]]]) -> dict[str, str]:
        """Copy tail blocks to the host tier and wait for them; returns errors per request."""
        handles = [(rid, self.store.writeback(pairs, rid)) for rid, pairs in moves.items()]
        errors: dict[str, str] = {}
        for rid, hs in handles:
            for h in hs:
                try:
                    h.wait()
                except TransferError as exc:
                    errors[rid] = f"KV write-back failed: {exc}"
        return errors

    def run(self, plan: StepPlan, draft: ProposeJob | None = None) -> StepResult:
        """Run the plan; ``draft`` (drafts for requests not verified this step) runs per
        ``self.drafting``. Timings in the result separate link waits from compute."""
        t0 = time.perf_counter()
        wait0 = self.history.wait_s
        worker = None
        if draft is not None and self.drafting == "parallel":
            worker = _DraftWorker(draft, self.tracer)
        elif draft is not None and self.drafting == "gaps":
            self.history.gap = GapFiller(draft, self.tracer)
        result = StepResult()
        try:
            if plan.seqs:
                with self.tracer.span("verify", "verify", tokens=plan.num_tokens):
                    self._forward_and_verify(plan, result)
        except BaseException:  # a failed round leaves no draft work behind for the next one
            if worker is not None:
                worker.thread.join()
            raise
        finally:
            gap, self.history.gap = self.history.gap, None
        result.wait_s = self.history.wait_s - wait0
        if gap is not None:
            result.draft_s = gap.draft_s + gap.finish()
        elif worker is not None:
            result.draft_s = worker.join()
        elif draft is not None:
            with self.tracer.span("draft", "draft (sequential)"):
                d0 = time.perf_counter()
                draft.result()
                result.draft_s = time.perf_counter() - d0
        if draft is not None:
            result.proposals = draft.result()
        result.wall_s = time.perf_counter() - t0
        result.start = t0
        return result

    @torch.no_grad()
    def _forward_and_verify(self, plan: StepPlan, result: StepResult) -> None:
        ids = [t for s in plan.seqs for t in s.token_ids]
        pos = [p for s in plan.seqs for p in range(s.start_pos, s.start_pos + len(s.token_ids))]
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        ctx = StepAttention(plan, self.store, self.history)
        self.history.begin(plan)
        try:
            hidden = self.model(input_ids, positions, ctx)
        finally:
            self.history.end()
        result.errors.update(ctx.failed)
        # rows whose logits are needed: the last token and every draft of sampling requests
        sampled = [i for i, s in enumerate(plan.seqs) if s.sample and s.request_id not in
                   result.errors]
        if sampled:
            self._verify(plan, sampled, ctx.rows, hidden, result)

    def _verify(
        self,
        plan: StepPlan,
        sampled: list[int],
        rows: list[tuple[int, int]],
        hidden: torch.Tensor,  # [num_tokens, hidden]
        result: StepResult,
    ) -> None:
        q = max(plan.seqs[i].num_drafts for i in sampled)
        index = torch.zeros(len(sampled), q + 1, dtype=torch.long)
        for b, i in enumerate(sampled):
            s, hi = plan.seqs[i], rows[i][1]
            n = s.num_drafts + 1
            index[b, :n] = torch.arange(hi - n, hi)
            index[b, n:] = hi - 1  # padding rows, never read past num_drafts
        logits = self.model.compute_logits(hidden[index.view(-1).to(self.device)])
        logits = logits.view(len(sampled), q + 1, -1)
        seqs = [plan.seqs[i] for i in sampled]
        drafts = torch.zeros(len(sampled), q, dtype=torch.long)
        for b, s in enumerate(seqs):
            if s.num_drafts:
                tail = s.token_ids[len(s.token_ids) - s.num_drafts :]
                drafts[b, : s.num_drafts] = torch.tensor(tail, dtype=torch.long)
        draft_probs = None
        if any(s.draft_probs is not None for s in seqs):
            vocab = logits.shape[-1]
            draft_probs = torch.zeros(len(seqs), q, vocab, dtype=torch.float32)
            for b, s in enumerate(seqs):
                if s.draft_probs is not None:
                    draft_probs[b, : s.num_drafts] = s.draft_probs.float().cpu()
                elif s.num_drafts:  # point-mass drafts in a mixed batch
                    draft_probs[b].scatter_(1, drafts[b].view(-1, 1), 1.0)
        out = accept_drafts(
            logits.cpu(), drafts, [s.num_drafts for s in seqs], draft_probs,
            [s.params for s in seqs], [s.generator for s in seqs],
        )
        for s, toks in zip(seqs, out.output_tokens):
            result.new_tokens[s.request_id] = toks
