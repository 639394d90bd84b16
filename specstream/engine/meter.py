"""What a step measured, read off the backend's link records and the host attention's
counters (``StepMeasures``), and the step's residency before it ran (its history floor, the
device blocks holding history)."""

from __future__ import annotations

import time

from specstream.backends.base import TransferBackend
from specstream.engine.contract import StepMeasures, StepOutput, StepPlan, is_decode_step
from specstream.engine.exec.host_attention import HostAttention
from specstream.engine.stats import EngineStats
from specstream.engine.trace import Tracer
from specstream.kvcache.manager import CopyKind, KVManager
from specstream.kvcache.storage import KVStore


class StepMeter:
    """Reads each step's measurements; adds the link's bytes by direction to ``stats``."""

    def __init__(self, backend: TransferBackend, store: KVStore, kv: KVManager,
                 host: HostAttention | None, stats: EngineStats, tracer: Tracer) -> None:
        self.backend, self.store, self.kv, self.host = backend, store, kv, host
        self.stats, self.tracer = stats, tracer
        self.block_size, self.num_layers = store.block_size, store.cfg.num_layers

    def residency(self, plan: StepPlan) -> tuple[int, float, int]:
        """The step's history floor (bytes of its requests' history that cannot be resident
        given the device budget: the device holds C blocks and the running requests' KV takes
        K after the step, each request's in whole blocks (a part-filled last block takes a
        block) and with the room its tokens of this step are written to (a prompt's chunk
        included); the K - C blocks that do not fit are history, a (K - C)/H share of the H
        blocks of history held, of every request's, whichever requests keep what; shared
        blocks counted once in all three), the fraction of device KV
        blocks holding history, and the bytes of the distinct blocks the step's history moves
        over the link (a block several of its requests read, counted once: what a round that
        moves each shared block once moves)."""
        kv, bs = self.kv, self.block_size
        ends = {s.request_id: s.start_pos + len(s.token_ids) for s in plan.seqs}
        held = history_held = demand = 0
        for rid, seq in kv.seqs.items():
            history_held += -(-seq.num_tokens // bs)
            demand += -(-max(seq.num_tokens, ends.pop(rid, 0)) // bs)
            held += -(-(seq.num_tokens - seq.first * bs) // bs)
        demand += sum(-(-end // bs) for end in ends.values())  # a prompt not yet allocated
        held += kv.shared.held if kv.shared is not None else 0  # once for all sharers
        num_blocks = kv.device.num_blocks
        # unique KV: a block several requests share (prefix sharing) is held and moved once
        dup_all = kv.duplicate_blocks()
        demand -= dup_all
        history_held -= dup_all
        history = sum(-(-s.start_pos // bs) for s in plan.seqs)  # in blocks
        layers = self.num_layers
        if dup := kv.duplicate_blocks([s.request_id for s in plan.seqs if s.request_id in kv.seqs]):
            history -= dup
            links = sum(len({b for s in plan.seqs for b in s.layer_link_blocks(layer)})
                        for layer in range(layers))
        else:  # nothing shared: every block a request reads is its own
            links = sum(layers * sum(map(len, s.restore_chunks))
                        + (layers * len(s.host_blocks) - sum(s.host_layers) if s.host_layers
                           else 0) for s in plan.seqs)
        # a shared run's new device copies (kvcache/shared_device.py) cross the link once
        links += layers * sum(k is CopyKind.HOST_TO_DEVICE for k, _, _ in plan.cache_copies)
        unique = links * (self.store.block_bytes // layers)
        over = max(0, demand - num_blocks)
        share = min(1.0, over / history_held) if history_held else 0.0
        # not rounded to whole blocks per step: a period of two groups' rounds whose history
        # has an odd number of blocks over shares it half and half (rounding each half down
        # put a block a period out of any split's reach)
        floor = int(history * share * self.store.block_bytes)
        return floor, held / num_blocks if num_blocks else 0.0, unique

    def measure(self, plan: StepPlan, result: StepOutput) -> StepMeasures:
        """The step's link records (merged busy time, bytes by direction) and host attention
        counters, as one record."""
        end = time.perf_counter()
        records = self.backend.busy_intervals()
        self.backend.reset_stats()
        busy, cur = 0.0, (0.0, 0.0)
        for r in records:
            if r.direction == "h2d":
                self.stats.link_bytes_h2d += r.nbytes
            else:
                self.stats.link_bytes_d2h += r.nbytes
            self.tracer.add(f"link {r.direction}", str(r.tag), r.start, r.end, bytes=r.nbytes)
            if r.start > cur[1]:
                busy += cur[1] - cur[0]
                cur = (r.start, r.end)
            else:
                cur = (cur[0], max(cur[1], r.end))
        busy += cur[1] - cur[0]
        host = self.host
        busy_h, wait_h, serial_h, jobs = host.since_last() if host else (0.0, 0.0, 0.0, ())
        layers = self.num_layers
        return StepMeasures(
            wall_s=end - result.start, wait_s=result.wait_s, draft_s=result.draft_s,
            link_busy_s=busy, link_bytes=sum(r.nbytes for r in records),
            history_bytes=sum(r.nbytes for r in records if r.direction == "h2d"),
            prefill_tokens=sum(len(s.token_ids) for s in plan.seqs if s.prefill),
            decode=is_decode_step(plan, result), host_attends=host is not None,
            host_bytes=sum(s.host_bytes(self.store.block_bytes, layers) for s in plan.seqs),
            host_busy_s=busy_h, host_wait_s=wait_h, host_serial_s=serial_h, host_jobs=jobs,
            halves=result.halves)
