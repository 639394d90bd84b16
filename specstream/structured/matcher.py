"""A request's grammar state, and the token masks of a speculative round.

Position j of a chain round is masked by the matcher's state after the drafts before j; node i of
a tree by the state after the path to i. Masks are computed by advancing the matcher over the
drafts and rolling it back, so the request's matcher ends where it began: the caller advances it
by the tokens the round accepted. Masking the draft's and the target's logits by the same
per-position state keeps speculative sampling lossless for the constrained distribution (the
acceptance test compares the masked target with the masked draft, position by position)."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch
from torch import Tensor

_BITS = torch.arange(32, dtype=torch.int32)


class Matcher:
    """One request's grammar state over a vocabulary of ``vocab_size`` logits (tokens past the
    tokenizer's vocabulary are never allowed)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, vocab_size: int) -> None:
        self._m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._m.is_error():
            raise ValueError(self._m.get_error())
        self.vocab_size = vocab_size
        self.eos_token = tokenizer.eos_token

    def allowed(self) -> Tensor:
        """[vocab_size] bool: the tokens the grammar allows next (only EOS once it is done)."""
        if self._m.is_stopped():
            out = torch.zeros(self.vocab_size, dtype=torch.bool)
            out[self.eos_token] = True
            return out
        words = torch.frombuffer(bytearray(self._m.compute_bitmask()), dtype=torch.int32)
        bits = ((words[:, None] >> _BITS) & 1).bool().flatten()
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        n = min(self.vocab_size, bits.numel())
        out[:n] = bits[:n]
        return out

    def advance(self, tokens: Sequence[int]) -> int:
        """Consume ``tokens`` in order while the grammar allows them; how many it took."""
        ids = [int(t) for t in tokens]
        n = 0 if self._m.is_stopped() else self._m.validate_tokens(ids)  # changes nothing
        if n and not self._m.consume_tokens(ids[:n]):
            raise RuntimeError(f"grammar matcher refused tokens it validated: "
                               f"{self._m.get_error()}")
        return n

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar matcher could not roll back {num_tokens} tokens: "
                               f"{self._m.get_error()}")

    def fork(self) -> Matcher:
        """An independent copy in the same state."""
        twin = object.__new__(Matcher)
        twin._m = self._m.deep_copy()
        twin.vocab_size, twin.eos_token = self.vocab_size, self.eos_token
        return twin

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but the end."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self._m.is_accepting())


def chain_masks(matcher: Matcher, drafts: Sequence[int]) -> Tensor:
    """[len(drafts) + 1, V] bool: row j masks the target's logits at position j (after drafts
    0..j-1). Past a draft the grammar refuses, rows repeat that position's mask: the target
    rejects the draft there (its probability is 0), so later rows are never read. The matcher
    is left as it was."""
    rows = [matcher.allowed()]
    taken = 0
    for d in drafts:
        if matcher.advance([d]) == 0:
            break
        taken += 1
        rows.append(matcher.allowed())
    matcher.rollback(taken)
    rows += [rows[-1]] * (len(drafts) + 1 - len(rows))
    return torch.stack(rows)


def tree_masks(matcher: Matcher, tokens: Sequence[int], parents: Sequence[int]) -> Tensor:
    """[N + 1, V] bool for a token tree of N nodes (``parents[i]`` < i, -1 for a child of the
    root): row 0 masks the root's prediction, row i + 1 the prediction after node i (the
    state after the path to it). A node the grammar refuses, and its subtree, get its parent's
    mask (the node is rejected there; its subtree is never reached). The matcher is left as
    it was."""
    n = len(tokens)
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: a parent must come before its child")
        children[p + 1].append(i)
    rows: list[Tensor | None] = [None] * (n + 1)
    rows[0] = matcher.allowed()
    stack: list[tuple[int, bool]] = [(c, False) for c in reversed(children[0])]
    while stack:
        node, leaving = stack.pop()
        if leaving:
            matcher.rollback(1)
            continue
        if matcher.advance([tokens[node]]) == 0:
            _fill_subtree(rows, children, node, rows[parents[node] + 1])
            continue
        rows[node + 1] = matcher.allowed()
        stack.append((node, True))
        stack += [(c, False) for c in reversed(children[node + 1])]
    done = [r for r in rows if r is not None]
    assert len(done) == n + 1
    return torch.stack(done)


def _fill_subtree(rows: list[Tensor | None], children: list[list[int]], node: int,
                  mask: Tensor | None) -> None:
    todo = [node]
    while todo:
        i = todo.pop()
        rows[i + 1] = mask
        todo += children[i + 1]


def mask_logits(logits: Tensor, masks: Tensor) -> Tensor:
    """``logits`` with the tokens ``masks`` forbids at -inf (``masks`` broadcast to it, moved to
    its device: one bitmask per query position, applied there)."""
    return logits.masked_fill(~masks.to(logits.device), float("-inf"))
