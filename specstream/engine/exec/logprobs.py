"""``SamplingParams.logprobs`` and ``prompt_logprobs``: the target's raw log-softmax (vLLM's
default ``logprobs_mode``), taken from the verification logits and left on the device until the
round's one read-back (``ReadBack``), so asking for them costs no sync of its own.

What a verification emits is known only after the read-back, so every node's (draft's)
log-probability at the row that predicts it and the extra token's at its row are taken, with
each row's most likely tokens; the read-back then keeps those on the accepted path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specstream.backends.base import sync_point, upload
from specstream.engine.contract import SeqWork, TokenLogprobs
from specstream.models.decoder import CausalLM

PROMPT_LOGITS_ROWS = 512  # prompt_logprobs: logits rows computed at once (memory: rows x V)


@dataclass
class ReadBack:
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


@dataclass
class RoundLogprobs:
    """Raw log-probabilities of some requests' rows of a verification, on the device. Rows
    are numbered within these requests only."""

    seqs: list[int]  # their index among the verified requests
    row_off: list[int]  # per request, its first row (the root's)
    node_rows: list[list[int]]  # per request, per node: the row (from row_off) predicting it
    k: int  # most likely tokens per row
    # [N], [N], [B'], [B'], [R' * k], [R' * k]: node logprobs and ranks, the extra token's
    # logprob and rank, the top-k logprobs and token ids of every row
    packed: torch.Tensor
    num_nodes: int
    num_rows: int

    @classmethod
    def take(
        cls,
        raw: torch.Tensor,  # [R, V] the verification's raw logits, every request's rows
        seqs: Sequence[SeqWork],
        row_off: list[int],  # per request, its first row in raw
        node_rows: list[list[int]],  # per request, per node: the row predicting it
        node_tokens: list[list[int]],
        extra_row: torch.Tensor,  # [B] device: the row (from row_off) of the extra token
        extra: torch.Tensor,  # [B] device: the extra token
        rows_per_request: int = 0,  # chains: q + 1 rows each; 0: nodes + 1 (trees)
    ) -> RoundLogprobs | None:
        """The requests that asked for logprobs' rows, left on the device (None: nobody)."""
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
            size = rows_per_request or len(node_tokens[b]) + 1
            offs.append(len(rows))
            rows += range(row_off[b], row_off[b] + size)
            n_rows += [offs[-1] + r for r in node_rows[b]]
            n_tok += node_tokens[b]
            sub_nodes.append(node_rows[b])
        rows_t, n_rows_t, n_tok_t, offs_t, want_t = upload(
            [rows, n_rows, n_tok, offs, want], torch.long, raw.device)
        assert rows_t is not None and offs_t is not None and want_t is not None
        lp = torch.log_softmax(raw.index_select(0, rows_t).float(), dim=-1)  # [R', V]
        e_rows = offs_t + extra_row.index_select(0, want_t)
        e_lp = lp[e_rows, extra.index_select(0, want_t)]
        parts = []
        if n_tok:
            assert n_rows_t is not None and n_tok_t is not None
            node_lp = lp[n_rows_t, n_tok_t]
            parts += [node_lp, (lp[n_rows_t] > node_lp[:, None]).sum(-1) + 1]
        parts += [e_lp, (lp[e_rows] > e_lp[:, None]).sum(-1) + 1]
        if k:
            top, top_ids = lp.topk(k, dim=-1)
            parts += [top.flatten(), top_ids.flatten()]
        packed = torch.cat([p.double() for p in parts])
        return cls(want, offs, sub_nodes, k, packed, len(n_tok), len(rows))

    def entries(self, values: list[float], j: int, node_at: int, tokens: list[int],
                path: Sequence[int], extra_row: int) -> list[TokenLogprobs]:
        """Request ``j``'s entries from the read-back ``values``: the accepted ``path``'s
        nodes, then the extra token (predicted by ``extra_row``); ``tokens`` what it emitted,
        ``node_at`` where its nodes start."""
        n, b = self.num_nodes, len(self.seqs)
        top_at = 2 * n + 2 * b
        k, width = self.k, self.num_rows * self.k

        def top(row: int) -> tuple[tuple[int, float], ...]:
            at = top_at + row * k
            return tuple((int(t), v) for t, v in zip(values[at + width : at + width + k],
                                                     values[at : at + k]))

        out: list[TokenLogprobs] = []
        for i in path:
            at = node_at + i
            out.append(TokenLogprobs(tokens[len(out)], values[at], int(values[n + at]),
                                     top(self.row_off[j] + self.node_rows[j][i])))
        out.append(TokenLogprobs(tokens[-1], values[2 * n + j], int(values[2 * n + b + j]),
                                 top(self.row_off[j] + extra_row)))
        return out


def prompt_logprobs(model: CausalLM, s: SeqWork, lo: int, hidden: torch.Tensor,
                    reads: ReadBack, done: Callable[[list[TokenLogprobs]], None]) -> None:
    """A prefill chunk's prompt log-probabilities: input i (row ``lo + i`` of ``hidden``)
    predicts ``s.prompt_targets[i]``; computed in slices of logits rows, read back with the
    round (``done`` takes them)."""
    targets = list(s.prompt_targets)
    k = min(s.params.prompt_logprobs or 0, model.config.vocab_size)
    parts = []
    for a in range(0, len(targets), PROMPT_LOGITS_ROWS):
        b = min(len(targets), a + PROMPT_LOGITS_ROWS)
        lp = torch.log_softmax(model.compute_logits(hidden[lo + a : lo + b]).float(), dim=-1)
        tgt = upload([targets[a:b]], torch.long, hidden.device)[0]
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
        done(entries)

    reads.add(torch.cat(parts), take)
