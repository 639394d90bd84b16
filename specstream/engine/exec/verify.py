"""Verification: the target's logits at every draft position, acceptance, and what it emitted.

Everything stays on the device until the round's one read-back (``logprobs.ReadBack``): the
accepted counts and tokens, any log-probabilities asked for. Chains are verified by
``accept_drafts_on_device``; a round where some request verifies a token tree accepts every
request's drafts with ``accept_tree_on_device`` (chains as trees of one branch). The accepted
path's nodes sit in the KV slots the round gave them (node i right after the root plus i);
after the read-back one copy over all layers moves them to the slots after the root in path
order, where the scheduler's commit keeps them (``compact``).
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from specstream.backends.base import upload
from specstream.engine.contract import SeqWork, StepOutput, StepPlan
from specstream.engine.exec.logprobs import ReadBack, RoundLogprobs, prompt_logprobs
from specstream.engine.exec.round import RoundResult
from specstream.kvcache.storage import KVStore
from specstream.models.decoder import CausalLM
from specstream.sampling import TokenContext, make_generator, process_logits
from specstream.sampling_params import SamplingParams
from specstream.spec.acceptance import accept_drafts_on_device
from specstream.spec.proposer import Proposer
from specstream.spec.token_tree import DraftTree
from specstream.spec.tree import accept_tree_on_device
from specstream.structured.matcher import mask_logits
from specstream.structured.rounds import GrammarRounds


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
    logprobs: RoundLogprobs | None = None  # SamplingParams.logprobs of those who asked
    # after the read-back: each request's accepted path (by index in seqs)
    paths: dict[int, tuple[int, ...]] = field(default_factory=dict)


class Verifier:
    """The target's side of speculation, keyed by request id: each request's generator and the
    draft distributions its pending drafts were sampled from."""

    def __init__(self, model: CausalLM, store: KVStore, proposer: Proposer | None,
                 stop_ids: Collection[int] = (), grammar: GrammarRounds | None = None) -> None:
        """``stop_ids``: the model's end-of-sequence ids (min_tokens masks them); ``grammar``:
        the matchers of constrained requests (None: no tokenizer, no constraints)."""
        self.model, self.store, self.proposer, self.grammar = model, store, proposer, grammar
        self.stop_ids = frozenset(stop_ids)
        self.device = store.device.device
        self.generators: dict[str, torch.Generator | None] = {}
        # [num_drafts, V] fp32 per request with pending sampled drafts (None: point masses)
        self.draft_probs: dict[str, torch.Tensor | None] = {}
        self.moved_slots = 0  # KV slots of accepted tree paths moved into place, since start

    def keep_draft_probs(self, request_id: str, probs: torch.Tensor | None) -> None:
        self.draft_probs[request_id] = probs

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.draft_probs.pop(request_id, None)
        if self.grammar is not None:
            self.grammar.release(request_id)

    def verify(self, plan: StepPlan, result: RoundResult, out: StepOutput,
               reads: ReadBack) -> None:
        """Prompt log-probabilities of prefill chunks that asked, and acceptance of every
        request that samples, all queued on ``reads``."""
        ok = [i for i, s in enumerate(plan.seqs) if s.request_id not in out.errors]
        for i in ok:
            s = plan.seqs[i]
            if s.prompt_targets:
                prompt_logprobs(self.model, s, result.rows[i][0], result.hidden, reads,
                                functools.partial(out.prompt_logprobs.__setitem__, s.request_id))
        # rows whose logits are needed: the last token and every draft of sampling requests
        sampled = [i for i in ok if plan.seqs[i].sample]
        if not sampled:
            return
        seqs = [plan.seqs[i] for i in sampled]
        rows = [result.rows[i] for i in sampled]
        verdict = (self._trees(seqs, rows, result.hidden) if any(s.is_tree for s in seqs)
                   else self._chains(seqs, rows, result.hidden))
        reads.add(verdict.packed, lambda v: self._apply(verdict, [int(x) for x in v], out))
        lp = verdict.logprobs
        if lp is not None:
            reads.add(lp.packed, lambda v: self._take_logprobs(verdict, lp, v, out))

    def _chains(self, seqs: list[SeqWork], rows: list[tuple[int, int]],
                hidden: torch.Tensor) -> _Verdict:  # hidden: [num_tokens, hidden]
        q = max(s.num_drafts for s in seqs)
        index, draft_ids = [], []
        for (_, hi), s in zip(rows, seqs):
            n = s.num_drafts + 1
            index += list(range(hi - n, hi)) + [hi - 1] * (q + 1 - n)  # padding: never read
            draft_ids += list(s.tree.tokens) + [0] * (q + 1 - n)
        index_t, drafts_t = upload([index, draft_ids], torch.long, self.device)
        assert index_t is not None and drafts_t is not None
        raw = self.model.compute_logits(hidden[index_t])  # [B * (q + 1), V], on the device
        # row j of a request as if its drafts 0..j-1 had been generated (padding rows: all)
        paths = [[s.tree.tokens[: min(j, s.num_drafts)] for j in range(q + 1)] for s in seqs]
        logits = self._process(raw, seqs, paths).view(len(seqs), q + 1, -1)
        drafts = drafts_t.view(len(seqs), q)
        probs = [self.draft_probs.get(s.request_id) if s.num_drafts else None for s in seqs]
        draft_probs = None
        if any(p is not None for p in probs):
            draft_probs = torch.zeros(len(seqs), q, logits.shape[-1], dtype=torch.float32,
                                      device=self.device)
            for b, (s, p) in enumerate(zip(seqs, probs)):
                if p is not None:
                    draft_probs[b, : s.num_drafts] = p[: s.num_drafts].float()
                elif s.num_drafts:  # point-mass drafts in a mixed batch
                    draft_probs[b].scatter_(1, drafts[b].view(-1, 1), 1.0)
        num_accepted, tokens = accept_drafts_on_device(
            logits, drafts, [s.num_drafts for s in seqs], draft_probs, [s.params for s in seqs],
            [self._generator(s.request_id, s.params) for s in seqs])
        extra = tokens.gather(1, num_accepted[:, None]).squeeze(1)  # at row num_accepted
        lp = RoundLogprobs.take(raw, seqs, [b * (q + 1) for b in range(len(seqs))],
                                [list(range(s.num_drafts)) for s in seqs],  # draft j: row j
                                [list(s.tree.tokens) for s in seqs], num_accepted, extra,
                                rows_per_request=q + 1)
        return _Verdict(seqs, torch.cat([num_accepted[:, None], tokens], dim=1).flatten(),
                        logprobs=lp)

    def _trees(self, seqs: list[SeqWork], rows: list[tuple[int, int]],
               hidden: torch.Tensor) -> _Verdict:
        """Every input row of a request is a logits row ([root, node 0, ...], as
        ``accept_tree`` packs them)."""
        index: list[int] = []
        trees = [s.tree for s in seqs]
        for (_, hi), s in zip(rows, seqs):
            index += range(hi - s.num_drafts - 1, hi)
        probs = [self._tree_probs(s, t) for s, t in zip(seqs, trees)]
        index_t = upload([index], torch.long, self.device)[0]
        assert index_t is not None
        raw = self.model.compute_logits(hidden[index_t])  # [sum_b (N_b + 1), V]
        # row 1 + i of a request as if the nodes from the root to node i had been generated
        paths = [[(), *(tuple(t.tokens[j] for j in t.path(i)) for i in range(len(t)))]
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
        lp = RoundLogprobs.take(raw, seqs, offsets, [[p + 1 for p in t.parents] for t in trees],
                                [list(t.tokens) for t in trees], last + 1, extra)
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
        logits = process_logits(raw, [s.params for s in seqs], contexts, paths, self.stop_ids)
        if self.grammar is None or all(s.params.structured is None for s in seqs):
            return logits
        masks = []  # every row of a constrained request masked by its grammar there
        for s, ctx, rows in zip(seqs, contexts, paths):
            if s.params.structured is None:
                masks.append(torch.ones(len(rows), logits.shape[-1], dtype=torch.bool))
            else:
                masks.append(self.grammar.masks(s.request_id, s.params.structured,
                                                ctx.output, rows))
        return mask_logits(logits, torch.cat(masks))

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
                path = verdict.paths[b] = tree.path(r[0])
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
            self.compact(moves)

    def _take_logprobs(self, verdict: _Verdict, lp: RoundLogprobs, values: list[float],
                       out: StepOutput) -> None:
        """The emitted tokens' entries: the nodes of each accepted path, then the extra
        token, with the most likely tokens of the rows that predicted them."""
        node_at = 0
        for j, b in enumerate(lp.seqs):
            rid = verdict.seqs[b].request_id
            toks = out.new_tokens.get(rid)
            if toks is not None:
                if verdict.trees is None:  # a chain: drafts 0..n-1, the extra at row n
                    path: tuple[int, ...] = tuple(range(len(toks) - 1))
                    extra_row = len(path)
                else:
                    path = verdict.paths[b]
                    extra_row = path[-1] + 1 if path else 0
                out.logprobs[rid] = lp.entries(values, j, node_at, toks, path, extra_row)
            node_at += len(lp.node_rows[j])

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

    def compact(self, moves: list[tuple[int, int, int, int]]) -> None:
        """Copy the K/V of every layer from the accepted nodes' slots to their path slots, in
        one gather and one scatter (all sources read before any is overwritten)."""
        cols = upload([list(c) for c in zip(*moves)], torch.long, self.device)
        src_b, src_o, dst_b, dst_o = (c for c in cols if c is not None)
        dev = self.store.device  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        dev[:, :, dst_b, dst_o] = dev[:, :, src_b, src_o]
        self.moved_slots += len(moves)

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

