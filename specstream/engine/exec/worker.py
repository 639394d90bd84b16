"""Runs one StepPlan on the device: the target forward, verification, drafting, write-backs.

The worker reads the plan and never touches requests; it returns a StepOutput. What has device
state lives here, keyed by request id: the proposer's draft caches, each request's generator,
the draft probabilities its pending drafts were sampled from.

Token trees: a round where some request verifies a tree accepts every request's drafts with
``accept_tree_on_device`` (chains as trees of one branch; an all-chain round keeps
``accept_drafts_on_device``). The accepted path's nodes sit in the KV slots the round gave them
(node i right after the root plus i); after the read-back one copy over all layers moves them
to the slots after the root in path order, where the scheduler's commit keeps them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from specstream.attention.waves import WaveAttention
from specstream.backends.base import (
    TransferBackend,
    TransferError,
    TransferHandle,
    sync_point,
    upload,
)
from specstream.engine.contract import DraftWork, SeqWork, StepOutput, StepPlan
from specstream.engine.exec.drafting import Drafting
from specstream.engine.exec.history import HistorySource
from specstream.engine.exec.host_attention import HostAttention
from specstream.engine.exec.round import run_round
from specstream.engine.request import TokenLogprobs
from specstream.engine.trace import Tracer
from specstream.errors import RequestError
from specstream.kvcache.storage import KVStore
from specstream.models.decoder import CausalLM
from specstream.sampling import TokenContext, make_generator, process_logits
from specstream.sampling_params import SamplingParams
from specstream.spec.acceptance import accept_drafts_on_device
from specstream.spec.proposer import Proposal, ProposeJob, Proposer, ProposeRequest
from specstream.spec.tree import DraftTree, accept_tree_on_device

PROMPT_LOGITS_ROWS = 512  # prompt_logprobs: logits rows computed at once (memory: rows x V)


@dataclass
class _Verdict:
    """A round's acceptance, still on the device."""

    seqs: list[SeqWork]  # the verified requests
    # [B * (q + 1 + 1)]: per request its accepted-draft count, then q + 1 tokens (the accepted
    # drafts and the recovered or bonus token, padded). Tree rounds: [B * 2], per request its
    # deepest accepted node (-1: none) and the recovered or bonus token.
    packed: torch.Tensor
    # Tree rounds: every verified request's drafts as a tree (chains as one branch).
    trees: list[DraftTree] | None = None
    # SamplingParams.logprobs: what the verified requests that asked for them get (on the
    # device until the read-back).
    logprobs: _Logprobs | None = None
    # Tree rounds, after the read-back: each request's accepted path (by index in seqs).
    paths: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class _Logprobs:
    """Raw log-probabilities of some requests' rows of a verification, on the device: every
    node's (draft's) at the row that predicts it, the extra token's at its row, and each row's
    most likely tokens. Rows are numbered within these requests only."""

    seqs: list[int]  # their index in the verdict
    row_off: list[int]  # per request, its first row (the root's); nodes at row_off + 1 + i
    node_rows: list[list[int]]  # per request, per node: the row predicting it
    k: int  # most likely tokens per row
    # [N], [N], [B'], [B'], [R' * k], [R' * k]: node logprobs and ranks, the extra token's
    # logprob and rank, the top-k logprobs and token ids of every row
    packed: torch.Tensor
    num_nodes: int = 0
    num_rows: int = 0
    chain_width: int = 0  # chains: rows per request (q + 1); 0 for trees


@dataclass
class _ReadBack:
    """Everything a step reads from the device, copied in one go at the end of the round
    (``sync_point``): each part with what takes its values."""

    parts: list[torch.Tensor] = field(default_factory=list)
    takers: list[Callable[[list[float]], None]] = field(default_factory=list)

    def add(self, values: torch.Tensor, take: Callable[[list[float]], None]) -> None:
        self.parts.append(values.flatten())
        self.takers.append(take)

    def run(self) -> None:
        if not self.parts:
            return
        with sync_point():  # float64 holds every token id and count exactly
            values: list[float] = torch.cat([p.double() for p in self.parts]).tolist()
        at = 0
        for part, take in zip(self.parts, self.takers):
            take(values[at : at + part.numel()])
            at += part.numel()


