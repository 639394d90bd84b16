"""One target forward pass of a step, top to bottom in the order things happen.

The scheduler decided *what* (which requests, which chunks, which drafts); this file decides
*when*; the history source and the backend decide *how bytes move*. Per layer: the new tokens'
q/k/v; their K/V into the resident tail; then every request's queries attend its cold history
piece by piece as the pieces land (online softmax, so the result is exact whatever the split),
each landed piece freeing its staging buffer for the next copy, and the drafter taking the wait
while a piece is still in flight; then the tail and the new tokens, causally; then the rest of
the layer. Verification (``worker.py``) reads the returned hidden states.
"""

from __future__ import annotations

import torch

from specstream.attention import ChunkedAttention
from specstream.backends.base import TransferError
from specstream.engine.attention import StepKV
from specstream.engine.history import Gap, HistorySource
from specstream.engine.step import StepPlan
from specstream.kvcache.storage import KVStore
from specstream.models.decoder import CausalLM


@torch.no_grad()
def run_round(
    model: CausalLM, plan: StepPlan, store: KVStore, history: HistorySource, gap: Gap | None,
) -> tuple[torch.Tensor, list[tuple[int, int]], dict[str, str]]:
    """Returns the final hidden states ``[num_tokens, hidden]``, each request's rows in them,
    and the requests whose history could not be restored (request id -> message)."""
    device = store.device.device
    ids = [t for s in plan.seqs for t in s.token_ids]
    pos = [p for s in plan.seqs for p in range(s.start_pos, s.start_pos + len(s.token_ids))]
    x, (cos, sin) = model.embed(torch.tensor(ids, dtype=torch.long, device=device),
                                torch.tensor(pos, dtype=torch.long, device=device))
    kv = StepKV(plan, store)
    scale, kv_heads = store.cfg.head_dim**-0.5, store.cfg.num_kv_heads
    failed: dict[str, str] = {}
    history.begin(plan)  # the first copies of cold history are in flight from here
    try:
        for layer, block in enumerate(model.layers):
            q, k, v = block.qkv(x, cos, sin)  # q [n, heads, D]; k, v [n, kv_heads, D]
            kv.write(layer, k, v)
            out = torch.zeros_like(q)
            for i, seq in enumerate(plan.seqs):
                lo, hi = kv.rows[i]
                att = ChunkedAttention(q[lo:hi], kv_heads, scale)
                try:
                    for hk, hv in history.pieces(layer, i, while_waiting=gap):
                        att.add(hk, hv)
                except TransferError as exc:
                    failed.setdefault(seq.request_id, f"KV restore failed: {exc}")
                if seq.request_id in failed:
                    continue  # its rows stay zero; the request fails after the step
                att.add(*kv.tail(layer, i))
                out[lo:hi] = att.result(q.dtype)
            x = block.finish(x, out)
    finally:
        history.end()
    return model.norm(x), kv.rows, failed
