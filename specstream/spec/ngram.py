"""Prompt-lookup (n-gram) drafting: continue the text the way it continued before."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specstream.spec.proposer import Proposal, Proposer, ProposeRequest, register_proposer


def ngram_lookup(
    token_ids: Sequence[int] | np.ndarray, num_tokens: int, min_n: int = 1, max_n: int = 4
) -> list[int]:
    """Tokens that followed the latest earlier occurrence of the longest matching suffix.

    For n from ``max_n`` down to ``min_n``: find the latest start i < L - n with
    tokens[i:i+n] == tokens[L-n:], and return up to ``num_tokens`` tokens from i + n. Empty if
    no n in range matches.

    Cost: one vectorised comparison over the history (O(L)) to find where the last token occurs,
    then O(number of candidates) per extra matched position, so a 32K history takes well under
    a millisecond.
    """
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = tokens.shape[0]
    max_n = min(max_n, length - 1)
    if num_tokens <= 0 or max_n < min_n:
        return []
    # Candidate match ends j (the match is tokens[j-n+1 : j+1]); j <= L-2 so that a token
    # follows the match. Extend the match backwards one position at a time.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    best_end = -1
    best_n = 0
    for n in range(1, max_n + 1):
        if n > 1:
            k = n - 1
            ends = ends[ends >= k]
            ends = ends[tokens[ends - k] == tokens[length - 1 - k]]
        if ends.size == 0:
            break
        if n >= min_n:
            best_end, best_n = int(ends[-1]), n
    if best_n == 0:
        return []
    start = best_end + 1
    out: list[int] = tokens[start : start + num_tokens].tolist()
    return out


@register_proposer("ngram")
class NgramProposer(Proposer):
    """Prompt lookup decoding: drafts are point masses copied from the request's own history."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        """Look up each request's suffix in its own tokens; probs is None (point mass)."""
        return [
            Proposal(ngram_lookup(r.token_ids, r.num_tokens, self.min_n, self.max_n), None)
            for r in requests
        ]
