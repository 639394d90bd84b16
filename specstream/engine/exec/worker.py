"""Runs one StepPlan on the device: write-backs, the target forward, verification, drafting.

The worker reads the plan and never touches requests; it returns a StepOutput. What has device
state lives here, keyed by request id: the proposer's draft caches, and (``verify.py``) each
request's generator and the draft probabilities its pending drafts were sampled from.

A step, in order: the plan's prefix-cache copies and the decode rounds' write-backs (low
priority, overlapping the round); the other group's draft job starts where the drafting
strategy runs it (``drafting.py``); the target forward (``round.py``) and verification
(``verify.py``), left on the device; the one read-back (``logprobs.ReadBack``): emitted tokens,
counts, log-probabilities and the other group's drafts; then the drafts of the requests the
step verified, from the tokens they emitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence

import torch

from specstream.attention.waves import WaveAttention
from specstream.backends.base import TransferError, TransferHandle, sync_point
from specstream.engine.contract import DraftWork, StepOutput, StepPlan
from specstream.engine.exec.drafting import Drafting
from specstream.engine.exec.history import HistorySource
from specstream.engine.exec.host_attention import HostAttention
from specstream.engine.exec.logprobs import ReadBack
from specstream.engine.exec.round import run_round
from specstream.engine.exec.verify import Verifier
from specstream.engine.trace import Tracer
from specstream.errors import RequestError
from specstream.kvcache.storage import KVStore
from specstream.models.decoder import CausalLM
from specstream.spec.proposer import Proposal, ProposeJob, Proposer, ProposeRequest
from specstream.spec.token_tree import DraftTree
from specstream.structured.rounds import GrammarRounds


class Worker:
    """``drafting`` decides where the drafts of requests not verified in a step run (after
    verification, in the link's gaps, or on a second device); ``host``: the threads that
    attend ``SeqWork.host_blocks`` (None: host attention off)."""

    def __init__(
        self, model: CausalLM, store: KVStore, history: HistorySource,
        proposer: Proposer | None, drafting: Drafting, attention: type[WaveAttention],
        tracer: Tracer | None = None, stop_ids: Collection[int] = (),
        host: HostAttention | None = None, grammar: GrammarRounds | None = None,
    ) -> None:
        self.model, self.store, self.history, self.host = model, store, history, host
        self.attention = attention
        self.proposer, self.drafting = proposer, drafting
        self.tracer = tracer or Tracer(False)
        self.verifier = Verifier(model, store, proposer, stop_ids, grammar)

    # ---- the step -----------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, plan: StepPlan, link_bps: float = 0.0) -> StepOutput:
        """Run the plan (``link_bps``: the link's estimated rate, for when copies land).
        Drafts for requests not verified in the step run per the drafting strategy; drafts
        for requests it verifies run after their verification.

        In inference mode: no autograd bookkeeping per op (a round is thousands of small ops,
        and on a GPU each one's host cost is the round's overhead)."""
        t0 = time.perf_counter()
        out = StepOutput(start=t0)
        for rid in plan.finished:
            self.release(rid)
        if plan.cache_copies:  # prefix-cache hits: the requests' own copies, before any use
            self.store.copy_blocks(plan.cache_copies)
        # decode rounds' write-backs, at low priority: they overlap this round, which still
        # attends the blocks on the device
        writebacks = self._copy_to_host(plan.writebacks)
        wait0 = self.history.wait_s
        job = self._start([d for d in plan.drafts if not d.after_verify], {}, out)
        self.drafting.begin(job)
        reads = ReadBack()
        try:
            if plan.seqs:
                with self.tracer.span("verify", "verify", tokens=plan.num_tokens):
                    result = run_round(self.model, plan, self.store, self.history, link_bps,
                                       self.drafting, self.attention, self.host)
                    out.errors.update(result.failed)
                    out.halves = result.halves
                    self.verifier.verify(plan, result, out, reads)
        except BaseException:
            self.drafting.abort()
            for d in plan.drafts:  # their draft caches may be part-advanced: start them anew
                self.release(d.request_id)
            raise
        finally:  # no copy may still be writing when its blocks change hands
            out.errors.update(self._wait(writebacks))
        out.wait_s = self.history.wait_s - wait0
        out.draft_s = self.drafting.end()
        self._read_back(reads, job, out)
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
        self.verifier.release(request_id)
        if self.proposer is not None:
            self.proposer.free(request_id)

    # ---- drafting -----------------------------------------------------------------------
    def _grammar(self, d: DraftWork, tokens: tuple[int, ...]
                 ) -> Callable[[Sequence[int]], torch.Tensor] | None:
        """What a constrained request's grammar allows after ``tokens`` and some drafts."""
        grammar, constraint = self.verifier.grammar, d.params.structured
        if grammar is None or constraint is None:
            return None
        generated = tokens[d.prompt_len :]
        return lambda drafts: grammar.masks(d.request_id, constraint, generated, [drafts])[0]

    def _start(self, work: list[DraftWork], new_tokens: dict[str, list[int]],
               out: StepOutput) -> ProposeJob | None:
        """The proposer's job for ``work`` (tokens emitted this step appended); a request the
        proposer refuses fails alone, with its error in ``out``."""
        batch = []
        for d in work:
            new = new_tokens.get(d.request_id, [])
            if d.count(len(new)) > 0:
                tokens = d.token_ids + tuple(new)
                batch.append(ProposeRequest(d.request_id, tokens, d.count(len(new)),
                                            d.params, topk=d.topk, max_nodes=d.max_nodes,
                                            allowed=self._grammar(d, tokens)))
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

    def _read_back(self, reads: ReadBack, job: ProposeJob | None, out: StepOutput) -> None:
        """The round's one read-back: the verified requests' tokens and counts (and any
        log-probabilities asked for) and the other group's drafts come to the host in a single
        copy (``sync_point``)."""
        drafted = job.device_tokens() if job is not None else None
        if drafted is not None:
            reads.add(drafted, lambda v: self._take(job, out, [int(x) for x in v]))
        reads.run()
        if job is not None and drafted is None:
            self._take(job, out)

    def _take(self, job: ProposeJob | None, out: StepOutput,
              read: list[int] | None = None) -> None:
        """Keep a finished job's drafts: ids for the scheduler, probabilities for the
        verifier. ``read``: its drafted tokens, already read back (else the job reads them,
        a sync)."""
        if job is None:
            return
        with sync_point():  # the drafts come back (nothing left to read when ``read`` is given)
            proposals = job.result(read)
        for r, prop in zip(job.requests, proposals):
            if prop.parents is not None:
                problem = _tree_problem(r, prop)
                if problem:
                    out.errors[r.request_id] = f"drafting failed: {problem}"
                    continue
                out.draft_parents[r.request_id] = list(prop.parents)
            out.drafts[r.request_id] = list(prop.token_ids)
            self.verifier.keep_draft_probs(r.request_id, prop.probs)


def _tree_problem(r: ProposeRequest, prop: Proposal) -> str | None:
    """Why a proposed token tree cannot be verified (None: it can): a malformed tree, or one
    past the request's depth (its room) or node budget."""
    assert prop.parents is not None
    try:
        tree = DraftTree(tuple(prop.token_ids), tuple(prop.parents))
    except (TypeError, ValueError) as exc:
        return f"malformed token tree: {exc}"
    budget = r.num_tokens if r.max_nodes is None else r.max_nodes
    if tree.depth > r.num_tokens or len(tree) > budget:
        return (f"a token tree of {len(tree)} nodes, {tree.depth} deep, past the "
                f"{budget} nodes and depth {r.num_tokens} asked for")
    return None
