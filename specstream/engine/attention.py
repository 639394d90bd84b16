"""The attention context of one target forward pass: KV writes plus tiered, exact attention.

For each request the queries of the step attend over (host history pieces, from the step's
history source) + (resident tail and the new tokens, causal among themselves); partial results
merge through online softmax, so the output equals full attention whatever the split.
"""

from __future__ import annotations

import torch

from specstream.attention import ChunkedAttention, causal_mask
from specstream.backends.base import TransferError
from specstream.engine.history import HistorySource
from specstream.engine.scheduler import StepPlan
from specstream.kvcache.storage import KVStore


class StepAttention:
    """Implements the model's ``AttentionContext`` for one step."""

    def __init__(self, plan: StepPlan, store: KVStore, history: HistorySource) -> None:
        self.plan, self.store, self.history = plan, store, history
        self.scale = store.cfg.head_dim**-0.5
        bs = store.block_size
        blocks, offsets, self.rows, self.tails = [], [], [], []
        self.masks: list[torch.Tensor | None] = []
        row = 0
        for s in plan.seqs:
            n = len(s.token_ids)
            for t in range(s.start_pos, s.start_pos + n):
                rel = t - s.host_tokens
                blocks.append(s.device_blocks[rel // bs])
                offsets.append(rel % bs)
            self.rows.append((row, row + n))
            b = s.device_blocks
            consecutive = all(b[j + 1] == b[j] + 1 for j in range(len(b) - 1))
            tail_len = s.start_pos + n - s.host_tokens
            self.tails.append((torch.tensor(b, dtype=torch.long), tail_len,
                               b[0] if consecutive and b else -1))
            self.masks.append(causal_mask(n, tail_len) if n > 1 else None)  # one query: no mask
            row += n
        device = store.device.device
        self.slot_blocks = torch.tensor(blocks, dtype=torch.long, device=device)
        self.slot_offsets = torch.tensor(offsets, dtype=torch.long, device=device)
        self.tails = [(b.to(device), n, first) for b, n, first in self.tails]
        self.masks = [m if m is None else m.to(device) for m in self.masks]
        self.num_kv_heads = store.cfg.num_kv_heads
        self.failed: dict[str, str] = {}

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> torch.Tensor:
        self.store.write(layer, self.slot_blocks, self.slot_offsets, k, v)
        out = torch.empty_like(q)
        for i, seq in enumerate(self.plan.seqs):
            lo, hi = self.rows[i]
            att = ChunkedAttention(q[lo:hi], self.num_kv_heads, self.scale)
            try:
                for hk, hv in self.history.pieces(layer, i):
                    att.add(hk, hv)
            except TransferError as exc:
                self.failed.setdefault(seq.request_id, f"KV restore failed: {exc}")
            if seq.request_id in self.failed:
                out[lo:hi] = 0
                continue
            blocks, tail_len, first = self.tails[i]
            tk, tv = self.store.gather(layer, blocks, tail_len, first)
            att.add(tk, tv, self.masks[i])
            out[lo:hi] = att.result(q.dtype)
        return out
