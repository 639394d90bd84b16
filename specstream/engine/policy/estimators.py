"""The two estimators every measurement of the engine goes through: a moving average and a line.

Both are plain numbers (no tensors, no clocks): the engine and the simulator's replay feed them
the same measurements (``policy/feedback.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Ewma:
    """An exponentially weighted moving average: the first value as it is, then each new one
    with ``weight``."""

    weight: float = 0.3
    value: float = 0.0
    seen: bool = False

    def add(self, x: float) -> float:
        self.value = x if not self.seen else (1 - self.weight) * self.value + self.weight * x
        self.seen = True
        return self.value


@dataclass
class LineFit:
    """y = a + b x by exponentially weighted least squares (b >= 0)."""

    decay: float = 0.95
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    @property
    def spread(self) -> bool:
        """Points at more than one x."""
        return self.n * self.sxx - self.sx**2 > 1e-12

    def coef(self) -> tuple[float, float]:
        if self.n == 0:
            return 0.0, 0.0
        var = self.n * self.sxx - self.sx**2
        b = max(0.0, (self.n * self.sxy - self.sx * self.sy) / var) if var > 1e-12 else 0.0
        if var <= 1e-12:  # one x so far: all of it is the fixed part
            return self.sy / self.n, 0.0
        return max(0.0, (self.sy - b * self.sx) / self.n), b


@dataclass
class PlaneFit:
    """y = a + b1 x1 + b2 x2 by exponentially weighted least squares (b1, b2 >= 0).

    Where the points do not tell x1 and x2 apart (they moved together, or one is constant),
    ``prior_b2`` decides: b2 is drawn toward it with a weight of ``ridge`` times x2's own
    spread plus ``prior_points`` points one unit of x2 from the rest (a timing noise some
    times a unit's price needs that many to be read through). Both are nothing next
    to genuine spread in x2 at fixed x1, and all there is where x2 moved only with x1 or
    where its spread is a few faded points (one round of 2 query positions among rounds of
    1: its timing noise alone read a position as free, and a 32-node tree as free with it).
    Without a prior, points where x1 and x2 moved together are read as all x2 (the cautious
    reading: every unit of x2 costs alike)."""

    decay: float = 0.95
    ridge: float = 0.001
    prior_points: float = 8.0
    prior_b2: float | None = None
    min_spread: float = 0.05  # an x whose deviation is under this share of its mean is constant
    # x2 whose variance left at fixed x1 is under this share of its own moved with x1
    collinear: float = 0.1
    n: float = 0.0
    s1: float = 0.0
    s2: float = 0.0
    sy: float = 0.0
    s11: float = 0.0
    s12: float = 0.0
    s22: float = 0.0
    s1y: float = 0.0
    s2y: float = 0.0

    def add(self, x1: float, x2: float, y: float) -> None:
        d = self.decay
        for name, value in (("n", 1.0), ("s1", x1), ("s2", x2), ("sy", y), ("s11", x1 * x1),
                            ("s12", x1 * x2), ("s22", x2 * x2), ("s1y", x1 * y),
                            ("s2y", x2 * y)):
            setattr(self, name, d * getattr(self, name) + value)

    def moved(self, x: int) -> bool:
        """Whether x1 (``x`` = 1) or x2 (2) moved by more than ``min_spread`` of its mean
        (standard deviation over mean; see ``coef``)."""
        n = self.n
        s, ss = (self.s1, self.s11) if x == 1 else (self.s2, self.s22)
        if n == 0:
            return False
        m = s / n
        return ss - n * m * m > max(1e-9 * ss, n * (self.min_spread * m) ** 2)

    def coef(self) -> tuple[float, float, float]:
        """(a, b1, b2)."""
        n = self.n
        if n == 0:
            return 0.0, 0.0, 0.0
        m1, m2, my = self.s1 / n, self.s2 / n, self.sy / n
        c11, c12, c22 = self.s11 - n * m1 * m1, self.s12 - n * m1 * m2, self.s22 - n * m2 * m2
        c1y, c2y = self.s1y - n * m1 * my, self.s2y - n * m2 * my
        # an x that never moved (one request at a time) leaves a rounding residue in its
        # variance and covariances, not zeros: solved as spread, the residue's ratios priced
        # it at ~1e13 a unit. One that moved by a sliver of its size (a context of 64 tokens,
        # then 65) is no better: a timing jitter over that sliver priced 1K tokens of history
        # at seconds. Below ``min_spread`` of its mean (standard deviation) it has no spread.
        if not self.moved(1):
            c11 = c12 = c1y = 0.0
        if not self.moved(2):
            c22 = c12 = c2y = 0.0
        if self.prior_b2 is None:
            b1, b2 = self._unregularised(c11, c12, c22, c1y, c2y, m1, m2, my)
        else:
            lam = self.ridge * c22 + self.prior_points + 1e-12 * (1 + self.s22)
            b1, b2 = _solve2(c11, c12, c22 + lam, c1y, c2y + lam * self.prior_b2)
            if b1 < 0:  # all of it is x2's (toward the prior as above)
                b1, b2 = 0.0, (c2y + lam * self.prior_b2) / (c22 + lam)
            if b2 < 0:
                # x2 read as costing less than nothing: where x2 moved on its own (its spread
                # at fixed x1), that is the points saying it costs nothing; where it moved
                # almost only with x1 (verified requests at one depth: query positions and
                # history rise together, a jitter of a few tokens apart), it is noise, and
                # taking it as 0 priced query positions at nothing: 32-node trees in
                # compute-bound rounds (c01). There x2 is the prior's.
                alone = c22 - (c12 * c12 / c11 if c11 > 1e-12 else 0.0)
                b2 = 0.0 if alone > self.collinear * c22 else self.prior_b2
                b1 = max(0.0, (c1y - c12 * b2) / c11) if c11 > 1e-12 else 0.0
            b1, b2 = max(0.0, b1), max(0.0, b2)
            if c11 <= 1e-12 and c22 <= 1e-12:  # one point's worth: x2 at the prior
                b1, b2 = 0.0, self.prior_b2
            if my - b1 * m1 - b2 * m2 < 0:
                # the points' mean leaves less than the two slopes: the fixed part would be
                # negative. x1's slope gives way first: it is read across request counts,
                # where a round's regime changes with them (c01 as its requests finished:
                # rounds of 7 at 35 ms, then of 5 at 25, more than a request's slope), and
                # capping x2's instead priced a position at nothing. x2's after it: never
                # more than all of it.
                b1 = max(0.0, (my - b2 * m2) / m1) if m1 > 0 else 0.0
                b2 = min(b2, max(0.0, my - b1 * m1) / m2) if m2 > 0 else b2
        return max(0.0, my - b1 * m1 - b2 * m2), b1, b2

    def _unregularised(self, c11: float, c12: float, c22: float, c1y: float, c2y: float,
                       m1: float, m2: float, my: float) -> tuple[float, float]:
        det = c11 * c22 - c12 * c12
        if det > 1e-9 * max(1e-12, c11 * c22):
            b1, b2 = _solve2(c11, c12, c22, c1y, c2y)
            if b1 >= 0 and b2 >= 0:
                return b1, b2
        # collinear or a negative part: all of it x2's, through the origin when x2 is constant
        if c22 > 1e-12:
            return 0.0, max(0.0, c2y / c22)
        return 0.0, my / m2 if m2 > 0 else 0.0


def _solve2(a11: float, a12: float, a22: float, r1: float, r2: float) -> tuple[float, float]:
    """[a11 a12; a12 a22] [x1; x2] = [r1; r2] (0, r2 / a22 where singular)."""
    det = a11 * a22 - a12 * a12
    if abs(det) <= 1e-300:
        return 0.0, r2 / a22 if a22 else 0.0
    return (r1 * a22 - a12 * r2) / det, (a11 * r2 - a12 * r1) / det


def below_rate(hits: float, tries: float, rate: float, level: float = 0.05) -> bool:
    """Whether ``hits`` in ``tries`` (decayed counts, rounded) are so few that a rate of
    ``rate`` gives as few less than ``level`` of the time (the binomial tail P(X <= hits))."""
    n, k = round(tries), round(hits)
    if n <= 0 or not 0.0 < rate < 1.0 or k >= n * rate:
        return False
    term = tail = (1.0 - rate) ** n  # P(X = 0)
    for i in range(k):
        term *= (n - i) / (i + 1) * rate / (1.0 - rate)
        tail += term
    return tail < level
