"""Runs one StepPlan on the device: write-backs, the target forward, verification.

The executor reads the plan and never touches requests; it returns a StepResult.
"""

from __future__ import annotations

import time

import torch

from specstream.backends.base import TransferBackend, TransferError
from specstream.engine.attention import StepAttention
from specstream.engine.history import HistorySource
from specstream.engine.scheduler import StepPlan, StepResult
from specstream.kvcache.storage import KVStore
from specstream.models.decoder import CausalLM
from specstream.spec.acceptance import accept_drafts


class Executor:
    def __init__(
        self, model: CausalLM, store: KVStore, backend: TransferBackend, history: HistorySource
    ) -> None:
        self.model, self.store, self.backend, self.history = model, store, backend, history
        self.device = store.device.device
        self.compute_s = 0.0  # time spent in forward passes and verification

    def writeback(self, plan: StepPlan) -> dict[str, str]:
        """Perform the plan's device-to-host copies and wait for them (errors per request)."""
        handles = [(rid, self.store.writeback(list(pairs), rid)) for rid, pairs in plan.writebacks]
        errors: dict[str, str] = {}
        for rid, hs in handles:
            for h in hs:
                try:
                    h.wait()
                except TransferError as exc:
                    errors[rid] = f"KV write-back failed: {exc}"
        return errors

    @torch.no_grad()
    def run(self, plan: StepPlan) -> StepResult:
        result = StepResult(errors=self.writeback(plan))
        if not plan.seqs:
            return result
        t0 = time.perf_counter()
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
        self.compute_s += time.perf_counter() - t0
        return result

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
