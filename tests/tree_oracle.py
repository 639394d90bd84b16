"""A fake tree proposer for the engine's tree tests (no draft model), and the settings they run
in: random top-k trees, and where the target's greedy continuation of a request is known, the
true next token at a random sibling slot of the true path's nodes."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from specstream.spec.proposer import Proposal, Proposer, ProposeRequest, register_proposer

OFFLOAD = dict(block_size=16, chunk_tokens=64, resident_tail_tokens=32, offload_after_tokens=64,
               max_prefill_tokens=64)
MODES = {
    "resident": dict(mode="resident", device_kv_bytes=16 << 20, max_prefill_tokens=64),
    "offload-spec/fill": dict(mode="offload-spec", device_kv_bytes=1_600_000, **OFFLOAD),
    "offload-spec/tail": dict(mode="offload-spec", device_kv_bytes=1_600_000, residency="tail",
                              **OFFLOAD),
    "specstream/fill": dict(mode="specstream", device_kv_bytes=1_000_000, link_gbps=2.0,
                            **OFFLOAD),
    "specstream/tail": dict(mode="specstream", device_kv_bytes=1_000_000, link_gbps=2.0,
                            residency="tail", **OFFLOAD),
    "parallel-spec/fill": dict(mode="parallel-spec", device_kv_bytes=1_600_000, **OFFLOAD),
    "parallel-spec/tail": dict(mode="parallel-spec", device_kv_bytes=1_600_000,
                               residency="tail", **OFFLOAD),
    # half of the cold history attended on the host (tree queries in the host's partials),
    # rounds in two halves a layer apart
    "specstream/tail/host": dict(mode="specstream", device_kv_bytes=1_000_000, link_gbps=2.0,
                                 residency="tail", host_attention_fraction=0.5, **OFFLOAD),
    "offload-spec/fill/host": dict(mode="offload-spec", device_kv_bytes=1_600_000,
                                   host_attention_fraction=0.5, **OFFLOAD),
}


@register_proposer("test-oracle-tree")
class OracleTreeProposer(Proposer):
    """Top-k trees of random tokens, level by level under the node budget, deterministic in the
    request's tokens and ``seed``. Where ``references`` (prompt + target greedy output) continue
    the request, each node on the true path has the true next token among its children with
    probability ``hit``, at a random slot; the true nodes and ``expand`` others of a level are
    expanded. With probability ``chain_share`` (or topk 1) a chain instead (parents None).
    ``with_probs``: sampled requests' drafts come with draft distributions (plumbing only: they
    are not what the tokens were drawn from).

    Checks the engine's side of the contract: every rollback after a tree keeps exactly the
    tokens up to the root (the request's tokens when it drafted)."""

    def __init__(self, references: Sequence[Sequence[int]] = (), vocab: int = 128,
                 seed: int = 0, hit: float = 0.8, chain_share: float = 0.0,
                 expand: int = 1, with_probs: bool = False) -> None:
        self.full = [list(r) for r in references]
        self.vocab, self.seed, self.hit, self.with_probs = vocab, seed, hit, with_probs
        self.chain_share, self.expand = chain_share, expand
        self.pending: dict[str, int] = {}  # request id -> its token count when it drafted a tree
        self.rollbacks: list[tuple[int, int]] = []  # (kept, tokens up to the root)
        self.trees = self.chains = 0

    def _truth(self, tokens: list[int]) -> list[int]:
        n = len(tokens)
        for full in self.full:
            if len(full) > n and full[:n] == tokens:
                return full[n:]
        return []

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        out = [self._one(r) for r in requests]
        for r, prop in zip(requests, out):
            if self.with_probs and not r.params.greedy and prop.token_ids:
                ids = torch.tensor(prop.token_ids)
                prop.probs = 0.5 * torch.nn.functional.one_hot(ids, self.vocab).float()
                prop.probs += 0.5 / self.vocab
        return out

    def _one(self, r: ProposeRequest) -> Proposal:
        tokens = list(r.token_ids)
        rng = random.Random(f"{self.seed}/{len(tokens)}/{tokens[-1]}/{sum(tokens)}")
        truth = self._truth(tokens)
        if r.topk == 1 or rng.random() < self.chain_share:
            self.chains += 1
            self.pending.pop(r.request_id, None)
            return Proposal([truth[d] if d < len(truth) and rng.random() < self.hit
                             else rng.randrange(3, self.vocab) for d in range(r.num_tokens)])
        budget = r.max_nodes or r.num_tokens
        toks: list[int] = []
        parents: list[int] = []
        true_node = {-1: True}
        level = [-1]
        for d in range(r.num_tokens):
            nxt = []
            for par in level:
                want = truth[d] if true_node[par] and d < len(truth) else None
                kids = rng.sample([t for t in range(3, self.vocab) if t != want], r.topk)
                if want is not None and rng.random() < self.hit:
                    kids[rng.randrange(r.topk)] = want
                for t in kids:
                    if len(toks) == budget:
                        break
                    true_node[len(toks)] = t == want
                    nxt.append(len(toks))
                    toks.append(t)
                    parents.append(par)
            good = [i for i in nxt if true_node[i]]
            others = [i for i in nxt if not true_node[i]]
            level = good + rng.sample(others, min(self.expand, len(others)))
            if len(toks) == budget or not level:
                break
        self.trees += 1
        self.pending[r.request_id] = len(tokens)
        return Proposal(toks, None, parents)

    def rollback(self, request_id: str, num_tokens_kept: int) -> None:
        root = self.pending.pop(request_id, None)
        if root is not None:
            self.rollbacks.append((num_tokens_kept, root))
