"""Engine configuration: one frozen dataclass, validated once; modes as a small registry."""

from __future__ import annotations

from dataclasses import dataclass

from specstream.sampling_params import MAX_SPECULATIVE_TOKENS


@dataclass(frozen=True)
class ModeSpec:
    """What one engine mode does; modes differ only in schedule, never in output."""

    name: str
    # True: history past offload_after_tokens lives in the host tier.
    offload: bool
    # How host history reaches attention: "none", "restore" (whole layer restored, then
    # attention; the next layer prefetched meanwhile) or "stream" (chunks attended as they land).
    history: str
    # Whether rounds verify draft tokens.
    speculative: bool
    # Devices the mode occupies (parallel-spec drafts on a second one).
    devices: int = 1
    # "sequential": draft after verification; "gaps": draft overlaps the link (specstream);
    # "parallel": draft on a second device.
    drafting: str = "sequential"


MODES: dict[str, ModeSpec] = {
    m.name: m
    for m in (
        ModeSpec("resident", offload=False, history="none", speculative=True),
        ModeSpec("offload", offload=True, history="restore", speculative=False),
        ModeSpec("stream", offload=True, history="stream", speculative=False),
        ModeSpec("offload-spec", offload=True, history="restore", speculative=True),
        ModeSpec("specstream", offload=True, history="stream", speculative=True, drafting="gaps"),
        ModeSpec(
            "parallel-spec", offload=True, history="restore", speculative=True, devices=2,
            drafting="parallel",
        ),
    )
}

GiB = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from. Facts found at run time live in the engine."""

    mode: str = "resident"
    device: str = "cpu"
    dtype: str = "auto"
    # KV blocks: tokens per block in both tiers.
    block_size: int = 128
    # Device memory for KV: resident tails, staging buffers (and, in `restore` modes, the
    # restored layers). None = 4 GiB on cpu.
    device_kv_bytes: int | None = None
    # Host memory for offloaded KV.
    host_kv_bytes: int = 8 * GiB
    resident_tail_tokens: int = 512
    offload_after_tokens: int = 8192
    chunk_tokens: int = 2048
    staging_buffers: int = 2
    # Emulated link bandwidth (GB/s) for the cpu backend; None = copies at memory speed.
    link_gbps: float | None = None
    max_num_seqs: int = 64
    # Tokens of prefill a step may carry (prefill is chunked by this).
    max_prefill_tokens: int = 1024
    # Draft tokens per round (q); 0 disables speculation.
    num_speculative_tokens: int = 0
    # "draft" (a draft model, needs draft_model) or "ngram".
    proposer: str | None = None
    draft_model: str | None = None
    # Draft KV policy: "window" (attention sinks + recent window) or "full".
    draft_cache: str = "window"
    draft_window_tokens: int = 1024
    draft_sink_tokens: int = 4
    # Intra-op threads for compute on cpu (1 leaves a core to the copy thread).
    compute_threads: int | None = 1
    # Seeds the global generator that requests without their own seed sample from.
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose from {sorted(MODES)}")
        positive = ("block_size", "host_kv_bytes", "chunk_tokens", "staging_buffers",
                    "max_num_seqs", "max_prefill_tokens", "draft_window_tokens")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.device_kv_bytes is not None and self.device_kv_bytes <= 0:
            raise ValueError(f"device_kv_bytes must be > 0, got {self.device_kv_bytes}")
        if self.resident_tail_tokens < 0 or self.offload_after_tokens < 0:
            raise ValueError("resident_tail_tokens and offload_after_tokens must be >= 0")
        if self.chunk_tokens % self.block_size:
            raise ValueError(
                f"chunk_tokens ({self.chunk_tokens}) must be a multiple of block_size "
                f"({self.block_size})"
            )
        if self.link_gbps is not None and self.link_gbps <= 0:
            raise ValueError(f"link_gbps must be > 0, got {self.link_gbps}")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens}"
            )
        if self.proposer not in (None, "draft", "ngram"):
            raise ValueError(f"proposer must be 'draft' or 'ngram', got {self.proposer!r}")
        if self.proposer == "draft" and not self.draft_model:
            raise ValueError("proposer 'draft' needs draft_model (a model folder)")
        if self.draft_cache not in ("window", "full"):
            raise ValueError(f"draft_cache must be 'window' or 'full', got {self.draft_cache!r}")
        if self.compute_threads is not None and self.compute_threads < 1:
            raise ValueError(f"compute_threads must be >= 1, got {self.compute_threads}")

    @property
    def mode_spec(self) -> ModeSpec:
        return MODES[self.mode]

    @property
    def speculative(self) -> bool:
        return (
            self.mode_spec.speculative
            and self.num_speculative_tokens > 0
            and self.proposer is not None
        )

    @property
    def device_budget(self) -> int:
        return self.device_kv_bytes if self.device_kv_bytes is not None else 4 * GiB
