"""Where each request's tokens of one step live, and how the round batches their attention.

Built once per step; the round (``engine/round.py``) reads it per layer. Requests are grouped
into query *buckets*: every decode (a few positions each) in one bucket, padded to the most
positions among them; each longer prefill chunk alone (padding a decode to a 1,000-token chunk
would cost more than a launch). A bucket's queries are gathered into ``[W, P, H, D]`` with one
index, its resident tails into ``[W, T, kv, D]`` with one more, and its outputs go back to the
step's token rows with a third.

The tail (the request's device window, new tokens included) is one wave, causal among the new
tokens, unless a request of the bucket verifies a token tree: then it is two, the committed part
of the window (every query sees all of it) and the new tokens under an explicit mask (a tree
node sees its ancestors and itself, a chain's or a prefill chunk's token the tokens before it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specstream.attention.buckets import DECODE_POSITIONS, buckets_of
from specstream.attention.waves import WaveShape
from specstream.backends.base import to_device
from specstream.engine.contract import SeqWork, StepPlan
from specstream.kvcache.storage import KVStore
from specstream.spec.token_tree import DraftTree
from specstream.spec.tree import tree_mask


@dataclass
class Bucket:
    members: list[int]  # indices into plan.seqs
    num_q: int  # positions per request, padded
    q_index: torch.Tensor  # [W * P] token row of each padded position
    tail_blocks: torch.Tensor  # [W * TB] device blocks of the tails, padded per request
    tail_first: int  # >= 0: one request whose tail blocks are consecutive from here (a view)
    tail_tokens: int  # TB * block_size
    # key lengths = tail lengths; causal offset = tail length - positions. Tree buckets: the
    # committed part of the tails (key lengths = tail length - positions, no offset) of the
    # requests that have one (None: none has)
    tail_shape: WaveShape | None
    # tree buckets: the new tokens as keys ([W, P], the queries' own rows) and their mask
    new_shape: WaveShape | None = None


Wave = tuple[torch.Tensor, torch.Tensor, WaveShape]  # k, v [W, N, num_kv_heads, head_dim]


def new_token_mask(seqs: list[SeqWork], num_q: int) -> torch.Tensor:  # [W, P, P] bool, host
    """Which new tokens of each request each of its query positions sees: a tree's nodes their
    ancestors and themselves (``spec.tree.tree_mask``), everyone else's tokens the ones before
    them; a padding position its own (padding) column, so no row is empty."""
    mask = torch.zeros(len(seqs), num_q, num_q, dtype=torch.bool)
    causal = torch.ones(num_q, num_q, dtype=torch.bool).tril_()
    for w, s in enumerate(seqs):
        n = len(s.token_ids)
        if s.is_tree:
            nodes = s.token_ids[n - s.num_drafts :]
            # the inputs before the root (none in a decode round) are a causal prefix
            m = causal[:n, :n].clone()
            m[n - s.num_drafts - 1 :, n - s.num_drafts - 1 :] = tree_mask(
                DraftTree(nodes, s.parents))
            mask[w, :n, :n] = m
        else:
            mask[w, :n, :n] = causal[:n, :n]
        mask[w, n:].diagonal(offset=n).fill_(True)
    return mask


class StepKV:
    def __init__(self, plan: StepPlan, store: KVStore, halves: bool = False) -> None:
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
        # every decode round shares a bucket (a token tree may have more positions than
        # DECODE_POSITIONS)
        limit = max([DECODE_POSITIONS] + [len(s.token_ids) for s in plan.seqs if s.num_drafts])
        for members in buckets_of([len(s.token_ids) for s in plan.seqs], limit, halves):
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
            if any(s.is_tree for s in seqs):
                # committed keys: every query sees them all (a request with none sits out: a
                # row that sees no key of a wave must not be in it)
                having = [w for w, n in enumerate(offset) if n > 0]
                tail_shape = None if not having else WaveShape.build(
                    None if len(having) == len(seqs) else having,
                    [offset[w] for w in having], tb * bs, None, device)
                mask = store.backend.to_device_async(new_token_mask(seqs, p), device)
                new_shape = WaveShape.build(None, [p] * len(seqs), p, None, device, tree=mask)
            else:
                tail_shape = WaveShape.build(None, tail_len, tb * bs, offset, device)
                new_shape = None
            self.buckets.append(Bucket(
                members, p, to_device(q_index, torch.long, device),
                to_device(tail_blocks, torch.long, device),
                only[0] if consecutive else -1, tb * bs, tail_shape, new_shape))
        self.out_index = to_device(out_index, torch.long, device)

    @property
    def groups(self) -> list[list[int]]:
        """The buckets' requests (indices into ``plan.seqs``)."""
        return [b.members for b in self.buckets]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' K and V (``[num_tokens, num_kv_heads, head_dim]``) into their
        tail slots."""
        self.store.write(layer, self.slot_blocks, self.slot_offsets, k, v)

    def tail(self, layer: int, bucket: int, k: torch.Tensor, v: torch.Tensor) -> Iterator[Wave]:
        """The bucket's resident tails as waves: K and V ``[W, T, num_kv_heads, head_dim]``
        (new tokens included, padded to T) causal among the new tokens; or, in a bucket with a
        token tree, the committed part of the tails, then the new tokens (``k``, ``v``: this
        layer's, ``[num_tokens, num_kv_heads, head_dim]``) under their mask."""
        b, cfg = self.buckets[bucket], self.store.cfg
        if b.tail_shape is not None:
            if b.tail_first >= 0:
                x = self.store.device[layer, :, b.tail_first : b.tail_first + b.tail_blocks.numel()]
            else:
                x = self.store.device[layer].index_select(1, b.tail_blocks)  # [2, W*TB, bs, kv, D]
            x = x.reshape(2, len(b.members), b.tail_tokens, cfg.num_kv_heads, cfg.head_dim)
            if b.tail_shape.index is not None:  # some requests have no committed keys
                x = x.index_select(1, b.tail_shape.index)
            yield x[0], x[1], b.tail_shape
        if b.new_shape is not None:
            w, p = len(b.members), b.num_q
            yield (k[b.q_index].view(w, p, *k.shape[1:]), v[b.q_index].view(w, p, *v.shape[1:]),
                   b.new_shape)
