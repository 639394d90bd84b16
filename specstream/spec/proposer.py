"""The proposer interface: who drafts the next tokens of a request, plus a name registry."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specstream.registry import Registry
from specstream.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProposeRequest:
    """One request that needs drafts this round."""

    # The engine's request id (proposers with per-request state key it by this).
    request_id: str
    # All tokens so far: prompt + generated output (the last one is the last accepted token).
    token_ids: Sequence[int]
    # How many draft tokens to propose (a proposer may return fewer); with a token tree, its
    # depth at most (the request's room: no path may run past it).
    num_tokens: int
    # The request's sampling parameters; model proposers process their logits with them.
    params: SamplingParams
    # Token trees: children per expanded node (1 = a chain of num_tokens drafts).
    topk: int = 1
    # Token trees: nodes of the tree at most (None = num_tokens, a chain).
    max_nodes: int | None = None
    # Structured outputs: the tokens the request's grammar allows after token_ids and the
    # given drafts ([V] bool); a model proposer drafts under it. None: unconstrained.
    allowed: Callable[[Sequence[int]], Tensor] | None = None


@dataclass
class Proposal:
    """Draft tokens for one request."""

    # The proposed tokens, at most ProposeRequest.num_tokens of them (may be empty); a token
    # tree's nodes (at most max_nodes, at most num_tokens deep), every parent before its
    # children.
    token_ids: list[int]
    # [len(token_ids), V] fp32: the processed draft distribution each token was sampled from,
    # or None for point-mass (deterministic) proposers, such as top-k trees. A tree's siblings
    # must then be i.i.d. draws from the same distribution (``spec/tree.py``).
    probs: Tensor | None = None
    # Token trees: the parent of each token (index into token_ids; -1 = a child of the last
    # accepted token), as ``spec.tree.DraftTree``; None = a chain.
    parents: list[int] | None = None


class ProposeJob:
    """Drafting in steps, so an engine can interleave it with other work.

    ``step()`` does one unit of work and returns True while more remains; ``result()`` finishes
    whatever is left and returns one Proposal per request. This base class does everything at
    once (for proposers whose drafting is cheap, such as n-gram lookup).
    """

    def __init__(self, proposer: Proposer, requests: Sequence[ProposeRequest]) -> None:
        self._proposer, self.requests = proposer, list(requests)
        self._result: list[Proposal] | None = None
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return self._result is not None

    def step(self) -> bool:
        if self._result is None:
            self._result = self._proposer.propose(self.requests)
            self.num_steps += 1
        return False

    def device_tokens(self) -> Tensor | None:
        """Every drafted token, flat and still on the device, once the job is finished (None
        for proposers that draft on the host); ``result(values)`` takes them read back, so an
        engine can bring them home in the same copy as its other results."""
        return None

    def result(self, read: list[int] | None = None) -> list[Proposal]:
        """One Proposal per request. ``read``: ``device_tokens()`` read back, where the job
        has device tokens (else it reads them itself)."""
        self.step()
        assert self._result is not None
        return self._result


class Proposer(ABC):
    """Drafts tokens for a batch of requests; the target verifies them with ``accept_drafts``."""

    @abstractmethod
    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        """One Proposal per request, in order."""

    def start(self, requests: Sequence[ProposeRequest]) -> ProposeJob:
        """Drafting for ``requests`` as a job that advances in steps."""
        return ProposeJob(self, requests)

    def rollback(self, request_id: str, num_tokens_kept: int) -> None:  # noqa: B027
        """Forget state past the first ``num_tokens_kept`` tokens (rejected drafts)."""

    def free(self, request_id: str) -> None:  # noqa: B027
        """Drop all state of a finished request."""


PROPOSERS: Registry[type[Proposer]] = Registry("proposer")
# Class decorator: make the proposer constructible as ``make_proposer(name, ...)``.
register_proposer = PROPOSERS.register


def make_proposer(name: str, **kwargs: Any) -> Proposer:
    """Construct the proposer registered under ``name`` (the built-in ones register when their
    modules are imported, here)."""
    _builtin()
    return PROPOSERS.get(name)(**kwargs)


def _builtin() -> None:
    from specstream.spec import draft, ngram  # noqa: F401


def available_proposers() -> list[str]:
    """Names of the registered proposers."""
    _builtin()
    return PROPOSERS.names()


def batch_proposals(
    proposals: Sequence[Proposal], vocab_size: int, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Pad proposals into the inputs of ``accept_drafts``.

    Returns draft_tokens [B, Q] int64 (0-padded), num_drafts [B] int64 and draft_probs
    [B, Q, V] fp32, or None when every proposal is a point mass. In a mixed batch point-mass
    rows get one-hot distributions, which is the same acceptance rule.
    """
    lens = [len(p.token_ids) for p in proposals]
    q = max(lens, default=0)
    tokens = torch.zeros(len(proposals), q, dtype=torch.int64)
    for i, p in enumerate(proposals):
        tokens[i, : lens[i]] = torch.tensor(p.token_ids, dtype=torch.int64)
    tokens = tokens.to(device)
    num = torch.tensor(lens, dtype=torch.int64, device=device)
    if all(p.probs is None for p in proposals):
        return tokens, num, None
    probs = torch.zeros(len(proposals), q, vocab_size, dtype=torch.float32, device=device)
    for i, p in enumerate(proposals):
        if p.probs is None:
            probs[i, : lens[i]].scatter_(-1, tokens[i, : lens[i], None], 1.0)
        else:
            probs[i, : lens[i]] = p.probs.to(device=device, dtype=torch.float32)
    return tokens, num, probs
