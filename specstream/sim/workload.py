"""Workload (what requests arrive) and acceptance model (how many tokens a round yields)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    """Requests: a context-length distribution, an output length, and either a fixed number in
    flight (closed loop, all queued at t=0) or a Poisson arrival rate (open loop)."""

    context_lengths: tuple[int, ...]  # prompt lengths the distribution draws from
    output_len: int = 512  # tokens generated per request
    concurrency: int | None = 16  # max requests in flight (None: only memory limits it)
    arrival_rate: float | None = None  # requests/s; None = all arrive at t=0
    num_requests: int | None = None  # None: 2 x concurrency (closed) or 64 (open)
    weights: tuple[float, ...] | None = None  # probabilities of context_lengths; None = uniform
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.context_lengths or min(self.context_lengths) < 1:
            raise ValueError("context_lengths must be a non-empty tuple of positive ints")
        if self.output_len < 1:
            raise ValueError("output_len must be >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.arrival_rate is not None and self.arrival_rate <= 0:
            raise ValueError("arrival_rate must be positive")
        if self.concurrency is None and self.arrival_rate is None:
            raise ValueError("give a concurrency, an arrival rate, or both")
        if self.weights is not None and (
            len(self.weights) != len(self.context_lengths) or min(self.weights) < 0
            or sum(self.weights) <= 0
        ):
            raise ValueError("weights must be non-negative, one per context length")

    @property
    def total_requests(self) -> int:
        if self.num_requests is not None:
            return self.num_requests
        return 2 * self.concurrency if self.arrival_rate is None and self.concurrency else 64

    @property
    def mean_context(self) -> float:
        w = np.ones(len(self.context_lengths)) if self.weights is None else np.array(self.weights)
        return float(np.dot(w / w.sum(), self.context_lengths))

    @property
    def max_context(self) -> int:
        return max(self.context_lengths)

    def requests(self) -> list[tuple[float, int]]:
        """(arrival time, context length) per request, reproducible from ``seed``."""
        rng = np.random.default_rng(self.seed)
        n = self.total_requests
        p = None if self.weights is None else np.array(self.weights) / sum(self.weights)
        if len(self.context_lengths) == 1:
            ctx = [self.context_lengths[0]] * n
        else:
            ctx = [int(c) for c in rng.choice(self.context_lengths, size=n, p=p)]
        if self.arrival_rate is None:
            return [(0.0, c) for c in ctx]
        times = np.cumsum(rng.exponential(1.0 / self.arrival_rate, size=n))
        return [(float(t), c) for t, c in zip(times, ctx, strict=True)]


@dataclass(frozen=True)
class AcceptanceModel:
    """Expected tokens a request gains per verification round with q drafts.

    Either a per-token acceptance rate ``alpha`` (i.i.d. acceptances, Leviathan et al. 2023):
    E[tokens] = (1 - alpha^(q+1)) / (1 - alpha), the bonus token included; or a measured
    histogram ``accepted_counts[k]`` = rounds in which k of ``measured_q`` drafts were accepted,
    which gives acceptance by position (``position_rates``): exact at its own q, its last
    position's rate beyond it.
    """

    alpha: float | None = None
    accepted_counts: tuple[int, ...] | None = None  # index k = number of drafts accepted
    measured_q: int | None = None

    def __post_init__(self) -> None:
        if (self.alpha is None) == (self.accepted_counts is None):
            raise ValueError("give exactly one of alpha or accepted_counts")
        if self.alpha is not None and not 0 <= self.alpha < 1:
            raise ValueError("alpha must be in [0, 1)")
        if self.accepted_counts is not None:
            if sum(self.accepted_counts) <= 0 or min(self.accepted_counts) < 0:
                raise ValueError("accepted_counts must be non-negative with a positive sum")
            if self.measured_q is None or self.measured_q != len(self.accepted_counts) - 1:
                raise ValueError("measured_q must equal len(accepted_counts) - 1")

    @classmethod
    def from_mean(cls, mean_tokens: float, q: int) -> AcceptanceModel:
        """The i.i.d. per-token acceptance whose rounds of q drafts yield ``mean_tokens``
        tokens (accepted + bonus) on average. Not accepted / proposed drafts: a chain stops
        at its first rejection, so that ratio is lower than the per-token rate."""
        if q < 1 or not 1.0 <= mean_tokens <= q + 1:
            raise ValueError(f"mean tokens per round must be in [1, q + 1], got {mean_tokens}")
        lo, hi = 0.0, 1.0 - 1e-9
        for _ in range(60):  # closed_form is increasing in alpha: bisect
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if cls.closed_form(mid, q) < mean_tokens else (lo, mid)
        return cls(alpha=(lo + hi) / 2)

    @classmethod
    def from_depth_means(cls, runs: Sequence[tuple[float, Mapping[int, int]]]) -> AcceptanceModel:
        """The i.i.d. per-token acceptance that best explains several runs' mean tokens per
        round, each run's rounds at the depths it chose (``{depth: rounds}``, as the engine's
        ``speculative_depth_chosen``; depth 0 yields one token): the alpha at which the runs'
        expected means exceed theirs as much as they fall short. A run whose rounds were
        shallower than q reached its mean with fewer drafts, so it implies a higher alpha than
        ``from_mean`` at q would."""
        runs = [(m, {int(d): n for d, n in h.items() if n > 0}) for m, h in runs]
        if not runs or any(not h or min(h) < 0 for _, h in runs):
            raise ValueError("every run needs rounds at non-negative depths")

        def excess(alpha: float) -> float:
            return sum(sum(n * cls.closed_form(alpha, d) for d, n in h.items())
                       / sum(h.values()) - mean for mean, h in runs)
        lo, hi = 0.0, 1.0 - 1e-9
        for _ in range(60):  # every closed form is increasing in alpha: bisect
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
        return cls(alpha=(lo + hi) / 2)

    @staticmethod
    def closed_form(alpha: float, q: int) -> float:
        """(1 - alpha^(q+1)) / (1 - alpha): accepted drafts plus the bonus token."""
        return float(q + 1) if alpha >= 1 else (1 - alpha ** (q + 1)) / (1 - alpha)

    @property
    def measured_mean(self) -> float | None:
        """Mean tokens per round (accepted + 1) of the histogram."""
        if self.accepted_counts is None:
            return None
        counts = np.array(self.accepted_counts, dtype=float)
        return float(np.dot(np.arange(len(counts)), counts) / counts.sum()) + 1.0

    @property
    def effective_alpha(self) -> float:
        """alpha itself, or the alpha whose closed form matches the histogram's mean."""
        if self.alpha is not None:
            return self.alpha
        target, q = self.measured_mean, self.measured_q
        assert target is not None and q is not None
        lo, hi = 0.0, 1.0 - 1e-9
        for _ in range(60):  # closed_form is increasing in alpha: bisect
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.closed_form(mid, q) < target else (lo, mid)
        return (lo + hi) / 2

    def position_rates(self, depth: int) -> list[float]:
        """Acceptance of each draft position 1..depth given that the ones before it were
        accepted. ``alpha``: alpha at every position. A histogram: P(>= k) / P(>= k - 1) of the
        measured rounds (acceptance falls with position when the draft drifts), its last rate
        past ``measured_q``; a position no measured round reached gets the implied alpha."""
        if self.accepted_counts is None:
            assert self.alpha is not None
            return [self.alpha] * depth
        counts = np.array(self.accepted_counts, dtype=float)
        reach = counts[::-1].cumsum()[::-1]  # reach[k]: rounds with >= k accepted
        rates = [float(reach[k] / reach[k - 1]) if reach[k - 1] > 0 else self.effective_alpha
                 for k in range(1, len(counts))]
        return [rates[min(k, len(rates) - 1)] for k in range(depth)]

    def expected_tokens(self, q: int) -> float:
        """Tokens per request per round with q drafts (1 when q == 0: plain decoding): one plus
        the probability of reaching each position, from ``position_rates`` (exactly the
        histogram's mean at its own q; the closed form with ``alpha``)."""
        if q < 0:
            raise ValueError("q must be >= 0")
        total, reach = 1.0, 1.0
        for rate in self.position_rates(q):
            reach *= rate
            total += reach
        return total
