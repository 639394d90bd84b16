"""Token-tree drafting: the draft model grows a tree level by level, one batched forward per
level for all the requests of a batch.

The shape (``TreeBuilder``, host only). The root is the request's last token. Level 0 is the
chain's catch-up forward (``DraftJob``); its last position's logits give the root's top-k
children. Each later level feeds the *frontier*, ``topk`` nodes of the newest depth, as query
tokens and adds each one's top-k children. The tree is

- the *spine*: the draft's greedy path, ``min(num_tokens, max_nodes)`` deep, the chain a
  ``topk = 1`` round would draft. A tree thus never holds less than the chain of its depth (for
  greedy requests it accepts at least as many tokens), however flat the draft's distributions;
- and the ``max_nodes - len(spine)`` most probable other nodes produced. "Probable" is the
  cumulative draft log-probability of the node's path, from the raw log-softmax of the draft's
  logits whatever the request's sampling parameters: the children are verified as point masses,
  which is lossless for any parameters (``tree.accept_tree``), so the ranking only decides what
  is worth verifying. A path's probability only shrinks as it grows, so these form a tree.

The frontier is the spine's newest node and the most probable other new nodes, as long as their
path beats the budget's current cut (a node at or below it can have no child in the tree), so
the budget goes where the draft expects acceptances rather than to every child of the first two
or three depths. This is EAGLE-2's dynamic tree (Li et al. 2024, "EAGLE-2: Faster Inference of
Language Models with Dynamic Draft Trees"; SGLang's ``--speculative-eagle-topk`` /
``--speculative-num-draft-tokens``) with the greedy path always kept.

Attention. A level's nodes are appended to the request's slot behind its tokens; a node sees the
tokens, its ancestors' entries and its own (``DraftForward``'s tree mask), never a sibling's or
a cousin's, at position ``len(token_ids) - 1 + depth``. Once a request's tree is complete its
nodes leave the cache (``DraftSeqCache.drop_tree``): the engine's rollback keeps the committed
tokens only, and the next catch-up feeds the accepted ones. Nothing is evicted while nodes are
cached.

Cost: a round of depth D is D forwards, as a chain of D drafts, with at most ``topk`` query
tokens per request per level. Host reads: one per level (its top-k log-probs and ids, and the
tokens of the batch's chain requests), a non-blocking copy into pinned memory plus an event on
CUDA, waited for at the next step: the host waits for the level's forward, not for work enqueued
behind it. Chain requests (``topk == 1``) in the batch draft as in ``DraftJob``, a token per
level, sampled with their parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from specstream.sampling import logits_to_probs, sample
from specstream.spec.draft import (
    DraftJob,
    DraftModelProposer,
    request_max_nodes,
    sampling_rows,
)
from specstream.spec.draft_kv import DraftForward, DraftSeqCache, TreeQueries
from specstream.spec.proposer import Proposal, ProposeRequest
from specstream.structured.matcher import mask_logits


class TreeBuilder:
    """One request's tree while it grows: every node produced so far (candidates) in creation
    order, the spine (the draft's greedy path, kept whole) and the frontier whose children the
    next forward computes."""

    def __init__(self, topk: int, depth: int, budget: int) -> None:
        self.topk, self.depth, self.budget = topk, depth, budget
        self.tokens: list[int] = []
        self.parents: list[int] = []  # -1 = the root
        self.cum: list[float] = []  # log-probability of the path root -> node
        self.depths: list[int] = []
        self.spine: list[int] = []  # the most probable child of the root, its, and so on
        self.reserve = min(depth, budget)  # the spine's nodes in the tree
        self.entry: dict[int, int] = {}  # fed node -> its entry among the cached tree nodes
        self.frontier: list[int] = [-1]  # the root first: its children are the catch-up's

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def feed(self) -> list[list[int]]:
        """Cache entries for the frontier (the next ones, in order) and, per frontier node, the
        entries it sees: its path's (every ancestor was fed at an earlier level)."""
        seen = []
        for node in self.frontier:
            self.entry[node] = len(self.entry)
            seen.append([self.entry[a] for a in self.path(node)])
        return seen

    def grow(self, children: Sequence[Sequence[tuple[int, float]]]) -> None:
        """Add each frontier node's children, ``(token, log-prob)`` most probable first, and
        choose the next frontier: the spine's new node while the spine grows, then the most
        probable other new nodes that can still get into the tree, ``topk`` in all."""
        first = len(self.tokens)
        tip = self.spine[-1] if self.spine else -1
        for parent, kids in zip(self.frontier, children, strict=True):
            base, depth = (0.0, 1) if parent < 0 else (self.cum[parent], self.depths[parent] + 1)
            if parent == tip and kids and len(self.spine) < self.reserve:
                self.spine.append(len(self.tokens))
            for token, logp in kids[: self.topk]:
                self.tokens.append(token)
                self.parents.append(parent)
                self.cum.append(base + logp)
                self.depths.append(depth)
        new = range(first, len(self.tokens))
        if not new or self.depths[first] >= self.depth:
            self.frontier = []
            return
        grows = bool(self.spine) and len(self.spine) < self.reserve and self.spine[-1] >= first
        head = [self.spine[-1]] if grows else []
        cut = self._cut()
        ranked = sorted((c for c in new if c not in head and self.cum[c] > cut),
                        key=lambda c: (-self.cum[c], c))
        self.frontier = head + ranked[: self.topk - len(head)]

    def _others(self) -> list[int]:
        """The nodes off the spine, most probable first (ties: the older node first, so a
        parent always comes before its children)."""
        spine = set(self.spine)
        return sorted((c for c in range(len(self.tokens)) if c not in spine),
                      key=lambda c: (-self.cum[c], c))

    def _cut(self) -> float:
        """What a path off the spine must beat to be among the ``budget - reserve`` most
        probable of them so far: a node at or below it can have no child in the tree."""
        room = self.budget - self.reserve
        if room <= 0:
            return math.inf
        others = self._others()
        return -math.inf if len(others) < room else self.cum[others[room - 1]]

    def result(self) -> tuple[list[int], list[int]]:
        """The tree: the spine and the ``budget - len(spine)`` most probable other nodes,
        tokens and parents (-1 = the root), by depth, children grouped in their parents'
        order, siblings most probable first. Ancestor-closed: a node's parent is on the spine
        or more probable (or as probable and older)."""
        chosen = self.spine + self._others()[: max(self.budget - len(self.spine), 0)]
        index: dict[int, int] = {-1: -1}
        order: list[int] = []
        for depth in range(1, self.depth + 1):
            level = [c for c in chosen if self.depths[c] == depth]
            for c in sorted(level, key=lambda c: (index[self.parents[c]], c)):
                index[c] = len(order)
                order.append(c)
        return [self.tokens[c] for c in order], [index[self.parents[c]] for c in order]


class _Readback:
    """A small device tensor on its way to the host: on CUDA a non-blocking copy into pinned
    memory and an event, so reading it waits for the work before it only."""

    def __init__(self, x: Tensor) -> None:
        self.event = None
        self.host = x
        if x.is_cuda:
            self.host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self.host.copy_(x, non_blocking=True)
            self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self.event.record()

    def values(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        out: list[float] = self.host.tolist()
        return out


@dataclass
class _Level:
    """One launched forward whose results are still on their way to the host."""

    live: list[int]  # the job's requests it fed, in row order
    chain: list[int]  # positions in ``live`` of the chain requests (one drafted token each)
    tree: list[int]  # positions in ``live`` of the tree requests (a row per frontier node)
    probs: Tensor | None  # [len(chain), V] what the chain tokens were sampled from
    k: int  # top-k columns per tree row
    read: _Readback  # chain tokens, then the tree rows' top-k log-probs, then their ids


class DraftTreeJob(DraftJob):
    """Drafts for a batch with tree requests, one batched forward per level (see the module
    docstring); ``step`` first takes in the previous level's read-back."""

    def __init__(self, proposer: DraftModelProposer, requests: Sequence[ProposeRequest]) -> None:
        super().__init__(proposer, requests)
        self.trees = {i: TreeBuilder(r.topk, r.num_tokens, request_max_nodes(r))
                      for i, r in enumerate(self.active) if r.topk > 1}
        chain = [r for i, r in enumerate(self.active) if i not in self.trees]
        self.chain_greedy = all(r.params.temperature == 0 for r in chain)  # as DraftJob
        self.drafted: list[list[int]] = [[] for _ in self.active]  # chain requests' tokens
        self.chain_probs: list[list[Tensor]] = [[] for _ in self.active]
        self.level = 0
        self.pending: _Level | None = None

    @property
    def done(self) -> bool:
        return self.pending is None and not self.live

    def step(self) -> bool:
        """Take in the last level's read-back (a wait, on the device, for its forward only),
        then launch the next level's forward, if any request still grows."""
        if self.pending is not None:
            self._absorb(self.pending)
            self.pending = None
        if not self.live:
            return False
        self.pending = self._launch()
        self.num_steps += 1
        return True

    @torch.no_grad()
    def _launch(self) -> _Level:
        p, live, s, active = self.p, self.live, self.level, self.active
        caches = [self.caches[i] for i in live]
        tree: list[TreeQueries | None] | None = None
        if s == 0:  # the catch-up, as in DraftJob; every request is live
            counts = [len(self.tokens[i]) for i in live]
            positions = [x for i in live for x in self.positions[i]]
            ids = [x for i in live for x in self.tokens[i]]
            first = list(range(len(live)))  # one logits row each: its last position
        else:
            counts, positions, ids, tree = [], [], [], []
            for i, c in zip(live, caches):
                pos = len(active[i].token_ids) + s - 1  # depth s: the root's position + s
                t = self.trees.get(i)
                if t is None:
                    counts.append(1)
                    ids.append(self.drafted[i][-1])
                    tree.append(None)
                else:
                    seen = t.feed()
                    assert len(t.entry) - len(seen) == c.tree_entries
                    counts.append(len(seen))
                    ids += [t.tokens[n] for n in t.frontier]
                    tree.append((c.length - c.tree_entries, seen))
                positions += [pos] * counts[-1]
            first = [0, *accumulate(counts)][:-1]  # a logits row per fed token
        chain = [j for j, i in enumerate(live) if i not in self.trees]
        trees = [j for j, i in enumerate(live) if i in self.trees]
        tree_rows = [first[j] + u for j in trees for u in range(1 if s == 0 else counts[j])]
        sample_rows = None if self.chain_greedy else [live[j] for j in chain]
        fwd = p.prepare(caches, counts, positions,
                         [ids, [first[j] for j in chain], tree_rows, sample_rows], tree)
        ids_t, chain_t, tree_t, sample_t = fwd.extra
        assert ids_t is not None
        if s == 0:
            logits = p.forward(fwd, ids_t, caches, counts, [x[-1] for x in self.positions])
        else:
            logits = self._forward_level(fwd, ids_t, live, caches, counts, positions)
        if any(active[i].allowed is not None for i in live):
            logits = self._grammar_rows(logits, live, first)
        parts, probs, k = [], None, 0
        if chain:
            assert chain_t is not None
            rows = logits.index_select(0, chain_t)
            if self.chain_greedy:
                tokens = rows.argmax(dim=-1)
            else:
                assert self.sampling is not None and sample_t is not None
                params = [active[live[j]].params for j in chain]
                st = sampling_rows(self.sampling, sample_t)
                probs = logits_to_probs(
                    rows, st.temperature, st.top_k, st.top_p,
                    filters=any(x.top_k > 0 or x.top_p < 1 for x in params),
                    any_greedy=any(x.temperature == 0 for x in params))
                tokens = sample(probs, [self.caches[live[j]].generator for j in chain])
            parts.append(tokens.double())
        if trees:
            assert tree_t is not None
            k = min(max(self.trees[live[j]].topk for j in trees), logits.shape[-1])
            # raw draft log-probabilities: only the ranking of candidates depends on them
            logp = torch.log_softmax(logits.index_select(0, tree_t), dim=-1)
            top, top_ids = logp.topk(k, dim=-1)  # [rows, k] each, most probable first
            parts += [top.double().flatten(), top_ids.double().flatten()]
        return _Level(live, chain, trees, probs, k, _Readback(torch.cat(parts)))

    def _grammar_rows(self, logits: Tensor, live: list[int], first: list[int]) -> Tensor:
        """Each constrained request's logits rows masked by its grammar after the row's path
        (a chain's drafts so far; a tree frontier node's path), all known on the host."""
        masks = torch.ones(logits.shape, dtype=torch.bool)
        for j, i in enumerate(live):
            allowed, t = self.active[i].allowed, self.trees.get(i)
            if allowed is None:
                continue
            if t is None:
                masks[first[j]] = allowed(self.drafted[i])
            else:
                for u, node in enumerate(t.frontier):
                    masks[first[j] + u] = allowed([t.tokens[a] for a in t.path(node)])
        return mask_logits(logits, masks)

    def _forward_level(self, fwd: DraftForward, ids: Tensor, live: list[int],
                       caches: list[DraftSeqCache], counts: list[int],
                       positions: list[int]) -> Tensor:
        """A level after the catch-up: logits of every fed token ``[num_tokens, V]``; tree
        nodes stay cached (no eviction) until their request's tree is complete."""
        hidden = self.p.model(ids, fwd.positions, fwd)  # [num_tokens, hidden]
        row = 0
        for i, c, n in zip(live, caches, counts):
            c.length += n
            if i in self.trees:
                c.tree_entries += n
            else:
                c.num_tokens = positions[row] + 1
                self.p.evict(c)
            row += n
        return self.p.model.compute_logits(hidden)

    def _absorb(self, lv: _Level) -> None:
        values = lv.read.values()
        for n, j in enumerate(lv.chain):
            i = lv.live[j]
            self.drafted[i].append(int(values[n]))
            if lv.probs is not None:
                self.chain_probs[i].append(lv.probs[n])
        at, k = len(lv.chain), lv.k
        num_rows = sum(len(self.trees[lv.live[j]].frontier) for j in lv.tree)
        logps, ids = values[at : at + num_rows * k], values[at + num_rows * k :]
        row = 0
        for j in lv.tree:
            i = lv.live[j]
            t = self.trees[i]
            kids = []
            for _ in t.frontier:  # (a grammar's masked tokens are no candidates)
                kids.append([(int(ids[row * k + u]), logps[row * k + u])
                             for u in range(min(t.topk, k)) if logps[row * k + u] > -math.inf])
                row += 1
            t.grow(kids)
            if not t.frontier:  # complete: the cache holds the request's tokens only
                self.caches[i].drop_tree()
        self.level += 1
        self.live = [i for i in lv.live if (
            self.trees[i].frontier if i in self.trees
            else len(self.drafted[i]) < self.active[i].num_tokens)]

    def device_tokens(self) -> Tensor | None:
        """None: a tree job's drafts are on the host already (read level by level)."""
        while self.step():
            pass
        return None

    def result(self, read: list[int] | None = None) -> list[Proposal]:
        if self._result is None:
            while self.step():
                pass
            out = {r.request_id: Proposal([]) for r in self.requests}
            for i, r in enumerate(self.active):
                t = self.trees.get(i)
                if t is not None:
                    tokens, parents = t.result()
                    out[r.request_id] = Proposal(tokens, None, parents)  # point masses
                else:
                    out[r.request_id] = Proposal(
                        self.drafted[i],
                        None if r.params.greedy else torch.stack(self.chain_probs[i]))
            self._result = [out[r.request_id] for r in self.requests]
        return self._result

