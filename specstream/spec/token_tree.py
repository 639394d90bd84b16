"""A request's draft tokens for one round as a tree below its last accepted token. Pure Python:
the scheduler, the round-shape policy and the worker all read it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class DraftTree:
    """The draft tokens of one request for one round, as a tree below the root.

    The root is the request's last accepted token; it is not a node. Nodes are numbered
    0..N-1 in an order where every parent comes before its children (BFS by depth is the
    natural one); siblings are tried in index order.
    """

    # The token of each node (N nodes).
    tokens: tuple[int, ...]
    # The parent node of each node; -1 = child of the root.
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, tuple) or not isinstance(self.parents, tuple):
            raise TypeError("DraftTree tokens and parents must be tuples of ints")
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        n = len(self.tokens)
        for i, (tok, par) in enumerate(zip(self.tokens, self.parents)):
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise ValueError(f"node {i}: token must be an int >= 0, got {tok!r}")
            if isinstance(par, bool) or not isinstance(par, int) or not -1 <= par < n:
                raise ValueError(f"node {i}: parent {par!r} out of range [-1, {n})")
            if par >= i:
                raise ValueError(f"node {i}: parent {par} must come before its child")

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        """A chain of drafts: node i is the child of node i - 1."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node: 1 for the children of the root."""
        d: list[int] = []
        for par in self.parents:
            d.append(1 if par < 0 else d[par] + 1)
        return tuple(d)

    @property
    def depth(self) -> int:
        """The longest path below the root (0 for no nodes)."""
        return max(self.depths, default=0)

    @cached_property
    def _children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, par in enumerate(self.parents):
            kids[par + 1].append(i)
        return tuple(tuple(k) for k in kids)

    def children(self, i: int) -> tuple[int, ...]:
        """The children of node i (i = -1: of the root), in index order."""
        self._check_node(i)
        return self._children[i + 1]

    def path(self, i: int) -> tuple[int, ...]:
        """The nodes from the root down to node i, i included (i = -1: the empty path)."""
        self._check_node(i)
        out: list[int] = []
        while i >= 0:
            out.append(i)
            i = self.parents[i]
        return tuple(reversed(out))

    def _check_node(self, i: int) -> None:
        if not -1 <= i < len(self):
            raise IndexError(f"node {i} out of range [-1, {len(self)})")
