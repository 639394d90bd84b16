"""Per-request sampling parameters (vLLM-like), validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Upper bound on a per-request override of the engine's number of draft tokens per round.
MAX_SPECULATIVE_TOKENS = 16
# Seeds are what torch.Generator.manual_seed takes: a signed or unsigned 64-bit integer.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


def derive_seed(seed: int, offset: int) -> int:
    """A seed for a derived stream (the i-th of n choices, the draft's own generator): the
    seed plus ``offset``, wrapped into [0, 2**64), so no derived seed can overflow."""
    return (seed + offset) % (1 << 64)


def _check_type(name: str, value: object, kind: type | tuple[type, ...]) -> None:
    # bool is an int in Python, but `max_tokens=True` is a mistake, not a request for 1 token
    if isinstance(value, bool) or not isinstance(value, kind):
        want = "an integer" if kind is int else "a number"
        raise TypeError(f"{name} must be {want}, got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Greedy decoding is the special case ``temperature == 0`` (or ``top_k == 1``); every sampling
    path in the engine treats it as a one-hot distribution, so there is no separate greedy code.
    """

    # Softmax temperature; 0 means greedy (argmax).
    temperature: float = 1.0
    # Keep only the k most likely tokens; 0 or -1 disables the filter.
    top_k: int = 0
    # Nucleus sampling: keep the smallest set of tokens with cumulative probability >= top_p.
    top_p: float = 1.0
    # Seed of the request's own torch.Generator; None draws from the global generator.
    seed: int | None = None
    # Maximum number of generated tokens.
    max_tokens: int = 16
    # Stop strings; a single string or a list is normalised to a tuple.
    stop: tuple[str, ...] | list[str] | str | None = None
    # Token ids that end generation (in addition to eos unless ignore_eos).
    stop_token_ids: tuple[int, ...] = ()
    # Keep generating past the eos token.
    ignore_eos: bool = False
    # Per-request override of the engine's q (draft tokens per round); 0 disables speculation.
    num_speculative_tokens: int | None = None
    # Number of completions for the prompt.
    n: int = 1

    def __post_init__(self) -> None:
        for name in ("top_k", "max_tokens", "n"):
            _check_type(name, getattr(self, name), int)
        for name in ("temperature", "top_p"):
            _check_type(name, getattr(self, name), (int, float))
        for name in ("seed", "num_speculative_tokens"):
            if getattr(self, name) is not None:
                _check_type(name, getattr(self, name), int)
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}] (a 64-bit integer), "
                             f"got {self.seed}")
        if math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not -1 <= self.top_k < 1 << 31:
            raise ValueError(f"top_k must be -1, 0 (off) or in [1, 2**31), got {self.top_k!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n!r}")
        q = self.num_speculative_tokens
        if q is not None and not 0 <= q <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {q!r}"
            )
        # Normalising in __post_init__ is the one place a frozen dataclass may set its fields.
        stop = self.stop
        if stop is None:
            stop_tuple: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stop_tuple = (stop,)
        else:
            stop_tuple = tuple(stop)
        for s in stop_tuple:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        object.__setattr__(self, "stop", stop_tuple)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def top_k_enabled(self) -> bool:
        """True when the top-k filter is active."""
        return self.top_k > 0
