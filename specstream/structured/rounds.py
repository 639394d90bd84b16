"""The worker's grammar state: one matcher per constrained request, kept in step with the
tokens the request has generated, and the masks of each round's logits rows."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import llguidance
import torch
from torch import Tensor

from specstream.structured.grammar import Constraint, compile_constraint
from specstream.structured.matcher import Matcher


class GrammarRounds:
    """``tokenizer``: builds the grammar library's tokenizer on first use (a constrained
    request's first round), so runs without constraints never pay for it."""

    def __init__(self, tokenizer: Callable[[], llguidance.LLTokenizer], vocab_size: int) -> None:
        self._make_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.vocab_size = vocab_size
        self._matchers: dict[str, tuple[Matcher, int]] = {}  # and the tokens it has consumed
        self.mask_s = 0.0  # seconds in ``masks`` (the metrics' structured_mask_s)
        self.mask_rows = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = self._make_tokenizer()
        return self._tokenizer

    def check(self, constraint: Constraint) -> None:
        """Compile ``constraint`` now (cached): a GrammarError for one the library rejects."""
        compile_constraint(constraint, self.tokenizer)

    def masks(self, request_id: str, constraint: Constraint, generated: Sequence[int],
              paths: Sequence[Sequence[int]]) -> Tensor:
        """[len(paths), V] bool: row r allows what the grammar allows after ``generated`` (the
        request's output so far) and then ``paths[r]`` (the drafts before row r). A path the
        grammar refuses part-way gets the mask where it stops: the target rejects the refused
        draft there, so the rows after it are never read."""
        t0 = time.perf_counter()
        m, consumed = self._matchers.get(request_id, (None, 0))
        if m is None:
            m = Matcher(self.tokenizer, compile_constraint(constraint, self.tokenizer),
                        self.vocab_size)
        if len(generated) < consumed:
            raise RuntimeError(f"request {request_id}: {len(generated)} tokens generated, "
                               f"fewer than the {consumed} its grammar has consumed")
        new = list(generated[consumed:])
        if m.advance(new) != len(new) and not m.done:  # past the end: the request is ending
            raise RuntimeError(f"request {request_id}: an accepted token breaks its grammar")
        self._matchers[request_id] = (m, len(generated))
        cache: dict[tuple[int, ...], Tensor] = {}
        rows = []
        for path in paths:
            key = tuple(path)
            if key not in cache:
                taken = m.advance(key)
                cache[key] = m.allowed()
                m.rollback(taken)
            rows.append(cache[key])
        self.mask_s += time.perf_counter() - t0
        self.mask_rows += len(rows)
        return torch.stack(rows)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
