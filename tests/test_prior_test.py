"""The round-shape policy reads the data alone where the first candidate's hits reject the
prior's rate (``below_rate``, a one-sided binomial tail): a draft that misses stops drafting
within a few rounds, one that matches keeps the prior's caution."""

from __future__ import annotations

import math

from test_shaping import _feed

from specstream.engine.policy.estimators import below_rate
from specstream.engine.policy.shaping import RoundShaper


def test_below_rate_is_the_binomial_tail():
    for rate in (0.3, 0.6, 0.75):
        for n in range(1, 25):
            for k in range(n + 1):
                tail = sum(math.comb(n, i) * rate**i * (1 - rate) ** (n - i)
                           for i in range(k + 1))
                expected = k < n * rate and tail < 0.05
                assert below_rate(k, n, rate) == expected, (k, n, rate)
    assert below_rate(0, 4, 0.6) and not below_rate(0, 3, 0.6)  # 0.026 and 0.064
    assert below_rate(0.4, 3.6, 0.6)  # decayed counts are rounded: 0 in 4
    assert not below_rate(0, 0, 0.6) and not below_rate(5, 40, 1.0)


def test_a_draft_that_matches_keeps_its_prior_and_its_depth():
    """A draft at the prior's rate (0.6, text): its hits do not reject the prior, decisions
    read the estimate with its prior, and a link-bound round keeps drafting deep; the same
    rounds at 0.1 (random ids) reject it and stop drafting."""
    good = RoundShaper(max_depth=16, drafting="gaps")
    _feed(good, 40, link_s=0.8, verify=(0.005, 0.0002), draft=(0.004, 0.0001), accept=0.6)
    assert good._acceptance() is good.acceptance
    assert good.shape(8).depth >= 4
    bad = RoundShaper(max_depth=16, drafting="sequential")
    _feed(bad, 40, link_s=0.0, verify=(0.01, 0.004), draft=(0.01, 0.004), accept=0.1)
    assert bad._acceptance() is not bad.acceptance
    assert bad._acceptance().pooled(0) < 0.2
    assert [bad.shape(8).depth for _ in range(8)].count(0) >= 7


def test_the_data_led_estimate_follows_the_counts_it_was_made_from():
    """The data-led estimate is kept while nothing is observed, and made again when the counts
    change or the estimate is replaced (as the catch-up tests do)."""
    shaper = RoundShaper(max_depth=4, drafting="sequential")
    for _ in range(5):
        shaper.acceptance.observe_chain(4, 0)
    led = shaper._acceptance()
    assert led is not shaper.acceptance and shaper._acceptance() is led
    shaper.acceptance.observe_chain(4, 4)
    again = shaper._acceptance()
    assert again is not led and again.pooled(0) > led.pooled(0)
