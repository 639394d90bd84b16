"""Admission against the KV budgets: what a request reserves, and who may start now.

A request reserves, at admission, the device blocks its resident tail can ever need and the
host blocks its history can ever need (prompt + max_tokens), so an admitted request never runs
out of memory mid-way: when memory runs short new requests wait; nothing admitted is dropped.
The `restore` modes also reserve the pool blocks a step lends to hold two layers of the
admitted requests' history (the one attended, the next one prefetched), up to the room the
budget guarantees (``restore_room.py``: beyond it, layers come in pieces).

With prefix sharing a request references the cached host blocks its prompt starts with: they
are held once, so its reservation leaves them out, and the host tier counts each shared block
once (``KVManager.unreserved_shared``). A prompt that starts with blocks a running request is
still prefilling (or writing back) waits for them instead of prefilling them again.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from specstream.config import EngineConfig
from specstream.engine.request import Request, Status
from specstream.engine.sched.restore_room import RestoreRoom
from specstream.kvcache.manager import BlockCopy, KVManager


@dataclass
class Reservation:
    device_blocks: int  # the steady tail
    host_blocks: int  # the whole history
    # `restore` modes: pool blocks that hold two layers of its link-carried history (shared:
    # admission holds at most the guaranteed room for all of them together)
    restore_blocks: int = 0


class Admission:
    def __init__(self, config: EngineConfig, kv: KVManager, room: RestoreRoom | None) -> None:
        self.config, self.kv = config, kv
        self.room = room  # `restore` modes: the room steps borrow; None otherwise
        self.reserved: dict[str, Reservation] = {}
        self.reserved_device = 0  # tails
        self.reserved_restore = 0  # restore room wanted, before the guaranteed room caps it
        self.reserved_host = 0

    def _restore_held(self, wanted: int) -> int:
        return self.room.reserved(wanted) if self.room is not None else 0

    @property
    def scratch_blocks(self) -> int:
        """Blocks kept free for prefill chunks beyond the tails' steady size (offload modes)."""
        if not self.kv.policy.offload:
            return 0
        want = -(-self.config.max_prefill_tokens // self.config.block_size) + 1
        # two blocks guarantee progress; chunks grow into whatever else is free (of the pool
        # less the restore room, as a streaming mode's pool is less its staging ring)
        pool = self.kv.device.num_blocks - (self.room.guaranteed if self.room else 0)
        return min(want, max(2, pool // 4))

    def reservation(self, req: Request, shared: int = 0) -> Reservation:
        """Device blocks of the request's steady tail; host blocks of its whole history but
        the ``shared`` cached blocks it references."""
        total = len(req.prompt_token_ids) + req.params.max_tokens
        bs, p = self.config.block_size, self.kv.policy
        step = self.config.verify_tokens
        if p.fill:  # the tail is the minimum; blocks beyond it are shared (sched/residency)
            tail = min(p.resident_tail_tokens, total) + step
        elif p.offload:
            tail = max(min(total, p.offload_after_tokens), p.resident_tail_tokens + bs) + step
            tail = min(tail, total + step)
        else:
            tail = total + step
        streamed = max(0, (total - p.resident_tail_tokens) // bs) if p.offload else 0
        room = self.room
        return Reservation(-(-tail // bs) + 1,
                           max(0, self.kv.host_blocks_needed(total) - shared),
                           room.whole(room.link_blocks(streamed)) if room else 0)

    def tails_outstanding(self) -> int:
        """Blocks that admitted requests' tails may still claim from the free pool."""
        held = {rid: len(s.device_blocks) for rid, s in self.kv.seqs.items()}
        return sum(max(0, r.device_blocks - held.get(rid, 0)) for rid, r in self.reserved.items())

    def outstanding(self) -> int:
        """Blocks that admitted requests may still claim from the free pool (`tail`): their
        tails' and the restore room held for them."""
        return self.tails_outstanding() + self._restore_held(self.reserved_restore)

    def lend(self, history: int, planned: int | None = None) -> int:
        """Pool blocks a `restore` step with ``history`` link-carried blocks per layer borrows
        (``restore_room.RestoreRoom.lend``): what the pool can spare beyond the tails' claims,
        or under `fill` what the residency planned for it (``planned``)."""
        if self.room is None or not history:
            return 0
        spare = (planned if planned is not None
                 else self.kv.device.num_free - self.tails_outstanding())
        return min(self.room.lend(history, spare), self.kv.device.num_free)

    def prefill_room(self, req: Request, step_room: int) -> int:
        """Tokens a prefill chunk of ``req`` may write now without touching others' reserve
        (`fill`: the free blocks beyond the step's working room ``step_room``, which the
        residency made at least the prefill scratch)."""
        rid, bs = req.request_id, self.config.block_size
        seq = self.kv.seqs.get(rid)
        held = len(seq.device_blocks) if seq else 0
        if self.kv.policy.fill:
            blocks = max(0, self.kv.device.num_free - step_room)
        else:
            own = max(0, self.reserved[rid].device_blocks - held)
            blocks = own + max(0, self.kv.device.num_free - self.outstanding())
        tail = req.num_computed_tokens - (seq.first * bs if seq else 0)
        return blocks * bs + (held * bs - tail)

    def check_fits(self, req: Request) -> None:
        """Raise if the request could never be admitted, even on an idle engine."""
        r = self.reservation(req)
        need = r.device_blocks + self._restore_held(r.restore_blocks) + self.scratch_blocks
        if need > self.kv.device.num_blocks:
            p = self.kv.policy
            if p.fill:
                remedy = (f"or lower resident_tail_tokens (now {p.resident_tail_tokens}: "
                          "every request keeps at least that many tokens on the device)")
            elif p.offload:
                remedy = (f"or lower offload_after_tokens (now {p.offload_after_tokens}: the "
                          "device keeps a request's KV until it passes that many tokens)")
            else:
                remedy = "or use an offloading mode"
            if r.restore_blocks:
                remedy += (f"; {self._restore_held(r.restore_blocks)} of them are room for its "
                           "restored history")
            raise ValueError(
                f"request needs {need} device KV blocks but the "
                f"device budget holds {self.kv.device.num_blocks}; raise device_kv_bytes "
                + remedy)
        if r.host_blocks > self.kv.host.num_blocks:
            raise ValueError(
                f"request needs {r.host_blocks} host KV blocks but host_kv_bytes holds "
                f"{self.kv.host.num_blocks}"
            )

    def admit(self, waiting: deque[Request], running: list[Request]) -> list[BlockCopy]:
        """Move the waiting requests whose reservations fit into ``running`` (first come,
        first served); returns the prefix-cache copies their first step makes."""
        copies: list[BlockCopy] = []
        while waiting and len(running) < self.config.max_num_seqs:
            req = waiting[0]
            r = self.reservation(req)
            limit = self.kv.device.num_blocks - self.scratch_blocks
            device = (self.reserved_device + r.device_blocks
                      + self._restore_held(self.reserved_restore + r.restore_blocks))
            if device > limit:
                break  # (before the prefix lookup: a waiting prompt is not hashed every step)
            adopts = not req.num_computed_tokens and req.params.prompt_logprobs is None
            hits = self.kv.prefix_hits(req.prompt_token_ids) if adopts else []
            if adopts and self._awaits_sharer(req, len(hits), running):
                break
            if hits:
                r = self.reservation(req, len(hits))
            host = (self.reserved_host + self.kv.unreserved_shared() + r.host_blocks
                    + sum(not e.pins["host"] for e in hits))
            if host > self.kv.host.num_blocks:
                break
            if not self.kv.policy.offload and self.kv.device.num_free < r.device_blocks - 1:
                break  # cached blocks a prefix hit of this step copies from: next step
            waiting.popleft()
            if not self.kv.policy.offload:
                # resident: hold the whole reservation now, as one run of consecutive blocks
                self.kv.allocate(req.request_id, (r.device_blocks - 1) * self.config.block_size)
            # a prefix-cache hit: copies, not prefill (not with prompt_logprobs, which need
            # the logits of every prompt position, as vLLM)
            if adopts:
                hit, hit_copies = self.kv.adopt_prefix(req.request_id, req.prompt_token_ids)
                req.num_computed_tokens = req.num_cached_tokens = hit
                copies += hit_copies
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.perf_counter()
            self.reserved[req.request_id] = r
            self.reserved_device += r.device_blocks
            self.reserved_restore += r.restore_blocks
            self.reserved_host += r.host_blocks
            req.status = Status.RUNNING
            running.append(req)
        return copies

    def _awaits_sharer(self, req: Request, hits: int, running: list[Request]) -> bool:
        """Prefix sharing: whether ``req``'s prompt starts with more full blocks of a running
        request's prompt than the cache holds for it (``hits``) while that request still
        prefills them or writes them back: then it waits and references them instead."""
        if not self.kv.sharing:
            return False
        bs, prompt = self.config.block_size, req.prompt_token_ids
        most = (len(prompt) - 1) // bs
        for other in running:
            seq = self.kv.seqs.get(other.request_id)
            if seq is None:
                continue
            common = common_blocks(prompt, other.prompt_token_ids, bs, most)
            if common > hits and (other.in_prefill
                                  or (seq.moving and len(seq.host_blocks) < common)):
                return True
        return False

    def release(self, rid: str) -> None:
        """A request ended: its reservation is free for others."""
        r = self.reserved.pop(rid, None)
        if r is not None:
            self.reserved_device -= r.device_blocks
            self.reserved_restore -= r.restore_blocks
            self.reserved_host -= r.host_blocks


def common_blocks(a: list[int], b: list[int], block_size: int, most: int) -> int:
    """Full blocks (at most ``most``) two token sequences start with in common."""
    n = 0
    while n < most and a[n * block_size : (n + 1) * block_size] == b[
            n * block_size : (n + 1) * block_size] and len(b) >= (n + 1) * block_size:
        n += 1
    return n
