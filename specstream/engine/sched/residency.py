"""Residency `fill`: the device blocks nobody reserved hold the running requests' newest history.

Before each step ``rebalance`` shares them among the running requests as residency targets
(equal shares, ``kvcache.manager.residency_targets``): a request over its target drops its
oldest device blocks (they have host copies), one under it gets some of its streamed blocks
promoted back as they pass (``promote``: no link bytes). `tail` keeps a fixed resident tail and
needs none of this.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from specstream.config import EngineConfig
from specstream.engine.contract import SeqWork
from specstream.engine.request import Request
from specstream.engine.sched.restore_room import RestoreRoom
from specstream.kvcache.manager import BlockCopy, KVManager
from specstream.kvcache.residency import residency_targets


class Residency:
    def __init__(self, config: EngineConfig, kv: KVManager, room: RestoreRoom | None) -> None:
        self.config, self.kv, self.room = config, kv, room
        # what the step needs beyond the shares, counted by rebalance before it allocates
        # anything: restore-mode room for its history (pool blocks lent to it) and the decode
        # rounds' new blocks
        self.step_room = 0
        # `restore` modes: the room rebalance planned for the step's restores when two whole
        # layers of the history did not fit beside the floors (None: they did, as they may)
        self.restore_room: int | None = None

    def rebalance(self, running: list[Request], scratch: int,
                  verified: Collection[str] | None = None) -> list[BlockCopy]:
        """Share the device blocks among the running requests: each keeps at least its
        resident tail (and its blocks without a host copy); the rest of the pool, less this
        step's working room (``scratch`` blocks for prefill, the new tokens' blocks of the
        requests it verifies, ``verified``, None: every decoding one, restore-mode room for the
        history that still streams), goes to equal shares.

        Hysteresis: a request over its share keeps its blocks until the step needs the room
        (then those furthest over drop their oldest, which have host copies); one under its
        share gets streamed blocks promoted once the step's allocations are made
        (``promote``). A share that moves by a block for a step, or a request that comes and
        goes, moves no more blocks than the room it needs.

        Prefix sharing: each distinct shared run takes a share as a request would (once, for
        all its sharers: ``kvcache/shared_device.py`` holds its oldest blocks on the device),
        and a sharer's window holds only its own blocks. Returns the host-to-device copies of
        the shared blocks newly held, which the step makes first."""
        kv, bs = self.kv, self.config.block_size
        if not kv.policy.fill:
            return []
        reqs = [r for r in running if r.request_id in kv.seqs]
        tail = -(-kv.policy.resident_tail_tokens // bs) + 1
        runs = kv.shared.runs([r.request_id for r in reqs]) if kv.shared else []
        floors, caps, now, growth = [], [], [], 0
        for r in reqs:
            seq = kv.seqs[r.request_id]
            blocks = seq.first + len(seq.device_blocks)
            # a prompt's next chunk lands in the scratch (then its share holds it: counting
            # its whole prompt here too kept a chunk's room from the others); a verified
            # request's new tokens: its last one and the drafts it verifies (in a split
            # round the other group's are not written, and room kept for them streams)
            if not r.in_prefill and (verified is None or r.request_id in verified):
                growth += kv.device_blocks_needed(r.request_id, len(r.draft_token_ids) + 1)
            pinned = len(seq.device_blocks) - seq.droppable
            run = kv.shared.run_of(r.request_id) if kv.shared and seq.refs else 0
            cap = blocks - run
            floors.append(min(cap, max(tail, pinned)))
            caps.append(cap)
            now.append((seq.first + len(seq.device_blocks) - run, len(seq.device_blocks)))
        floors += [0] * len(runs)
        caps += [len(run) for run in runs]
        pool = kv.device.num_blocks - growth - scratch
        rr = self.room

        def room(targets: list[int], colds: list[int] | None = None) -> int:
            """Lent blocks for the history that streams (``colds``: the cold blocks of each,
            ``caps`` less ``targets`` where not given)."""
            if rr is None:
                return 0
            if colds is None:
                colds = [c - t for c, t in zip(caps, targets)]
            return rr.whole(sum(map(rr.link_blocks, colds)))

        # two whole layers of the history beside the floors, or restores in pieces in the
        # guaranteed room, the rest of the pool resident
        whole = rr is None or sum(floors) + room(floors) <= pool
        cost = room if whole or rr is None else (
            lambda t, colds=None: min(room(t, colds), rr.guaranteed))
        targets = residency_targets(floors, caps, pool, cost if rr else None)
        # this step streams more than the targets leave cold where a request holds less than
        # its share: it is promoted only as its cold blocks pass, so all of them cross the
        # link now (the room the prefill chunks leave must hold them)
        colds = [max(c - t, b - min(h, t)) for c, t, (b, h) in zip(caps, targets, now)]
        step = cost(targets, colds + [c - t for c, t in zip(caps[len(now):], targets[len(now):])])
        self.restore_room = None if whole else step
        self.step_room = step + growth
        for r, t in zip(reqs, targets):
            kv.set_target(r.request_id, t)
        # the step's working room must be free, and the shared runs' new copies need theirs:
        # those furthest over their share make it
        shared, missing = list(zip(runs, targets[len(reqs):])), 0
        if kv.shared is not None:
            kv.shared.take_over(shared)  # before any window drops them
            missing = max(0, sum(t for _, t in shared) - kv.shared.held)
        self.free_up(scratch + self.step_room + missing, running)
        if kv.shared is None:
            return []
        return kv.shared.hold(shared, kv.device.num_free - scratch - self.step_room)

    def promote(self, seqs: list[SeqWork], running: list[Request]) -> list[SeqWork]:
        """Give requests of the step under their share device blocks for the newest of their
        streamed blocks (the step copies them there as they pass: no link bytes)."""
        kv = self.kv
        if not kv.policy.fill:
            return seqs
        out = []
        planned = {s.request_id for s in seqs}  # their windows are fixed for this step
        for s in seqs:
            seq = kv.seqs[s.request_id]
            short = (seq.target or 0) - len(seq.device_blocks)
            # only blocks that cross the link can be promoted on the way (not host-attended),
            # and only the newest cold blocks (those just before the window)
            short = _newest_on_link(s, seq.host_blocks[: seq.first], short)
            if s.restore_chunks and short > 0:
                self.free_up(short, running, keep=planned)
                s = replace(s, promote=tuple(kv.plan_promotion(s.request_id, short)))
            out.append(s)
        return out

    def free_up(self, blocks: int, running: list[Request], keep: Collection[str] = ()) -> None:
        """Make ``blocks`` device blocks free, as far as requests over their share can (those
        furthest over drop their oldest first; none of ``keep``)."""
        kv = self.kv
        short = blocks - kv.device.num_free
        for rid in sorted((r.request_id for r in running
                           if r.request_id in kv.seqs and r.request_id not in keep),
                          key=kv.excess, reverse=True):
            if short <= 0:
                break
            short -= kv.drop(rid, min(short, kv.excess(rid)))


def _newest_on_link(work: SeqWork, cold: list[int], most: int) -> int:
    """How many (at most ``most``) of the request's newest cold blocks end its link-carried
    blocks (the host attends its own oldest blocks; a shared prefix it leaves on the link may
    come last)."""
    n = 0
    for chunk in reversed(work.restore_chunks):
        for b in reversed(chunk):
            if n >= min(most, len(cold)) or b != cold[-1 - n]:
                return n
            n += 1
    return n
