"""Prompt-lookup drafting and the proposer registry."""

from __future__ import annotations

import random

import pytest
import torch

from specstream.sampling_params import SamplingParams
from specstream.spec import (
    NgramProposer,
    Proposal,
    Proposer,
    ProposeRequest,
    batch_proposals,
    make_proposer,
    ngram_lookup,
    register_proposer,
)


def req(tokens: list[int], num: int, rid: str = "r") -> ProposeRequest:
    return ProposeRequest(rid, tokens, num, SamplingParams())


def test_known_sequence_proposes_continuation() -> None:
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert ngram_lookup(tokens, 3) == [8, 9, 1]
    assert ngram_lookup(tokens, 10) == [8, 9, 1, 2, 5, 6, 7]  # fewer when history runs out


def test_no_match_is_empty() -> None:
    assert ngram_lookup([1, 2, 3, 4], 3) == []
    assert ngram_lookup([1], 3) == []
    assert ngram_lookup([], 3) == []
    assert ngram_lookup([1, 2, 1], 0) == []
    # Only a 1-gram matches, but min_n=2 forbids it.
    assert ngram_lookup([3, 9, 4, 3], 2, min_n=2) == []
    assert ngram_lookup([3, 9, 4, 3], 2, min_n=1) == [9, 4]


def test_prefers_longest_n_then_latest_match() -> None:
    # Suffix [1, 2]: the 2-gram occurs at 0 (-> 7) and the 1-gram [2] later at 5 (-> 8).
    tokens = [1, 2, 7, 7, 3, 2, 8, 1, 2]
    assert ngram_lookup(tokens, 1) == [7]
    assert ngram_lookup(tokens, 1, max_n=1) == [8]
    # Two occurrences of the 3-gram [4, 5, 6]: the latest one wins.
    tokens = [4, 5, 6, 1, 0, 4, 5, 6, 2, 0, 4, 5, 6]
    assert ngram_lookup(tokens, 2, max_n=3) == [2, 0]


def test_caps_at_num_tokens_and_handles_overlap() -> None:
    tokens = [9] * 8
    assert ngram_lookup(tokens, 3) == [9]  # latest earlier match ends right before the suffix
    tokens = list(range(20)) + list(range(10))
    assert ngram_lookup(tokens, 4) == [10, 11, 12, 13]


def reference_lookup(tokens: list[int], num: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """The rule in ``ngram_lookup``'s docstring, written plainly: longest n first, then the
    latest earlier start i < L - n whose n tokens equal the last n."""
    length = len(tokens)
    if num <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        for i in range(length - n - 1, -1, -1):
            if tokens[i : i + n] == tokens[length - n :]:
                return tokens[i + n : i + n + num]
    return []


def test_matches_the_plain_rule_on_many_small_histories() -> None:
    rng = random.Random(0)
    for _ in range(2000):  # a 3-token vocabulary: matches everywhere, ties, overlaps
        tokens = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        num, min_n = rng.randrange(0, 6), rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        assert ngram_lookup(tokens, num, min_n, max_n) == \
            reference_lookup(tokens, num, min_n, max_n), (tokens, num, min_n, max_n)


def test_32k_history_finds_the_one_earlier_occurrence() -> None:
    """How long these lookups take is measured by bench/ngram_lookup.py, not asserted here."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32_000, (32_768,), generator=gen).tolist()
    tokens[-4:] = tokens[1000:1004]
    proposer = NgramProposer(min_n=1, max_n=4)
    proposals = proposer.propose([req(tokens, 5, str(i)) for i in range(8)])
    assert all(p.token_ids == tokens[1004:1009] and p.probs is None for p in proposals)
    assert ngram_lookup(tokens, 5) == reference_lookup(tokens, 5)
    # Worst case for candidate filtering: one token repeated, every position is a candidate;
    # the latest earlier 4-gram ends right before the last token.
    assert ngram_lookup([7] * 32_768, 4) == [7]
    assert ngram_lookup([7] * 32_768 + [8], 4) == []  # 8 never occurred before


def test_registry_and_batching() -> None:
    proposer = make_proposer("ngram", max_n=2)
    assert isinstance(proposer, NgramProposer) and proposer.max_n == 2
    proposer.rollback("r", 3)  # default hooks are no-ops
    proposer.free("r")
    with pytest.raises(ValueError, match="unknown proposer"):
        make_proposer("nope")
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=3, max_n=2)

    @register_proposer("test-fixed")
    class Fixed(Proposer):
        def propose(self, requests: object) -> list[Proposal]:
            return [Proposal([1, 2], torch.full((2, 4), 0.25))]

    assert make_proposer("test-fixed").__class__ is Fixed
    tokens, num, probs = batch_proposals(
        [Proposal([3], None), Proposal([1, 2], torch.full((2, 4), 0.25)), Proposal([], None)], 4
    )
    assert tokens.tolist() == [[3, 0], [1, 2], [0, 0]] and num.tolist() == [1, 2, 0]
    assert probs is not None and probs[0, 0].tolist() == [0, 0, 0, 1.0]
    assert probs[1].sum().item() == 2.0 and probs[2].sum().item() == 0
    assert batch_proposals([Proposal([3], None)], 4)[2] is None
