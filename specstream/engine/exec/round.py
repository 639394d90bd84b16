"""One target forward pass of a step, top to bottom in the order things happen.

The scheduler decided *what* (which requests, which chunks, which drafts); this file decides
*when*; the history source and the backend decide *how bytes move*. Per layer: the new tokens'
q/k/v; their K/V into the resident tail; then the cold history as it lands, wave by wave (each
wave one attention call for every query position of every request in it; the drafter takes the
wait while a wave is still in flight, each landed wave's slot goes to the next copy); then the
resident tails, causally (a bucket with a token tree: the committed tails, then the new tokens
under the tree's mask); the partial results merge exactly (online softmax) and the rest of the
layer runs. Verification (``verify.py``) reads the returned hidden states.

A token tree's nodes take the KV slots after the root in node order, but their positions (RoPE)
are the root's plus their depth: siblings are alternatives for the same position.

Host attention (``SeqWork.host_blocks``): a layer's queries go to the host's workers right
after its projection, and their partials merge like any wave. A round with host work and two
query buckets or more runs them as two halves a layer apart: once a layer's waves and tails
are in, the device takes half 0's partials, finishes its layer and projects its next queries
(the host attends half 1's meanwhile), then does the same for half 1 (the host attends half
0's next layer meanwhile), so the host does not sit through the device's work between layers.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from specstream.attention.waves import WaveAttention
from specstream.backends.base import upload
from specstream.engine.contract import StepPlan
from specstream.engine.exec.drafting import Drafting
from specstream.engine.exec.history import HistorySource
from specstream.engine.exec.host_attention import HostAttention
from specstream.engine.exec.step_kv import StepKV
from specstream.kvcache.storage import KVStore
from specstream.models.decoder import CausalLM


@dataclass(frozen=True)
class RoundResult:
    """What the target forward of a step leaves for verification."""

    hidden: torch.Tensor  # [num_tokens, hidden] final (normed) hidden states
    rows: list[tuple[int, int]]  # each request's rows in them, in plan order
    failed: dict[str, str]  # requests whose history could not be restored -> message
    halves: int = 1  # the round ran in this many halves a layer apart


@torch.no_grad()
def run_round(
    model: CausalLM, plan: StepPlan, store: KVStore, history: HistorySource, link_bps: float,
    drafting: Drafting, attention: type[WaveAttention], host: HostAttention | None = None,
) -> RoundResult:
    """The step's target forward pass, layer by layer (see the module docstring)."""
    device = store.device.device
    ids = [t for s in plan.seqs for t in s.token_ids]
    pos = [p for s in plan.seqs for p in s.positions()]
    ids_t, pos_t = upload([ids, pos], torch.long, device)  # no stream sync on a GPU
    assert ids_t is not None and pos_t is not None
    x, rope = model.embed(ids_t, pos_t)
    hosted = host is not None and any(s.host_blocks for s in plan.seqs)
    kv = StepKV(plan, store, halves=hosted)
    scale, kv_heads = store.cfg.head_dim**-0.5, store.cfg.num_kv_heads
    on_host = _host_jobs(plan, kv, len(model.layers), device) if hosted else []
    halves = _Halves(kv, on_host, device)
    proj = _Projection(model, kv, halves, rope, on_host, host, scale)
    history.begin(plan, kv.groups, link_bps)  # the first waves of cold history in flight
    if host is not None and hosted:
        host.begin_round()  # the host's idle time between layers
    completed = False
    try:
        drafting.copies_issued()  # e.g. the other group's draft steps, enqueued on their stream
        for half in range(len(halves.buckets)):
            proj.project(0, half, x)
        for layer, block in enumerate(model.layers):
            p = proj.take(layer)
            kv.write(layer, p.k, p.v)  # the new tokens' K/V into their tail slots
            atts = [attention(qb, kv_heads, scale) for qb in p.qs]
            for wave in history.waves(layer):  # cold history, in the order it was issued
                if drafting.gap is not None:  # the other group drafts while it is in flight
                    drafting.gap(wave.done, history.link_busy_until)
                for bucket, hk, hv, shape in history.landed(wave):
                    atts[bucket].add(hk, hv, shape)  # every query position of every request
                history.release(wave)  # its staging slot takes the next copy
            for bucket, att in enumerate(atts):  # the resident tails, causally
                for tail in kv.tail(layer, bucket, p.k, p.v):
                    att.add(*tail)
            for bucket, _, _ in p.jobs:  # the device's partials merged while the host computes
                atts[bucket].fold()
            # half by half: the host's partials, the rest of the layer, the next layer's
            # queries (so the host attends one half while the device finishes the other)
            for half, buckets in enumerate(halves.buckets):
                for bucket, rows, job in p.jobs:
                    if bucket in buckets:
                        assert host is not None
                        out_h, lse_h = host.collect(job)
                        back = store.backend.to_device_async
                        atts[bucket].add_partial(back(out_h, device), back(lse_h, device),
                                                 rows)
                x = halves.finish(x, half, block, atts, kv)
                if layer + 1 < len(model.layers):
                    proj.project(layer + 1, half, x)
        completed = True
    finally:
        if host is not None and hosted:
            host.end_round()
        history.end(completed)
    return RoundResult(model.norm(x), kv.rows, dict(history.failed), len(halves.buckets))


