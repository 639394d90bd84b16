"""Folding a step's output back into its requests: tokens and stop checks, KV commits (rejected
drafts roll back), write-backs, drafts for the next round, errors, and the end of a request."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from specstream.engine.contract import SeqWork, StepOutput, StepPlan, TokenLogprobs, Writebacks
from specstream.engine.request import Request, Status, TextCodec
from specstream.kvcache.manager import KVManager


@dataclass
class StepUpdate:
    """What ``Scheduler.update`` did with a step's output."""

    # Requests the step worked on, in plan order (finished ones included, reported once).
    touched: list[Request] = field(default_factory=list)
    # Tail blocks that a prefill chunk pushed past the budget: copied right after the step,
    # then ``Scheduler.complete_writebacks`` frees them (the next chunk needs the room; decode
    # rounds' write-backs ride along the next step instead, see StepPlan.writebacks).
    writebacks: Writebacks = field(default_factory=dict)
    # Tokens appended to outputs (those past a stop are dropped).
    num_appended: int = 0


class Update:
    """The scheduler's results half: ``apply`` folds a step's output in, ``finish`` ends a
    request. ``on_finish(req)`` gives the request's reservation back and removes it from the
    queues (the scheduler's)."""

    def __init__(self, kv: KVManager, eos_token_ids: frozenset[int],
                 tokenizer: TextCodec | None, on_finish: Callable[[Request], None]) -> None:
        self.kv, self.eos_token_ids, self.tokenizer = kv, eos_token_ids, tokenizer
        self.on_finish = on_finish

    def apply(self, plan: StepPlan, output: StepOutput, requests: dict[str, Request],
              next_drafts: Callable[[Request], bool]) -> StepUpdate:
        """Fold a step's output into its requests. A sampling request with neither tokens nor
        an error in the output did not run: it stays as it was and is scheduled again.
        ``next_drafts(req)``: whether a request that just verified drafts for its next round
        (in this step, after verification, or while the other group verifies)."""
        result = StepUpdate()
        self.kv.release_pins()  # the step made its prefix-cache copies
        self.kv.device.free(list(plan.restore_blocks))
        for work in plan.seqs:  # promoted blocks the step's stream filled join the window
            if work.promote and work.request_id in self.kv.seqs:
                self.kv.complete_promotion(work.request_id, work.request_id not in output.errors)
        # copied during the step: the blocks join the host tier
        self.complete_writebacks([rid for rid, _ in plan.writebacks], output.errors, requests)
        for work in plan.seqs:
            req = requests.get(work.request_id)
            if req is None or req.finished:
                continue
            result.touched.append(req)
            if work.request_id in output.errors:
                self.finish(req, "error", output.errors[work.request_id])
                continue
            new = output.new_tokens.get(work.request_id)
            if work.sample and new is None:
                continue
            self._fold(req, work, new or [], output, result, next_drafts)
        for d in plan.drafts:
            req = requests.get(d.request_id)
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

    def _fold(self, req: Request, work: SeqWork, new: list[int], output: StepOutput,
              result: StepUpdate, next_drafts: Callable[[Request], bool]) -> None:
        """One request's tokens, KV commit and write-back plan."""
        rid = req.request_id
        if req.prompt_logprobs is not None:
            req.prompt_logprobs += output.prompt_logprobs.get(rid, [])
        if work.sample:
            self._count_round(req, work, len(new))
        self._commit(work, req, len(new))
        result.num_appended += self._append(req, new, output.logprobs.get(rid))
        pairs = [] if req.finished else self.kv.plan_writeback(rid)
        if pairs and work.prefill:
            result.writebacks[rid] = pairs
        if work.sample and not req.finished:
            req.needs_draft = next_drafts(req)
            req.draft_token_ids, req.draft_parents = [], None

    def complete_writebacks(self, writebacks: Iterable[str], errors: dict[str, str],
                            requests: dict[str, Request]) -> None:
        """The worker copied the write-backs of the requests ``writebacks``: the blocks join
        the host tier (and leave the device where the residency says so); requests whose copy
        failed fail."""
        for rid in writebacks:
            req = requests.get(rid)
            if req is None or req.finished:
                continue
            if rid in errors:
                self.finish(req, "error", errors[rid])
            else:
                self.kv.complete_writeback(rid)
                self.kv.share_written(rid, req.all_token_ids)  # prefix sharing: cache them

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

    @staticmethod
    def _count_round(req: Request, work: SeqWork, num_new: int) -> None:
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
        # the prefix cache keeps its full blocks (not a failed request's: its KV may be bad)
        self.kv.free(req.request_id, req.all_token_ids if reason != "error" else None)
        self.on_finish(req)
