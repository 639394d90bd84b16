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
