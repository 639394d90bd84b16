"""Engine policy the simulator assumes, and the five modes.

Defaults follow the public reference implementation (design.md): 2048-token chunks, two staging
buffers, a 512-token resident tail, offloading only past 8192 tokens, q in {1,2,4,6,8}, a 5%
slowdown budget for co-running the draft. Residency defaults to ``fill`` (issue 17): the device
memory left over holds the newest history of the running requests, and only the rest streams;
``tail`` is the reference implementation's fixed tail.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES: tuple[str, ...] = ("resident", "offload", "offload-spec", "specstream", "parallel-spec")
# Ablations the engine has no mode for. offload-spec-restore-all: restore the whole history,
# then verify, then draft, nothing overlapped (what many offloading systems do); the engine's
# offload-spec restores layer by layer with the next layer prefetched. Same memory plan.
# specstream-sequential: specstream's streamed verification with the drafts run after it on the
# same stream, one group (the engine's specstream with drafting "sequential": the ladder's
# "+ streaming" step). Same memory plan as specstream.
ABLATIONS: tuple[str, ...] = ("offload-spec-restore-all", "specstream-sequential")
OFFLOAD_MODES = frozenset({"offload", "offload-spec", "specstream", "parallel-spec", *ABLATIONS})
SPEC_MODES = frozenset({"resident", "offload-spec", "specstream", "parallel-spec", *ABLATIONS})
RESTORE_MODES = frozenset({"offload", "offload-spec", "parallel-spec",  # restore, not stream
                           "offload-spec-restore-all"})
STREAM_MODES = frozenset({"specstream", "specstream-sequential"})  # chunks through staging
RESIDENCIES: tuple[str, ...] = ("fill", "tail")


@dataclass(frozen=True)
class SimPolicy:
    """Knobs of the engine being simulated (one per field, as the engine's own config)."""

    q: int | None = None  # drafts per round; None = best of q_choices, per mode
    q_choices: tuple[int, ...] = (1, 2, 4, 6, 8)
    chunk_tokens: int = 2048  # tokens of cold history per streamed chunk (per request, per layer)
    staging_buffers: int = 2  # chunk slots on the device: the link runs at most this far ahead
    resident_tail: int = 512  # newest tokens of an offloaded request kept on the device
    offload_threshold: int = 8192  # tail: requests up to this many tokens stay fully resident
    # offload modes: "tail" keeps only resident_tail (or the whole request up to
    # offload_threshold) on the device; "fill" also lends the device memory left after weights,
    # draft KV and staging/restore room to the running requests' newest history, shared by
    # water-filling (memory.plan), so only the overflow crosses the link
    residency: str = "fill"
    draft_window: int | None = 4096  # draft KV kept per request (sink + recent); None = all
    corun_slowdown: float = 0.05  # verify slowdown while the draft co-runs on the same device
    groups: int = 2  # ping-pong groups (specstream, parallel-spec)
    rounds: int = 3  # rounds simulated per steady-state estimate (>= 2)
    context_bucket: int = 256  # round times are cached per context rounded to this
    # streamed modes: "auto" has the host CPU attend the share of each request's cold history
    # that makes the host and the link finish together (sim/host.py), where that is faster
    # than streaming it all; "off" streams everything (as the engine's default)
    host_attention: str = "off"

    def __post_init__(self) -> None:
        if self.q is not None and self.q < 0:
            raise ValueError("q must be >= 0")
        if not self.q_choices or min(self.q_choices) < 1:
            raise ValueError("q_choices must be positive")
        if self.chunk_tokens < 1 or self.staging_buffers < 1:
            raise ValueError("chunk_tokens and staging_buffers must be >= 1")
        if self.resident_tail < 0 or self.offload_threshold < 0:
            raise ValueError("resident_tail and offload_threshold must be >= 0")
        if self.draft_window is not None and self.draft_window < 1:
            raise ValueError("draft_window must be >= 1 or None")
        if not 0 <= self.corun_slowdown < 1:
            raise ValueError("corun_slowdown must be in [0, 1)")
        if self.groups < 1 or self.rounds < 2 or self.context_bucket < 1:
            raise ValueError("groups >= 1, rounds >= 2, context_bucket >= 1")
        if self.host_attention not in ("off", "auto"):
            raise ValueError(f"host_attention must be 'off' or 'auto', "
                             f"got {self.host_attention!r}")
        if self.residency not in RESIDENCIES:
            raise ValueError(f"residency must be one of {', '.join(RESIDENCIES)}, "
                             f"got {self.residency!r}")

    def candidate_qs(self, mode: str) -> tuple[int, ...]:
        """q values tried for a mode: 0 for plain decoding, else the fixed q or the choices."""
        if mode not in SPEC_MODES:
            return (0,)
        return (self.q,) if self.q is not None else self.q_choices

    def resident_floor(self, mode: str, context: float) -> float:
        """Tokens of a request that stay on the device at least: all of it in ``resident``;
        in ``tail``, all of it up to ``offload_threshold``, past it the ``resident_tail``; in
        ``fill``, the ``resident_tail`` (the threshold does not apply: the share decides, as
        in the engine)."""
        if mode not in OFFLOAD_MODES:
            return context
        if self.residency == "tail" and context <= self.offload_threshold:
            return context
        return min(context, float(self.resident_tail))

    def cold_tokens(self, mode: str, context: float, share: float = 0.0) -> float:
        """Tokens of a request's history on the host, streamed (or restored) every round.

        ``share``: the ``fill`` residency level of the batch (``memory.plan``): a request keeps
        its newest max(floor, share) tokens on the device. 0 (the ``tail`` residency): only
        the floor stays."""
        if mode not in OFFLOAD_MODES:
            return 0.0
        return max(0.0, context - max(self.resident_floor(mode, context), share))

    def draft_tokens(self, context: float) -> float:
        """Tokens of draft KV a request keeps (the draft's cache is resident, windowed)."""
        return context if self.draft_window is None else min(context, self.draft_window)


def check_mode(mode: str) -> str:
    if mode not in MODES and mode not in ABLATIONS:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES + ABLATIONS)}")
    return mode
