"""Device-memory accounting: what each mode keeps on the device, and how many requests fit.

Per mode, on the (target) device:

- weights: target, plus the draft except in ``parallel-spec`` (its draft has its own GPU);
- target KV: everything in ``resident``; in the offload modes a request stays fully resident up
  to ``offload_threshold`` tokens, past it only the ``resident_tail`` does (``tail``
  residency), or as much of its newest history as its share of the free memory holds
  (``fill``: the engine's ``residency_targets``, see residency.py);
- draft KV: ``draft_tokens(context)`` per request (windowed by default; on GPU 2 in
  ``parallel-spec``, where it is checked against that GPU's memory);
- buffers: ``specstream`` needs ``staging_buffers`` chunk slots for a group (one layer each).
  Full-restore modes, ``tail``: room for at least one request's whole cold history, and the
  batch restores in sub-batches of as many requests as fit (each a separate forward). ``fill``
  (as the engine's layer-wise restore): room for two layers of the batch's cold history, and
  the batch restores in one piece.

Host: the cold history (``tail``), or every request's whole history (``fill``: each block is
written through to the host once, so shrinking a request's share never moves bytes back).
``fill`` admits on the minimum device room (floors + buffers), the rest is residency.

Prefix sharing (``shared``: leading tokens every request of the batch shares; ``tail`` only):
the host holds the shared prefix's cold blocks once, and a restore sub-batch needs room for
them once plus each request's own cold history.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from specstream.sim.costs import Costs
from specstream.sim.policy import OFFLOAD_MODES, RESTORE_MODES, STREAM_MODES, SimPolicy
from specstream.sim.residency import fill_level, fill_targets


@dataclass(frozen=True)
class MemoryPlan:
    """Where a batch's bytes live, and how the restore is split."""

    fits: bool
    device_bytes: float  # on the target device
    draft_device_bytes: float  # on the draft GPU (parallel-spec), else 0
    host_bytes: float  # offloaded KV
    sub_batch: int  # requests restored together (full-restore modes); batch size otherwise
    share: float = 0.0  # fill: the water-filling level in tokens (cold_tokens' share); tail: 0


def _resident_bytes(mode: str, costs: Costs, policy: SimPolicy, ctx: float) -> tuple[float, float]:
    """(target-device bytes, draft-device bytes) one request keeps resident."""
    kv_t, kv_d = costs.kv_bytes("target"), costs.kv_bytes("draft")
    hot = ctx - policy.cold_tokens(mode, ctx)
    draft = policy.draft_tokens(ctx) * kv_d
    if mode == "parallel-spec":
        return hot * kv_t, draft
    return hot * kv_t + (draft if mode != "offload" else 0.0), 0.0


def plan(mode: str, costs: Costs, policy: SimPolicy, contexts: Sequence[float],
         shared: float = 0.0) -> MemoryPlan:
    """Memory of a batch whose requests have the given (peak) context lengths, the first
    ``shared`` tokens of each the same blocks (prefix sharing, ``tail`` residency only)."""
    if policy.residency == "fill" and mode in OFFLOAD_MODES:
        if shared:
            raise ValueError("prefix sharing is modelled under residency tail only")
        return _fill_plan(mode, costs, policy, contexts)
    kv_t = costs.kv_bytes("target")
    weights = costs.weight_bytes("target")
    draft_weights = costs.weight_bytes("draft")
    if mode not in ("parallel-spec", "offload"):
        weights += draft_weights
    per_req = [_resident_bytes(mode, costs, policy, c) for c in contexts]
    device = weights + sum(p[0] for p in per_req)
    draft_dev = draft_weights + sum(p[1] for p in per_req) if mode == "parallel-spec" else 0.0
    cold = [policy.cold_tokens(mode, c) * kv_t for c in contexts]
    # the shared prefix is the oldest history, so cold first; held (and restored) once
    once = max((min(shared * kv_t, x) for x in cold), default=0.0)
    own = [x - min(shared * kv_t, x) for x in cold]
    host = sum(own) + once
    budget = costs.device_budget_bytes
    sub_batch = len(contexts)
    if mode in STREAM_MODES and host > 0:
        group = math.ceil(len(contexts) / policy.groups)
        per_layer = kv_t / costs.layers("target")
        device += policy.staging_buffers * policy.chunk_tokens * group * per_layer
    elif host > 0:  # full restore: as many requests' cold KV as the free memory holds
        largest_first = [once + x for x in itertools.accumulate(sorted(own, reverse=True))]
        sub_batch = bisect.bisect_right(largest_first, budget - device)
        device += largest_first[max(sub_batch, 1) - 1]
    fits = (device <= budget and host <= costs.host_budget_bytes
            and draft_dev <= budget and (sub_batch >= 1 or not contexts))
    return MemoryPlan(fits, device, draft_dev, host, max(sub_batch, 1))


