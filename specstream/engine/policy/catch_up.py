"""The draft's catching up: what drafting costs once per request, before its first drafts.

Before drafting, a draft model feeds the tokens it has not seen (a request that never drafted:
its sinks and window). The scheduler counts them per request over the tokens it may still
generate (a prompt's too, where the step takes its last prefill chunk); that share of the
draft's time per token caught up on (measured on steps that mostly caught up; before, the
target's prefill time per token scaled by the draft's share of the parameters) counts in every
drafting round, times the tokens E a request gets from it: room / E rounds share the cost
(``RoundCosts.draft_setup_s``). An exploration is skipped where catching up costs over
``RoundShaper.explore_share`` of the rounds it serves. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CatchUp:
    # The draft's time per token it catches up on: measured on steps whose drafting was mostly
    # catching up (their seconds and tokens, decayed sums); before, ``prior``
    token_s: float = 0.0
    fed_s: float = 0.0
    fed: float = 0.0

    def measure(self, seconds: float, tokens: int) -> None:
        """A step whose drafting was mostly catching up on ``tokens``, in ``seconds`` (its
        forwards taken off). By tokens: a few tokens' feed keeps forwards an unmeasured draft
        line cannot take off (c01: 64 read 0.091 ms a token, a 1,024-token prompt 0.062)."""
        self.fed_s = 0.7 * self.fed_s + max(0.0, seconds)
        self.fed = 0.7 * self.fed + tokens
        self.token_s = self.fed_s / self.fed

    def prior(self, token_s: float) -> None:
        """The engine's estimate of a token's cost, until one is measured."""
        if not self.fed:
            self.token_s = 0.7 * self.token_s + 0.3 * token_s if self.token_s else token_s

    def seconds(self, tokens: float) -> float:
        return self.token_s * tokens
