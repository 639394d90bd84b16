"""Per-request sampling parameters (vLLM-like), validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specstream.structured.grammar import Constraint

# Upper bound on a per-request override of the engine's number of draft tokens per round.
MAX_SPECULATIVE_TOKENS = 16
# Seeds are what torch.Generator.manual_seed takes: a signed or unsigned 64-bit integer.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
# vLLM takes any positive repetition penalty; past this one a logit is all but erased.
MAX_REPETITION_PENALTY = 100.0


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
    """How one request is decoded; field names and meanings as vLLM's ``SamplingParams``.

    Greedy decoding is the special case ``temperature == 0`` (or ``top_k == 1``); every sampling
    path in the engine treats it as a one-hot distribution, so there is no separate greedy code.

    The logits of every position are processed in vLLM's order: ``logit_bias`` and
    ``min_tokens`` (stop tokens masked while too few tokens were generated), then the
    repetition, frequency and presence penalties, then (greedy: argmax here) temperature,
    ``min_p``, ``top_k`` and ``top_p``. Under speculation every draft position is processed as
    if the drafts before it had been generated (``sampling.LogitsContext``), so the output
    distribution is the one target-only decoding with the same parameters has.
    """

    # Softmax temperature; 0 means greedy (argmax).
    temperature: float = 1.0
    # Keep only the k most likely tokens; 0 or -1 disables the filter.
    top_k: int = 0
    # Nucleus sampling: keep the smallest set of tokens with cumulative probability >= top_p.
    top_p: float = 1.0
    # Drop tokens whose probability (after temperature) is below min_p times the most likely
    # token's; 0 disables the filter.
    min_p: float = 0.0
    # Seed of the request's own torch.Generator; None draws from the global generator.
    seed: int | None = None
    # Maximum number of generated tokens.
    max_tokens: int = 16
    # Tokens generated before eos or a stop token may end the request (they are masked).
    min_tokens: int = 0
    # Stop strings; a single string or a list is normalised to a tuple.
    stop: tuple[str, ...] | list[str] | str | None = None
    # Token ids that end generation (in addition to eos unless ignore_eos).
    stop_token_ids: tuple[int, ...] | list[int] = ()
    # Keep generating past the eos token.
    ignore_eos: bool = False
    # Keep the stop string that ended the request in its text.
    include_stop_str_in_output: bool = False
    # Leave special tokens out of the text.
    skip_special_tokens: bool = True
    # OpenAI's penalties over the generated tokens: the logit of a token that was generated c
    # times falls by c * frequency_penalty + (c > 0) * presence_penalty. In [-2, 2].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (CTRL's) penalty over prompt and generated tokens: a positive logit of such a
    # token is divided by it, a negative one multiplied; 1 disables it.
    repetition_penalty: float = 1.0
    # Added to the logit of each token id (OpenAI clamps to [-100, 100]).
    logit_bias: dict[int, float] | None = None
    # Log-probabilities to return per generated token: the sampled token's and the
    # ``logprobs`` most likely ones (the target's raw log-softmax, as vLLM's default
    # logprobs_mode); None returns none.
    logprobs: int | None = None
    # The same per prompt token (the first has none); None returns none.
    prompt_logprobs: int | None = None
    # Per-request override of the engine's q (draft tokens per round); 0 disables speculation.
    num_speculative_tokens: int | None = None
    # Number of completions for the prompt.
    n: int = 1
    # The output's shape: a JSON schema, a regex, a choice, a grammar (specstream.structured;
    # every logits row, draft positions included, masked by the grammar's state there).
    structured: Constraint | None = None
    # vLLM's candidates per prompt; only None or n (every candidate returned) is served.
    best_of: int | None = None

    def __post_init__(self) -> None:
        for name in ("top_k", "max_tokens", "min_tokens", "n"):
            _check_type(name, getattr(self, name), int)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _check_type(name, getattr(self, name), (int, float))
            if math.isnan(getattr(self, name)):
                raise ValueError(f"{name} must be a number, got nan")
        for name in ("seed", "num_speculative_tokens", "logprobs", "prompt_logprobs", "best_of"):
            if getattr(self, name) is not None:
                _check_type(name, getattr(self, name), int)
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}] (a 64-bit integer), "
                             f"got {self.seed}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not -1 <= self.top_k < 1 << 31:
            raise ValueError(f"top_k must be -1, 0 (off) or in [1, 2**31), got {self.top_k!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                             f"got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 (or None), got {value!r}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n!r}")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must be None or equal to n ({self.n}), got "
                             f"{self.best_of!r}: this engine returns every candidate it "
                             "generates")
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
        ids = []
        for t in self.stop_token_ids:
            _check_type("stop_token_ids", t, int)
            if t < 0:
                raise ValueError(f"stop_token_ids must be token ids (>= 0), got {t!r}")
            ids.append(int(t))
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.logit_bias is not None:
            bias = {}
            for tok, value in dict(self.logit_bias).items():
                _check_type("logit_bias keys", tok, int)
                _check_type("logit_bias values", value, (int, float))
                if tok < 0 or not math.isfinite(value):
                    raise ValueError(f"logit_bias must map token ids (>= 0) to finite numbers, "
                                     f"got {tok!r}: {value!r}")
                bias[int(tok)] = float(value)
            object.__setattr__(self, "logit_bias", bias or None)

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Some penalty depends on the tokens before each position."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """The logits change before temperature: a bias, a penalty, min_tokens or a grammar."""
        return (self.penalized or bool(self.logit_bias) or self.min_tokens > 0
                or self.structured is not None)
