"""Where each request's tokens of one step live, and how the round batches their attention.

Built once per step; the round (``engine/round.py``) reads it per layer. Requests are grouped
into query *buckets*: every decode (a few positions each) in one bucket, padded to the most
positions among them; each longer prefill chunk alone (padding a decode to a 1,000-token chunk
would cost more than a launch). A bucket's queries are gathered into ``[W, P, H, D]`` with one
index, its resident tails into ``[W, T, kv, D]`` with one more, and its outputs go back to the
step's token rows with a third.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specstream.attention.waves import WaveShape
from specstream.backends.base import to_device
from specstream.engine.step import StepPlan
from specstream.kvcache.storage import KVStore

# Requests with at most this many positions in a step share one bucket.
DECODE_POSITIONS = 32


@dataclass
class Bucket:
    members: list[int]  # indices into plan.seqs
    num_q: int  # positions per request, padded
    q_index: torch.Tensor  # [W * P] token row of each padded position
    tail_blocks: torch.Tensor  # [W * TB] device blocks of the tails, padded per request
    tail_first: int  # >= 0: one request whose tail blocks are consecutive from here (a view)
    tail_tokens: int  # TB * block_size
    tail_shape: WaveShape  # key lengths = tail lengths; causal offset = tail length - positions


def buckets_of(num_tokens: list[int]) -> list[list[int]]:
    """Indices grouped into query buckets (see the module docstring)."""
    small = [i for i, n in enumerate(num_tokens) if n <= DECODE_POSITIONS]
    large = [[i] for i, n in enumerate(num_tokens) if n > DECODE_POSITIONS]
    return ([small] if small else []) + large


class StepKV:
    def __init__(self, plan: StepPlan, store: KVStore) -> None:
        self.store = store
        bs = store.block_size
        device = store.device.device
        blocks, offsets = [], []
        # per request: its rows in the step's flattened tokens
        self.rows: list[tuple[int, int]] = []
        row = 0
        for s in plan.seqs:
            n = len(s.token_ids)
            for t in range(s.start_pos, s.start_pos + n):
                rel = t - s.host_tokens
                blocks.append(s.device_blocks[rel // bs])
                offsets.append(rel % bs)
            self.rows.append((row, row + n))
            row += n
        self.slot_blocks = to_device(blocks, torch.long, device)
        self.slot_offsets = to_device(offsets, torch.long, device)
        self.buckets: list[Bucket] = []
        out_index = [0] * row
        base = 0
        for members in buckets_of([len(s.token_ids) for s in plan.seqs]):
            seqs = [plan.seqs[i] for i in members]
            p = max(len(s.token_ids) for s in seqs)
            q_index, tail_blocks, tail_len, offset = [], [], [], []
            # the blocks that hold tokens (a resident request reserved its whole length at
            # admission: attending the empty rest would only cost time)
            n_tails = [s.start_pos + len(s.token_ids) - s.host_tokens for s in seqs]
            used = [s.device_blocks[: -(-n // bs)] for s, n in zip(seqs, n_tails)]
            tb = max(len(b) for b in used)
            for w, (i, s) in enumerate(zip(members, seqs)):
                lo, hi = self.rows[i]
                q_index += [min(lo + t, hi - 1) for t in range(p)]  # pad: repeat the last
                for t in range(hi - lo):
                    out_index[lo + t] = base + w * p + t
                b = list(used[w])
                tail_blocks += b + [b[0]] * (tb - len(b))
                tail_len.append(n_tails[w])
                offset.append(n_tails[w] - len(s.token_ids))
            base += len(members) * p
            only = used[0] if len(seqs) == 1 else ()
            consecutive = bool(only) and all(only[j + 1] == only[j] + 1
                                             for j in range(len(only) - 1))
            self.buckets.append(Bucket(
                members, p, to_device(q_index, torch.long, device),
                to_device(tail_blocks, torch.long, device),
                only[0] if consecutive else -1, tb * bs,
                WaveShape.build(None, tail_len, tb * bs, offset, device)))
        self.out_index = to_device(out_index, torch.long, device)

    @property
    def groups(self) -> list[list[int]]:
        """The buckets' requests (indices into ``plan.seqs``)."""
        return [b.members for b in self.buckets]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' K and V (``[num_tokens, num_kv_heads, head_dim]``) into their
        tail slots."""
        self.store.write(layer, self.slot_blocks, self.slot_offsets, k, v)

    def tail(self, layer: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor, WaveShape]:
        """K and V ``[W, T, num_kv_heads, head_dim]`` of the bucket's resident tails (new tokens
        included, padded to T) and their shape (causal among the new tokens)."""
        b, cfg = self.buckets[bucket], self.store.cfg
        if b.tail_first >= 0:
            x = self.store.device[layer, :, b.tail_first : b.tail_first + b.tail_blocks.numel()]
        else:
            x = self.store.device[layer].index_select(1, b.tail_blocks)  # [2, W*TB, bs, kv, D]
        x = x.reshape(2, len(b.members), b.tail_tokens, cfg.num_kv_heads, cfg.head_dim)
        return x[0], x[1], b.tail_shape
