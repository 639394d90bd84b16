"""The two groups of the overlapped modes: one verifies while the other drafts, then they swap.

Drafting for a request's next round needs this round's outcome, so `specstream` (drafts in the
link's gaps) and `parallel-spec` (drafts on a second device) split the decoding requests into
two groups that alternate: each step verifies one group while the other's drafts are made.

With prefix sharing a split has a price of its own: a shared run that requests of both groups
read crosses the link once per group's round, twice a period, where one group's round moves
it once. `specstream` merges its groups while that second crossing costs more link time than
merging exposes of drafting (the drafts of every request, made after the merged round instead
of in the link's gaps: the round-shape policy's measured draft costs).
"""

from __future__ import annotations

from collections.abc import Sequence

from specstream.engine.policy.feedback import Estimates
from specstream.engine.request import Request
from specstream.kvcache.manager import KVManager


class Groups:
    def __init__(self, enabled: bool, history_token_bytes: int, merges: bool = False) -> None:
        """``merges``: the groups merge into one while decode rounds are not link-bound
        (``Estimates.link_bound``; `specstream`, whose drafts only pay in the link's gaps;
        `parallel-spec` drafts on a second device, off the round's path either way)."""
        self.enabled = enabled
        self.merges = merges
        self.history_token_bytes = history_token_bytes
        self._parity = 0
        self.merged_steps = 0  # steps that verified every request because the link hid nothing

    def split(self, est: Estimates, running: Sequence[Request] = (),
              kv: KVManager | None = None, exposed_draft_s: float | None = None) -> bool:
        """Whether this step runs as two groups (else every decoding request verifies in it
        and drafts right after). ``exposed_draft_s``: what drafting for every decoding request
        after a merged round would take (None: not measured; no merging for sharing then)."""
        if not self.enabled:
            return False
        if self.merges and (not est.link_bound or (
                exposed_draft_s is not None and kv is not None
                and self.doubled_s(running, kv, est) > exposed_draft_s)):
            self.merged_steps += 1
            return False
        return True

    def doubled_s(self, running: Sequence[Request], kv: KVManager, est: Estimates) -> float:
        """Link seconds a two-group period spends moving shared blocks a second time: the
        cold shared blocks (not held on the device) that decoding requests of both groups
        read."""
        if not (kv.sharing and est.link_bps and kv.duplicate_blocks()):
            return 0.0
        read: tuple[set[int], set[int]] = (set(), set())
        for r in running:
            seq = kv.seqs.get(r.request_id)
            if r.in_prefill or r.group < 0 or seq is None:
                continue
            run = min(kv.shared_run(r.request_id), seq.first)
            read[r.group].update(seq.host_blocks[len(kv.lead(r.request_id)) : run])
        tokens = len(read[0] & read[1]) * kv.block_size
        return tokens * self.history_token_bytes / est.link_bps

    @staticmethod
    def assign(req: Request, running: list[Request]) -> None:
        """Put a request that starts decoding into the smaller of the two groups."""
        sizes = [0, 0]
        for r in running:
            if r.group >= 0:
                sizes[r.group] += 1
        req.group = 0 if sizes[0] <= sizes[1] else 1

    def to_verify(self, running: list[Request]) -> int | None:
        """The group this step verifies (None: every request; one-group modes), falling back
        to the other group when this one has nothing ready."""
        if not self.enabled:
            return None
        ready = {r.group for r in running if not r.in_prefill and not r.needs_draft}
        group = self._parity if self._parity in ready or not ready else 1 - self._parity
        self._parity = 1 - group
        return group

    def prefill_verifies_all(self, running: list[Request], kv: KVManager,
                             est: Estimates) -> bool:
        """Whether this step carries a prefill chunk whose compute hides streaming every
        decoding request's history: then it verifies them all (and they draft right after);
        else the groups alternate as in any other step (with the link dominating, verifying
        everyone would put all their history on the link behind every chunk). True until both
        are measured."""
        if not (self.enabled and any(r.in_prefill for r in running)):
            return False
        if not (est.link_bps and est.prefill_chunk_s and self.history_token_bytes):
            return True
        tokens = sum(kv.host_tokens(r.request_id) for r in running
                     if not r.in_prefill and r.request_id in kv.seqs)
        return tokens * self.history_token_bytes / est.link_bps <= est.prefill_chunk_s