class _Projection:
    """Each layer's q, k, v of the step's rows, half by half (a half's next layer is projected
    as soon as its current one is done), and its host jobs submitted at once."""

    def __init__(self, model: CausalLM, kv: StepKV, halves: _Halves,
                 rope: tuple[torch.Tensor, torch.Tensor],
                 on_host: list[list[tuple[int, torch.Tensor, Any]]],
                 host: HostAttention | None, scale: float) -> None:
        self.model, self.kv, self.halves, self.rope = model, kv, halves, rope
        self.on_host, self.host, self.scale = on_host, host, scale
        self.layers: dict[int, _Projected] = {}  # per layer, filled half by half

    def take(self, layer: int) -> _Projected:
        return self.layers.pop(layer)

    def project(self, layer: int, half: int, x: torch.Tensor) -> None:
        block, rows, kv = self.model.layers[layer], self.halves.rows[half], self.kv
        cos, sin = self.rope
        if rows is None:
            q, k, v = block.qkv(x, cos, sin)  # q [n, heads, D]; k, v [n, kv_heads, D]
            p = self.layers[layer] = _Projected(q, k, v, [q] * len(kv.buckets))
        else:
            part = block.qkv(x.index_select(0, rows), cos.index_select(0, rows),
                             sin.index_select(0, rows))
            if layer not in self.layers:
                q, k, v = (t.new_empty((x.shape[0], *t.shape[1:])) for t in part)
                self.layers[layer] = _Projected(q, k, v, [q] * len(kv.buckets))
            p = self.layers[layer]
            for full, t in zip((p.q, p.k, p.v), part, strict=True):
                full.index_copy_(0, rows, t)
        mine = self.halves.buckets[half]
        for b in mine:
            bucket = kv.buckets[b]
            p.qs[b] = p.q[bucket.q_index].view(len(bucket.members), bucket.num_q, *p.q.shape[1:])
        # the host's share first: it has had nothing to do since the last layer's partials
        if self.host is not None and self.on_host:
            p.jobs += [(b, r, self.host.submit(layer, p.qs[b].index_select(0, r), blocks,
                                               self.scale))
                       for b, r, blocks in self.on_host[layer] if b in mine]


@dataclass
class _Projected:
    """One layer's q, k, v of the step's token rows, its queries per bucket and host jobs."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qs: list[torch.Tensor]
    jobs: list[tuple[int, torch.Tensor, Future[tuple[torch.Tensor, torch.Tensor]]]] = field(
        default_factory=list)


class _Halves:
    """The step's buckets as one group, or, with host attention over two buckets or more, two
    groups a layer apart: the device finishes one half's layer and projects its next while the
    host attends the other half's. Each half: its buckets, its token rows (None: all rows)."""

    def __init__(self, kv: StepKV, on_host: list[list[tuple[int, torch.Tensor, Any]]],
                 device: torch.device) -> None:
        n = len(kv.buckets)
        self.buckets: list[list[int]] = [list(range(n))]
        self.rows: list[torch.Tensor | None] = [None]
        self.out: torch.Tensor | None = None
        if n < 2 or not any(on_host):
            return
        # balance the host's blocks (the first layer's) between the halves, buckets in order
        load = [0, 0]
        self.buckets = [[], []]
        for b in range(n):
            blocks = sum(len(x) for bucket, _, bl in on_host[0] if bucket == b for x in bl)
            half = 0 if load[0] <= load[1] else 1
            self.buckets[half].append(b)
            load[half] += blocks + 1
        rows = [sorted(r for b in bs for i in kv.buckets[b].members for r in range(*kv.rows[i]))
                for bs in self.buckets]
        self.rows = [torch.tensor(r, dtype=torch.long, device=device) for r in rows]
        # where each bucket's outputs start in the concatenation out_index reads
        self.base, total = [], 0
        for bucket in kv.buckets:
            self.base.append(total)
            total += len(bucket.members) * bucket.num_q
        self.total = total
        self.out_rows = [kv.out_index.index_select(0, r) for r in self.rows if r is not None]

    def finish(self, x: torch.Tensor, half: int, block: Any, atts: list[WaveAttention],
               kv: StepKV) -> torch.Tensor:
        """The rest of the layer for the half's rows: merged attention, projection, MLP."""
        rows = self.rows[half]
        if rows is None:
            outs = [att.result().flatten(0, 1) for att in atts]  # [W * P, heads, D]
            out = (outs[0] if len(outs) == 1 else torch.cat(outs))[kv.out_index]
            return block.finish(x, out)  # type: ignore[no-any-return]
        results = [(b, atts[b].result().flatten(0, 1)) for b in self.buckets[half]]
        if half == 0 or self.out is None:  # a new layer
            first = results[0][1]
            self.out = first.new_empty((self.total, *first.shape[1:]))
        for b, res in results:
            self.out[self.base[b] : self.base[b] + res.shape[0]] = res
        out = self.out.index_select(0, self.out_rows[half])
        return x.index_copy(0, rows, block.finish(x.index_select(0, rows), out))


def _host_jobs(plan: StepPlan, kv: StepKV, num_layers: int, device: torch.device
               ) -> list[list[tuple[int, torch.Tensor, list[tuple[int, ...]]]]]:
    """Host attention, per layer: (bucket, rows of its requests with blocks attended on the
    host in that layer, those blocks per row)."""
    rows: dict[tuple[int, ...], torch.Tensor] = {}
    out = []
    for layer in range(num_layers):
        jobs = []
        for bucket, b in enumerate(kv.buckets):
            work = [(w, plan.seqs[i].layer_host_blocks(layer)) for w, i in enumerate(b.members)]
            work = [(w, blocks) for w, blocks in work if blocks]
            if work:
                key = (bucket, *(w for w, _ in work))
                if key not in rows:
                    rows[key] = torch.tensor(key[1:], device=device)
                jobs.append((bucket, rows[key], [blocks for _, blocks in work]))
        out.append(jobs)
    return out
