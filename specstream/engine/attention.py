"""Where each request's tokens of one step live: the new tokens' tail slots, the resident tail
and its causal mask. Built once per step; the round (``engine/round.py``) reads it per layer."""

from __future__ import annotations

import torch

from specstream.attention import causal_mask
from specstream.engine.step import StepPlan
from specstream.kvcache.storage import KVStore


class StepKV:
    def __init__(self, plan: StepPlan, store: KVStore) -> None:
        self.store = store
        bs = store.block_size
        blocks, offsets = [], []
        # per request: its rows in the step's flattened tokens
        self.rows: list[tuple[int, int]] = []
        tails: list[tuple[torch.Tensor, int, int]] = []
        masks: list[torch.Tensor | None] = []
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
            tails.append((torch.tensor(b, dtype=torch.long), tail_len,
                          b[0] if consecutive and b else -1))
            masks.append(causal_mask(n, tail_len) if n > 1 else None)  # one query: no mask
            row += n
        device = store.device.device
        self.slot_blocks = torch.tensor(blocks, dtype=torch.long, device=device)
        self.slot_offsets = torch.tensor(offsets, dtype=torch.long, device=device)
        self.tails = [(b.to(device), n, first) for b, n, first in tails]
        self.masks = [m if m is None else m.to(device) for m in masks]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' K and V (``[num_tokens, num_kv_heads, head_dim]``) into their
        tail slots."""
        self.store.write(layer, self.slot_blocks, self.slot_offsets, k, v)

    def tail(self, layer: int, index: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """K, V and the causal mask of request ``index``'s resident tail (new tokens
        included)."""
        blocks, tail_len, first = self.tails[index]
        k, v = self.store.gather(layer, blocks, tail_len, first)
        return k, v, self.masks[index]
