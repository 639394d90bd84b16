"""How much of a round's cold history the host attends (``host_attention="auto"``).

Two paths read a round's cold history at once: the link streams its share to the device, and
the host's workers attend the rest where it lives. The round takes the longer of the two:

    link:  (cold bytes - host bytes) / link rate
    host:  serial + sum over requests of host bytes x seconds per byte (query positions)

``serial`` is the device time of the round during which the host can have nothing to do (a
layer's queries come only after its projection; the layer's MLP waits for the host's
partials), and the host's time per byte grows with a request's query positions (a decode
round's few positions read memory; a prefill chunk's or a large tree's compute). The best
split makes both paths finish together; the host takes the cheapest bytes first (the requests
with the fewest query positions). Pure Python: the scheduler calls ``split_for_host`` for
every step, the round-shape cost model ``policy.round_shape.transfer_s`` for every candidate
shape, so the tree size and the split are chosen together.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from specstream.config import EngineConfig
from specstream.engine.contract import SeqWork
from specstream.engine.policy.feedback import Estimates

# host_attention "auto": the host's share of each request's cold blocks until the link and
# the host have both been measured
UNMEASURED_HOST_SHARE = 0.25


def split_for_host(blocks: Sequence[int], seconds_per_byte: Sequence[float], block_bytes: int,
                   link_bps: float, serial_s: float) -> list[float]:
    """Per request, how many of its ``blocks`` cold blocks the host attends (the oldest; a
    fraction of a block: the layers take whole blocks in turn, ``by_layer``), so that the
    link and the host finish together. ``seconds_per_byte``: the host's cost for each
    request's query positions."""
    counts = [0.0] * len(blocks)
    link_s = sum(blocks) * block_bytes / link_bps
    host_s = serial_s
    for i in sorted(range(len(blocks)), key=lambda i: seconds_per_byte[i]):
        # moving one block to the host: the host takes its time, the link saves its own
        per_block = block_bytes * (seconds_per_byte[i] + 1 / link_bps)
        k = min(blocks[i], max(0.0, (link_s - host_s) / per_block))
        counts[i] = k
        link_s -= k * block_bytes / link_bps
        host_s += k * block_bytes * seconds_per_byte[i]
        if k < blocks[i]:
            break
    return counts


def by_layer(blocks: float, num_layers: int) -> tuple[int, ...]:
    """Whole blocks per layer that add up to ``blocks`` x ``num_layers`` (rounded): a share
    between two block counts alternates between them from layer to layer."""
    return tuple(round((layer + 1) * blocks) - round(layer * blocks)
                 for layer in range(num_layers))


class HostSplitter(Protocol):
    """How many of each request's cold blocks the host attends in a step, and per layer: the
    scheduler's public seam for the split (``MeasuredSplit`` by default; tests and ablations
    give their own)."""

    def counts(self, seqs: Sequence[SeqWork], blocks: Sequence[int],
               est: Estimates) -> list[float]:
        """Per request, the host's share of its ``blocks`` cold blocks (fractions: layers
        take whole blocks in turn)."""
        ...

    def by_layer(self, blocks: float, num_layers: int) -> tuple[int, ...]:
        """That share as whole blocks per layer."""
        ...


class MeasuredSplit:
    """The configured split: a fixed ``host_attention_fraction`` of every request's cold
    blocks, or under ``host_attention="auto"`` the split that lets the link and the host
    finish together from their measured rates (a quarter of each until both are measured);
    none where the step's requests were last verified in a compute-bound round."""

    def __init__(self, config: EngineConfig, block_bytes: int) -> None:
        self.fraction = config.host_attention_fraction
        self.block_bytes = block_bytes

    def counts(self, seqs: Sequence[SeqWork], blocks: Sequence[int],
               est: Estimates) -> list[float]:
        if self.fraction is not None:
            return [self.fraction * n for n in blocks]
        # compute-bound: moving history off the link buys nothing
        if not est.host_pays_for(s.request_id for s in seqs):
            return [0.0] * len(blocks)
        host = est.host
        cost = [host.per_byte(len(s.token_ids)) if host is not None else 0.0 for s in seqs]
        if not (est.link_bps and all(cost) and self.block_bytes):
            return [UNMEASURED_HOST_SHARE * n for n in blocks]
        assert host is not None
        return split_for_host(blocks, cost, self.block_bytes, est.link_bps, host.serial_s)

    def by_layer(self, blocks: float, num_layers: int) -> tuple[int, ...]:
        return by_layer(blocks, num_layers)