def _fill_plan(mode: str, costs: Costs, policy: SimPolicy,
               contexts: Sequence[float]) -> MemoryPlan:
    """``fill``: weights, draft KV and staging first; the rest of the budget is residency,
    water-filled over the requests (each keeps at least its floor), less the room that
    restoring the non-resident history takes (two layers of it, restore modes)."""
    kv_t = costs.kv_bytes("target")
    weights = costs.weight_bytes("target")
    draft_weights = costs.weight_bytes("draft")
    if mode != "offload":  # offload: no draft; parallel-spec: the draft on its own GPU
        draft = sum(policy.draft_tokens(c) for c in contexts) * costs.kv_bytes("draft")
        draft_dev = draft_weights + draft if mode == "parallel-spec" else 0.0
        fixed = weights + (0.0 if mode == "parallel-spec" else draft_weights + draft)
    else:
        fixed, draft_dev = weights, 0.0
    if mode in STREAM_MODES and contexts:
        group = math.ceil(len(contexts) / policy.groups)
        fixed += (policy.staging_buffers * policy.chunk_tokens * group * kv_t
                  / costs.layers("target"))
    frac = min(1.0, 2 / costs.layers("target")) if mode in RESTORE_MODES else 0.0
    budget = costs.device_budget_bytes
    total = sum(contexts)
    floors = [policy.resident_floor(mode, c) for c in contexts]
    targets = fill_targets((budget - fixed) / kv_t, contexts, floors, frac)
    share = fill_level(targets, contexts, floors)
    hot = float(sum(targets))
    device = fixed + (hot + frac * (total - hot)) * kv_t
    least = fixed + (sum(floors) + frac * (total - sum(floors))) * kv_t
    host = total * kv_t
    fits = least <= budget and host <= costs.host_budget_bytes and draft_dev <= budget
    return MemoryPlan(fits, device, draft_dev, host, max(len(contexts), 1), share)


def max_concurrency(mode: str, costs: Costs, policy: SimPolicy, context: float,
                    limit: int = 4096) -> int:
    """Most requests of this (peak) context that fit at once; 0 if not even one does."""
    if not plan(mode, costs, policy, [context]).fits:
        return 0
    lo, hi = 1, 2
    while hi <= limit and plan(mode, costs, policy, [context] * hi).fits:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # invariant: lo fits, hi does not (or is past the limit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan(mode, costs, policy, [context] * mid).fits else (lo, mid)
    return lo


def link_bytes_per_round(mode: str, costs: Costs, policy: SimPolicy,
                         contexts: Sequence[float]) -> float:
    """History bytes the batch moves over the link in one round (each request once)."""
    share = plan(mode, costs, policy, contexts).share
    return sum(policy.cold_tokens(mode, c, share) for c in contexts) * costs.kv_bytes("target")


def kv_bytes_total(costs: Costs, policy: SimPolicy, contexts: Sequence[float]) -> float:
    """Target plus draft KV of a batch, were it all resident (the deployment question)."""
    kv_t, kv_d = costs.kv_bytes("target"), costs.kv_bytes("draft")
    return sum(c * kv_t + policy.draft_tokens(c) * kv_d for c in contexts)
