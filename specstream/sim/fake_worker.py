"""A worker without a model: it answers a ``StepPlan`` with the ``StepOutput`` the engine's worker
would hand back, drawing acceptances at random (the scheduler's side of the contract only ever
sees token ids and counts, so a fake token id does).

Acceptance: a chain's draft at position k is accepted, given that the ones before it were, with
``AcceptanceModel.position_rates`` (i.i.d. with an ``alpha``; falling with position from a
measured histogram). Token trees (``DraftWork.topk > 1``): the drafts form the best tree of the
node budget under per-rank acceptance (the target's token is the draft's rank-r candidate with
probability ``rank_rates[r]``, rank 0 being the chain rate of that depth); the verification walks
it from the root, taking at each node the child whose rank the target drew.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specstream.engine.contract import StepOutput, StepPlan
from specstream.sim.workload import AcceptanceModel

TOKEN = 3  # every emitted and drafted token (the engine is told no end-of-sequence id)
# Per-rank acceptance of the second, third, ... candidate over the first (trees): each a
# quarter of the one before, the engine's own prior (engine/policy/shaping.py) when nothing is
# measured.
RANK_DECAY = 0.25


@dataclass
class FakeWorker:
    acceptance: AcceptanceModel
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    rank_decay: float = RANK_DECAY

    def run(self, plan: StepPlan) -> StepOutput:
        """Emit tokens for every sampling SeqWork, drafts for every DraftWork."""
        out = StepOutput()
        for s in plan.seqs:
            if not s.sample:
                continue
            if s.prefill or not s.num_drafts:
                out.new_tokens[s.request_id] = [TOKEN]
                continue
            if s.parents and s.is_tree:
                accepted, walk = self._walk(s.parents)
                out.tree_ranks[s.request_id] = walk
            else:
                accepted = self._chain(s.num_drafts)
            out.new_tokens[s.request_id] = [TOKEN] * (accepted + 1)
        for d in plan.drafts:
            n = d.count(len(out.new_tokens.get(d.request_id, ())) if d.after_verify else 0)
            if n <= 0:
                continue
            if d.topk > 1 and d.max_nodes and d.max_nodes > n:
                parents = self.tree(n, d.topk, d.max_nodes)
                out.draft_parents[d.request_id] = parents
                out.drafts[d.request_id] = [TOKEN] * len(parents)
            else:
                out.drafts[d.request_id] = [TOKEN] * n
        return out

    def _chain(self, depth: int) -> int:
        accepted = 0
        for rate in self.acceptance.position_rates(depth):
            if self.rng.random() >= rate:
                break
            accepted += 1
        return accepted

    def rank_rates(self, depth: int, topk: int) -> list[list[float]]:
        """Per depth (1..depth), the acceptance of each rank 0..topk-1."""
        return [[base * self.rank_decay ** r for r in range(topk)]
                for base in self.acceptance.position_rates(depth)]

    def tree(self, depth: int, topk: int, nodes: int) -> list[int]:
        """Parents (-1 = the root) of the ``nodes`` drafts of highest path probability, at most
        ``depth`` deep and ``topk`` children a node, parents before children."""
        rates = self.rank_rates(depth, topk)
        parents: list[int] = []
        heap: list[tuple[float, int, int, int]] = [(-rates[0][0], 1, 0, -1)]
        while heap and len(parents) < nodes:
            neg, d, rank, parent = heapq.heappop(heap)
            me = len(parents)
            parents.append(parent)
            if rank + 1 < topk:  # the next sibling
                heapq.heappush(heap, (neg / rates[d - 1][rank] * rates[d - 1][rank + 1], d,
                                      rank + 1, parent))
            if d < depth:  # the first child
                heapq.heappush(heap, (neg * rates[d][0], d + 1, 0, me))
        return parents

    def _walk(self, parents: Sequence[int]) -> tuple[int, list[tuple[int, int | None]]]:
        """Accepted depth of a verified tree, and (children, rank taken) per node reached."""
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            children.setdefault(p, []).append(i)
        depth_max = 1 + max(_depths(parents), default=0)
        rates = self.rank_rates(depth_max, max(len(c) for c in children.values()))
        node, depth, walk = -1, 0, []
        while node in children:
            kids = children[node]
            u, took = self.rng.random(), None
            for rank, p in enumerate(rates[depth][:len(kids)]):
                if u < p:
                    took = rank
                    break
                u -= p
            walk.append((len(kids), took))
            if took is None:
                break
            node, depth = kids[took], depth + 1
        return depth, walk


def _depths(parents: Sequence[int]) -> list[int]:
    d: list[int] = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d