def split_steps(seqs: list[SeqWork], splitter: HostSplitter, est: Estimates, num_layers: int,
                per_chunk: int) -> tuple[list[SeqWork], float | None]:
    """Each request's cold blocks: the oldest ones the splitter gives the host
    (``host_blocks``, per layer ``host_layers``), the rest over the link
    (``restore_chunks``, re-cut into chunks of ``per_chunk`` blocks); and the host's share of
    the step's cold blocks (None: the step has none).

    A run of blocks that several of the step's requests start with (a shared prefix: their
    leading restore chunks, the same blocks) is one request to the splitter, with all its
    sharers' query positions: the link carries it once for all of them, and the host attends
    it once with all their queries (``host_kernel``). The host's part of it is whole blocks,
    the same in every layer and for every sharer; the rest of it stays in the same chunks
    for all of them."""
    cold = [[b for c in s.restore_chunks for b in c] for s in seqs]
    total = sum(map(len, cold))
    if not total:
        return seqs, None
    readers = Counter(b for c in cold for b in c)
    lead = [_shared_lead(s.restore_chunks, readers) for s in seqs]
    # sharers by their first chunk; the run the group shares is their common leading chunks
    # (a sharer's last shared chunk may be shorter than the others')
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (s, k) in enumerate(zip(seqs, lead, strict=True)):
        if k:
            groups.setdefault(s.restore_chunks[0], []).append(i)
    runs = [_common([seqs[i].restore_chunks[: lead[i]] for i in ids]) for ids in groups.values()]
    own = [blocks[sum(map(len, s.restore_chunks[:k])) :]
           for s, blocks, k in zip(seqs, cold, lead, strict=True)]
    group = [replace(seqs[ids[0]], token_ids=tuple(t for i in ids for t in seqs[i].token_ids))
             for ids in groups.values()]
    counts = splitter.counts(seqs + group, [len(o) for o in own]
                             + [sum(map(len, run)) for run in runs], est)
    # whole blocks of each run to the host, the same for all its sharers
    taken: dict[int, int] = {}  # request -> leading blocks of its run the host attends
    for ids, run, x in zip(groups.values(), runs, counts[len(seqs) :], strict=True):
        taken.update(dict.fromkeys(ids, min(int(x), sum(map(len, run)))))
    out = []
    for i, (s, blocks, k, x) in enumerate(zip(seqs, own, lead, counts[: len(seqs)],
                                              strict=True)):
        m = taken.get(i, 0)  # blocks of the shared run on the host, every layer
        hosted, left = _drop(s.restore_chunks[:k], m)
        n_by_layer = splitter.by_layer(x, num_layers)
        n = max(n_by_layer)
        if n or m:
            s = replace(s, host_blocks=hosted + tuple(blocks[:n]),
                        host_layers=(tuple(m + c for c in n_by_layer)
                                     if min(n_by_layer) < n else ()),
                        restore_chunks=left + _chunks(blocks[n:], per_chunk),
                        shared_chunks=len(left))
        elif k:
            s = replace(s, shared_chunks=k)
        out.append(s)
    return out, (sum(counts[: len(seqs)]) + sum(taken.values())) / total


def _drop(chunks: tuple[tuple[int, ...], ...], m: int
          ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The first ``m`` blocks of ``chunks``, and the chunks of the rest as they were cut (the
    chunk holding block ``m`` keeps its tail): a sharer's remaining chunks are the same blocks
    as every other sharer's, or start them."""
    head: list[int] = []
    for c, chunk in enumerate(chunks):
        if len(head) + len(chunk) > m:
            cut = m - len(head)
            return (tuple(head) + chunk[:cut],
                    ((chunk[cut:],) if cut < len(chunk) else ()) + chunks[c + 1 :])
        head += chunk
    return tuple(head), ()


def _common(leads: list[tuple[tuple[int, ...], ...]]) -> tuple[tuple[int, ...], ...]:
    """The leading chunks every one of ``leads`` has."""
    n = 0
    while all(len(lead) > n and lead[n] == leads[0][n] for lead in leads):
        n += 1
    return leads[0][:n]


def _chunks(blocks: Sequence[int], per_chunk: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(blocks[i : i + per_chunk]) for i in range(0, len(blocks), per_chunk))


def _shared_lead(chunks: tuple[tuple[int, ...], ...], readers: Counter[int]) -> int:
    """The leading chunks whose every block another request of the step reads too."""
    k = 0
    while k < len(chunks) and all(readers[b] > 1 for b in chunks[k]):
        k += 1
    return k
