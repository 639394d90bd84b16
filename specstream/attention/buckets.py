"""Query buckets: how one step's requests are grouped into attention calls.

Every decode (a few positions each) shares one bucket, padded to the most positions among them;
each longer prefill chunk is alone (padding a decode to a 1,000-token chunk would cost more than
a launch). The target's round (``engine/exec/step_kv.py``) and the draft's forward
(``spec/draft_kv.py``) bucket the same way.
"""

from __future__ import annotations

# Requests with at most this many positions in a step share one bucket.
DECODE_POSITIONS = 32


def buckets_of(num_tokens: list[int], limit: int = DECODE_POSITIONS,
               halves: bool = False) -> list[list[int]]:
    """Indices grouped into query buckets (see the module docstring); ``limit``: the most
    positions a request of the shared bucket may have; ``halves``: the shared bucket as two
    (host attention pipelines them a layer apart)."""
    small = [i for i, n in enumerate(num_tokens) if n <= limit]
    large = [[i] for i, n in enumerate(num_tokens) if n > limit]
    if halves and len(small) > 1:
        m = (len(small) + 1) // 2
        return [small[:m], small[m:]] + large
    return ([small] if small else []) + large
