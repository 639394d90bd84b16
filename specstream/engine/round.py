"""One target forward pass of a step, top to bottom in the order things happen.

The scheduler decided *what* (which requests, which chunks, which drafts); this file decides
*when*; the history source and the backend decide *how bytes move*. Per layer: the new tokens'
q/k/v; their K/V into the resident tail; then the cold history as it lands, wave by wave (each
wave one attention call for every query position of every request in it; the drafter takes the
wait while a wave is still in flight, each landed wave's slot goes to the next copy); then the
resident tails, causally (a bucket with a token tree: the committed tails, then the new tokens
under the tree's mask); the partial results merge exactly (online softmax) and the rest of the
layer runs. Verification (``worker.py``) reads the returned hidden states.

A token tree's nodes take the KV slots after the root in node order, but their positions (RoPE)
are the root's plus their depth: siblings are alternatives for the same position.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specstream.attention.waves import WaveAttention
from specstream.backends.base import upload
from specstream.engine.attention import StepKV
from specstream.engine.history import Gap, HistorySource
from specstream.engine.host_attention import HostAttention
from specstream.engine.step import StepPlan
from specstream.kvcache.storage import KVStore
from specstream.models.decoder import CausalLM


@torch.no_grad()
def run_round(
    model: CausalLM, plan: StepPlan, store: KVStore, history: HistorySource, gap: Gap | None,
    attention: type[WaveAttention], copies_issued: Callable[[], None] | None = None,
    host: HostAttention | None = None,
) -> tuple[torch.Tensor, list[tuple[int, int]], dict[str, str]]:
    """Returns the final hidden states ``[num_tokens, hidden]``, each request's rows in them,
    and the requests whose history could not be restored (request id -> message).
    ``copies_issued`` runs once the first copies are in flight (the drafter's cue on CUDA)."""
    device = store.device.device
    ids = [t for s in plan.seqs for t in s.token_ids]
    pos = [p for s in plan.seqs for p in s.positions()]
    ids_t, pos_t = upload([ids, pos], torch.long, device)  # no stream sync on a GPU
    assert ids_t is not None and pos_t is not None
    x, (cos, sin) = model.embed(ids_t, pos_t)
    kv = StepKV(plan, store)
    scale, kv_heads = store.cfg.head_dim**-0.5, store.cfg.num_kv_heads
    on_host = _host_jobs(plan, kv, len(model.layers), device) if host is not None else []
    history.begin(plan, kv.groups)  # the first waves of cold history are in flight from here
    timed = host if any(on_host) else None  # the host's idle time between layers
    if timed is not None:
        timed.begin_round()
    try:
        if copies_issued is not None:
            copies_issued()  # e.g. the other group's draft steps, enqueued on their stream
        for layer, block in enumerate(model.layers):
            q, k, v = block.qkv(x, cos, sin)  # q [n, heads, D]; k, v [n, kv_heads, D]
            qs = [q[b.q_index].view(len(b.members), b.num_q, *q.shape[1:]) for b in kv.buckets]
            # the host's share first: it has had nothing to do since the last layer's partials
            jobs = [(bucket, rows, host.submit(layer, qs[bucket].index_select(0, rows), blocks,
                                               scale))
                    for bucket, rows, blocks in on_host[layer]] if host is not None else []
            kv.write(layer, k, v)
            atts = [attention(qb, kv_heads, scale) for qb in qs]
            for bucket, hk, hv, shape in history.waves(layer, while_waiting=gap):
                atts[bucket].add(hk, hv, shape)
            for bucket, att in enumerate(atts):
                for wave in kv.tail(layer, bucket, k, v):
                    att.add(*wave)
            for bucket, _, _ in jobs:  # the device's partials merged while the host computes
                atts[bucket].fold()
            for bucket, rows, job in jobs:  # the host's share, merged like any wave
                assert host is not None
                out_h, lse_h = host.collect(job)
                atts[bucket].add_partial(out_h.to(device, non_blocking=True),
                                         lse_h.to(device, non_blocking=True), rows)
            outs = [att.result().flatten(0, 1) for att in atts]  # [W * P, heads, D]
            out = (outs[0] if len(outs) == 1 else torch.cat(outs))[kv.out_index]
            x = block.finish(x, out)
    finally:
        if timed is not None:
            timed.end_round()
        history.end()
    return model.norm(x), kv.rows, dict(history.failed)


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