class Worker:
    """``drafting`` decides where the drafts of requests not verified in a step run (after
    verification, in the link's gaps, or on a second device); see ``engine/drafting.py``."""

    def __init__(
        self, model: CausalLM, store: KVStore, backend: TransferBackend, history: HistorySource,
        proposer: Proposer | None, drafting: Drafting, attention: type[WaveAttention],
        tracer: Tracer | None = None, stop_ids: Collection[int] = (),
    ) -> None:
        """``stop_ids``: the model's end-of-sequence ids (min_tokens masks them)."""
        self.model, self.store, self.backend, self.history = model, store, backend, history
        self.stop_ids = frozenset(stop_ids)
        self.attention = attention
        self.proposer, self.drafting = proposer, drafting
        self.device = store.device.device
        self.tracer = tracer or Tracer(False)
        self.generators: dict[str, torch.Generator | None] = {}
        # [num_drafts, V] fp32 per request with pending sampled drafts (None: point masses)
        self.draft_probs: dict[str, torch.Tensor | None] = {}
        # host_attention: the worker threads that attend SeqWork.host_blocks (None: off)
        self.host: HostAttention | None = None

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
        if plan.cache_copies:  # prefix-cache hits: the requests' own copies, before any use
            self.store.copy_blocks(plan.cache_copies)
        # decode rounds' write-backs, at low priority: they overlap this round, which still
        # attends the blocks on the device
        writebacks = self._copy_to_host(plan.writebacks)
        wait0 = self.history.wait_s
        during = [d for d in plan.drafts if not d.after_verify]
        job = self._start(during, {}, out)
        self.drafting.begin(job)
        reads = _ReadBack()
        try:
            if plan.seqs:
                with self.tracer.span("verify", "verify", tokens=plan.num_tokens):
                    self._forward_and_verify(plan, out, reads)
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
                                            d.count(len(new)), d.params, topk=d.topk,
                                            max_nodes=d.max_nodes))
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

    def _read_back(self, reads: _ReadBack, job: ProposeJob | None, out: StepOutput) -> None:
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
        """Keep a finished job's drafts: ids for the scheduler, probabilities here. ``read``:
        its drafted tokens, already read back (else the job reads them, a sync)."""
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
            self.draft_probs[r.request_id] = prop.probs

    # ---- verification -------------------------------------------------------------------
    def _forward_and_verify(self, plan: StepPlan, out: StepOutput, reads: _ReadBack) -> None:
        hidden, rows, failed = run_round(self.model, plan, self.store, self.history,
                                         self.drafting.gap, self.attention,
                                         self.drafting.copies_issued, self.host)
        out.errors.update(failed)
        ok = [i for i, s in enumerate(plan.seqs) if s.request_id not in out.errors]
        for i in ok:
            if plan.seqs[i].prompt_targets:
                self._prompt_logprobs(plan.seqs[i], rows[i], hidden, out, reads)
        # rows whose logits are needed: the last token and every draft of sampling requests
        sampled = [i for i in ok if plan.seqs[i].sample]
        if sampled:
            verdict = self._verify(plan, sampled, rows, hidden)
            reads.add(verdict.packed, lambda v: self._apply(verdict, [int(x) for x in v], out))
            lp = verdict.logprobs
            if lp is not None:
                reads.add(lp.packed, lambda v: self._take_logprobs(verdict, lp, v, out))

    def _verify(
        self,
        plan: StepPlan,
        sampled: list[int],
        rows: list[tuple[int, int]],
        hidden: torch.Tensor,  # [num_tokens, hidden]
    ) -> _Verdict:
        """Acceptance of the sampled requests, left on the device (nothing read back)."""
        seqs = [plan.seqs[i] for i in sampled]
        if any(s.is_tree for s in seqs):
            return self._verify_trees(seqs, [rows[i] for i in sampled], hidden)
        q = max(s.num_drafts for s in seqs)
        index, draft_ids = [], []
        for i, s in zip(sampled, seqs):
            hi, n = rows[i][1], s.num_drafts + 1
            index += list(range(hi - n, hi)) + [hi - 1] * (q + 1 - n)  # padding: never read
            draft_ids += list(s.token_ids[len(s.token_ids) - s.num_drafts :]) + [0] * (q + 1 - n)
        index_t, drafts_t = upload([index, draft_ids], torch.long, self.device)
        assert index_t is not None and drafts_t is not None
        raw = self.model.compute_logits(hidden[index_t])  # [B * (q + 1), V], on the device
        # row j of a request as if its drafts 0..j-1 had been generated (padding rows: all)
        chains = [[s.token_ids[len(s.token_ids) - s.num_drafts:][: min(j, s.num_drafts)]
                   for j in range(q + 1)] for s in seqs]
        logits = self._process(raw, seqs, chains).view(len(sampled), q + 1, -1)
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
        # the extra token sits at row num_accepted of its request
        extra = tokens.gather(1, num_accepted[:, None]).squeeze(1)
        pred_rows = [list(range(s.num_drafts)) for s in seqs]  # draft j: predicted by row j
        lp = self._logprobs(raw, seqs, [b * (q + 1) for b in range(len(seqs))], pred_rows,
                            [list(s.token_ids[len(s.token_ids) - s.num_drafts:]) for s in seqs],
                            num_accepted, extra, chain_width=q + 1)
        return _Verdict(seqs, torch.cat([num_accepted[:, None], tokens], dim=1).flatten(),
                        logprobs=lp)

    def _verify_trees(
        self,
        seqs: list[SeqWork],
        rows: list[tuple[int, int]],  # each request's rows in hidden
        hidden: torch.Tensor,  # [num_tokens, hidden]
    ) -> _Verdict:
        """Acceptance of a round with token trees, left on the device: every input row of a
        request is a logits row ([root, node 0, ...], as ``accept_tree`` packs them)."""
        index: list[int] = []
        trees, probs = [], []
        for (_, hi), s in zip(rows, seqs):
            index += range(hi - s.num_drafts - 1, hi)
            nodes = tuple(s.token_ids[len(s.token_ids) - s.num_drafts :])
            tree = DraftTree(nodes, s.parents) if s.parents else DraftTree.chain(nodes)
            trees.append(tree)
            probs.append(self._tree_probs(s, tree))
        index_t = upload([index], torch.long, self.device)[0]
        assert index_t is not None
        raw = self.model.compute_logits(hidden[index_t])  # [sum_b (N_b + 1), V]
        # row 1 + i of a request as if the nodes from the root to node i had been generated
        paths = [[()] + [tuple(t.tokens[j] for j in t.path(i)) for i in range(len(t))]
                 for t in trees]
        logits = self._process(raw, seqs, paths)
        last, extra = accept_tree_on_device(
            logits, trees, probs if any(p is not None for p in probs) else None,
            [s.params for s in seqs], [self._generator(s.request_id, s.params) for s in seqs])
        offsets, at = [], 0
        for t in trees:
            offsets.append(at)
            at += len(t) + 1
        # node i is predicted by its parent's row (the root's: row 0); the extra token by the
        # deepest accepted node's (last = -1: the root's)
        pred_rows = [[p + 1 for p in t.parents] for t in trees]
        lp = self._logprobs(raw, seqs, offsets, pred_rows, [list(t.tokens) for t in trees],
                            last + 1, extra)
        return _Verdict(seqs, torch.stack([last, extra], dim=1).flatten(), trees, lp)

    def _process(self, raw: torch.Tensor, seqs: list[SeqWork],
                 paths: list[list[tuple[int, ...]]]) -> torch.Tensor:  # [R, V]
        """The verification logits after logit_bias, min_tokens and the penalties (each row as
        if the draft tokens on its path had been generated); ``raw`` itself when no request
        asks for any of them."""
        if not any(s.params.processes_logits for s in seqs):
            return raw
        contexts = []
        for s in seqs:
            prompt_len = len(s.history) - s.output_len
            contexts.append(TokenContext(s.output_len, s.history[:prompt_len],
                                         s.history[prompt_len:]))
        return process_logits(raw, [s.params for s in seqs], contexts, paths, self.stop_ids)

    def _logprobs(
        self,
        raw: torch.Tensor,  # [R, V] the verification's raw logits, every request's rows
        seqs: list[SeqWork],
        row_off: list[int],  # per request, its first row in raw
        node_rows: list[list[int]],  # per request, per node: the row (from row_off) predicting it
        node_tokens: list[list[int]],
        extra_row: torch.Tensor,  # [B] device: the row (from row_off) of the extra token
        extra: torch.Tensor,  # [B] device: the extra token
        chain_width: int = 0,
    ) -> _Logprobs | None:
        """SamplingParams.logprobs of a verification: the target's raw log-softmax at every
        row of the requests that asked, left on the device (what was emitted is known only
        after the read-back, so every node's and the extra token's are taken)."""
        want = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
        if not want:
            return None
        k = min(max(seqs[b].params.logprobs or 0 for b in want), raw.shape[-1])
        rows: list[int] = []
        offs: list[int] = []
        n_rows: list[int] = []
        n_tok: list[int] = []
        sub_nodes: list[list[int]] = []
        for b in want:
            size = (chain_width or len(node_tokens[b]) + 1)
            offs.append(len(rows))
            rows += range(row_off[b], row_off[b] + size)
            n_rows += [offs[-1] + r for r in node_rows[b]]
            n_tok += node_tokens[b]
            sub_nodes.append(node_rows[b])
        rows_t, n_rows_t, n_tok_t, offs_t, want_t = upload(
            [rows, n_rows, n_tok, offs, want], torch.long, self.device)
        assert rows_t is not None and offs_t is not None and want_t is not None
        lp = torch.log_softmax(raw.index_select(0, rows_t).float(), dim=-1)  # [R', V]
        e_rows = offs_t + extra_row.index_select(0, want_t)
        e_lp = lp[e_rows, extra.index_select(0, want_t)]
        e_rank = (lp[e_rows] > e_lp[:, None]).sum(-1) + 1
        parts = []
        if n_tok:
            assert n_rows_t is not None and n_tok_t is not None
            node_lp = lp[n_rows_t, n_tok_t]
            parts += [node_lp, (lp[n_rows_t] > node_lp[:, None]).sum(-1) + 1]
        parts += [e_lp, e_rank]
        if k:
            top, top_ids = lp.topk(k, dim=-1)
            parts += [top.flatten(), top_ids.flatten()]
        packed = torch.cat([p.double() for p in parts])
        return _Logprobs(want, offs, sub_nodes, k, packed, len(n_tok), len(rows), chain_width)

    def _take_logprobs(self, verdict: _Verdict, lp: _Logprobs, values: list[float],
                       out: StepOutput) -> None:
        """The emitted tokens' entries, read back: the nodes of each accepted path and the
        extra token, with the most likely tokens of the rows that predicted them."""
        n, b_ = lp.num_nodes, len(lp.seqs)
        node_lp, node_rank = values[:n], values[n : 2 * n]
        e_lp, e_rank = values[2 * n : 2 * n + b_], values[2 * n + b_ : 2 * n + 2 * b_]
        top_at = 2 * n + 2 * b_
        k = lp.k

        def top(row: int) -> tuple[tuple[int, float], ...]:
            at = top_at + row * k
            ids = values[at + lp.num_rows * k : at + lp.num_rows * k + k]
            return tuple((int(t), v) for t, v in zip(ids, values[at : at + k]))

        node_at = 0
        for j, b in enumerate(lp.seqs):
            s = verdict.seqs[b]
            rid = s.request_id
            toks = out.new_tokens.get(rid)
            nodes = lp.node_rows[j]
            if toks is None:
                node_at += len(nodes)
                continue
            path = (tuple(range(len(toks) - 1)) if verdict.trees is None
                    else verdict.paths[b])
            entries: list[TokenLogprobs] = []
            for i in path:
                row = lp.row_off[j] + nodes[i]
                entries.append(TokenLogprobs(toks[len(entries)], node_lp[node_at + i],
                                             int(node_rank[node_at + i]), top(row)))
            last = lp.row_off[j] + (len(path) if verdict.trees is None
                                    else (path[-1] + 1 if path else 0))
            entries.append(TokenLogprobs(toks[-1], e_lp[j], int(e_rank[j]), top(last)))
            out.logprobs[rid] = entries
            node_at += len(nodes)

    def _prompt_logprobs(self, s: SeqWork, rows: tuple[int, int], hidden: torch.Tensor,
                         out: StepOutput, reads: _ReadBack) -> None:
        """SamplingParams.prompt_logprobs of a prefill chunk: input i predicts
        ``s.prompt_targets[i]`` (the raw log-softmax), in slices of logits rows."""
        lo = rows[0]
        targets = list(s.prompt_targets)
        k = min(s.params.prompt_logprobs or 0, self.model.config.vocab_size)
        parts = []
        for a in range(0, len(targets), PROMPT_LOGITS_ROWS):
            b = min(len(targets), a + PROMPT_LOGITS_ROWS)
            lp = torch.log_softmax(self.model.compute_logits(hidden[lo + a : lo + b]).float(),
                                   dim=-1)
            tgt = upload([targets[a:b]], torch.long, self.device)[0]
            assert tgt is not None
            chosen = lp.gather(1, tgt[:, None]).squeeze(1)
            part = [chosen, (lp > chosen[:, None]).sum(-1) + 1]
            if k:
                top, ids = lp.topk(k, dim=-1)
                part += [top.flatten(), ids.flatten()]
            parts.append(torch.cat([p.double() for p in part]))

        def take(values: list[float]) -> None:
            entries, at = [], 0
            for a in range(0, len(targets), PROMPT_LOGITS_ROWS):
                m = min(len(targets), a + PROMPT_LOGITS_ROWS) - a
                lps, ranks = values[at : at + m], values[at + m : at + 2 * m]
                top_at = at + 2 * m
                tops = values[top_at : top_at + m * k]
                ids = values[top_at + m * k : top_at + 2 * m * k]
                for i in range(m):
                    entries.append(TokenLogprobs(
                        targets[a + i], lps[i], int(ranks[i]),
                        tuple((int(t), v) for t, v in zip(ids[i * k : (i + 1) * k],
                                                          tops[i * k : (i + 1) * k]))))
                at += 2 * m + 2 * m * k
            out.prompt_logprobs[s.request_id] = entries

        reads.add(torch.cat(parts), take)

    def _tree_probs(self, s: SeqWork, tree: DraftTree) -> torch.Tensor | None:
        """The request's draft distributions as ``accept_tree`` reads them (``[N + 1, V]``:
        row 1 + i what node i's children were drawn from, row 0 the root's), or None for
        point masses and greedy requests. A node's probs are the distribution it was drawn
        from, which its siblings share (i.i.d. children)."""
        p = self.draft_probs.get(s.request_id) if s.num_drafts else None
        if p is None or s.params.greedy:
            return None
        n = len(tree)
        rows = torch.zeros(n + 1, p.shape[-1], dtype=torch.float32, device=self.device)
        if not s.is_tree:
            rows[:n] = p[:n]
        else:
            for i, parent in enumerate(tree.parents):
                rows[parent + 1] = p[i]
        return rows

    def _apply(self, verdict: _Verdict, values: list[int], out: StepOutput) -> None:
        """The verified requests' tokens, read back: ``[count, tokens (q + 1)]`` each, or in a
        tree round ``[deepest accepted node, extra token]``; then the accepted paths' KV moves
        into place."""
        width = len(values) // len(verdict.seqs)
        moves: list[tuple[int, int, int, int]] = []
        for b, s in enumerate(verdict.seqs):
            r = values[b * width : (b + 1) * width]
            if verdict.trees is None:
                toks = r[1 : 2 + r[0]]
            else:
                tree = verdict.trees[b]
                path = tree.path(r[0])
                verdict.paths[b] = path
                toks = [tree.tokens[i] for i in path] + [r[1]]
                moves += self._path_moves(s, path)
                out.tree_ranks[s.request_id] = _ranks(tree, path)
            out.new_tokens[s.request_id] = toks
            if self.proposer is not None:  # the draft forgets what the target rejected
                # a tree's nodes sit in the draft's cache in node order: keep up to the root,
                # the draft reads the accepted tokens again when it next catches up
                self.proposer.rollback(
                    s.request_id, s.start_pos + len(s.token_ids) - s.num_drafts
                    + (0 if s.parents else len(toks) - 1))
        if moves:
            self._compact(moves)

    def _path_moves(self, s: SeqWork, path: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
        """(source block, offset, destination block, offset) of the accepted nodes whose KV
        is not yet where the path puts it: node i sits right after the root plus i, the k-th
        node of the path belongs k after the root."""
        bs = self.store.block_size
        root = s.start_pos + len(s.token_ids) - s.num_drafts - 1
        moves = []
        for k, node in enumerate(path, 1):
            if node + 1 != k:
                src, dst = root + 1 + node - s.host_tokens, root + k - s.host_tokens
                moves.append((s.device_blocks[src // bs], src % bs,
                               s.device_blocks[dst // bs], dst % bs))
        return moves

    def _compact(self, moves: list[tuple[int, int, int, int]]) -> None:
        """Copy the K/V of every layer from the accepted nodes' slots to their path slots, in
        one gather and one scatter (all sources read before any is overwritten)."""
        cols = upload([list(c) for c in zip(*moves)], torch.long, self.device)
        src_b, src_o, dst_b, dst_o = (c for c in cols if c is not None)
        dev = self.store.device  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        dev[:, :, dst_b, dst_o] = dev[:, :, src_b, src_o]

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        """The request's own generator (seeded requests), made when first needed."""
        if request_id not in self.generators:
            self.generators[request_id] = make_generator(params, self.device)
        return self.generators[request_id]


def _ranks(tree: DraftTree, path: tuple[int, ...]) -> list[tuple[int, int | None]]:
    """(children, rank of the one taken or None) of every node the accepted walk reached:
    the root, then each accepted node (the last one's is None: the walk stopped there)."""
    out: list[tuple[int, int | None]] = []
    at = -1
    for node in (*path, None):
        kids = tree.children(at)
        out.append((len(kids), None if node is None else kids.index(node)))
        if node is not None:
            at = node
    return [(n, r) for n, r in out if n]


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
