"""Engine configuration: one frozen dataclass, validated once (what its defaults resolve to:
``specstream.defaults``; the modes: ``specstream.modes``)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from specstream.defaults import (
    AUTO_MAX_DEPTH,
    CPU_DEVICE_KV_BYTES,
    DEFAULT_SPECULATIVE_TOKENS,
    DEFAULT_TREE_NODES,
    DEFAULT_TREE_TOPK,
    MAX_TREE_NODES,
    GiB,
    default_offload_after,
    detect_device,
    spare_host_cores,
)
from specstream.modes import MODES, ModeSpec
from specstream.options import (
    AttentionBackend,
    Choice,
    DraftCache,
    Drafting,
    History,
    HostAttentionMode,
    Mode,
    Proposer,
    Residency,
    SpeculativePolicy,
)
from specstream.sampling_params import MAX_SPECULATIVE_TOKENS

# the defaults and the modes, importable from here as before
__all__ = ["AUTO_MAX_DEPTH", "CPU_DEVICE_KV_BYTES", "DEFAULT_SPECULATIVE_TOKENS",
           "DEFAULT_TREE_NODES", "DEFAULT_TREE_TOPK", "MAX_TREE_NODES", "MODES", "EngineConfig",
           "GiB", "ModeSpec", "default_offload_after", "detect_device", "spare_host_cores"]

@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from. Facts found at run time live in the engine."""

    # None (the default): the engine at its best, `specstream` where there is a proposer and
    # `stream` (the same streamed history, no drafts) where there is none; under `fill`, a
    # workload that fits the device moves nothing. The other modes are ablations and baselines.
    mode: Mode | None = None
    # "cpu", "cuda" / "cuda:N", or "auto" (the default, as vLLM's): CUDA when this torch sees a
    # CUDA device, else cpu; resolved once, here.
    device: str = "auto"
    dtype: str = "auto"
    # KV blocks: tokens per block in both tiers.
    block_size: int = 128
    # Device memory for KV: resident tails, staging buffers (and, in `restore` modes, the
    # restored layers). None: on CUDA gpu_memory_utilization of the memory free once the models
    # are loaded (vLLM's name; its fraction is of the whole device); on cpu CPU_DEVICE_KV_BYTES.
    device_kv_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # Host memory for offloaded KV.
    host_kv_bytes: int = 8 * GiB
    # Newest tokens of each request kept on the device (where new KV is written).
    resident_tail_tokens: int = 512
    # Offloading modes: which history stays on the device. "fill": the device KV blocks that
    # staging does not need hold the newest history of the running requests, shared equally
    # (each keeps at least its resident tail); only what does not fit crosses the link, and the
    # host tier holds every full block (written through once). "tail": each request keeps its
    # resident tail once past offload_after_tokens and streams everything older (the paper's
    # configuration; for ablations).
    residency: Residency = Residency.FILL
    # Automatic prefix caching (as vLLM's): full KV blocks stay cached in both tiers (LRU,
    # yielding to requests) for prompts that start with them (kvcache/prefix_cache.py).
    enable_prefix_caching: bool = True
    # Offloading modes with the prefix cache: host blocks join the cache as written back; a
    # prompt that starts with cached blocks references them (requests arriving together wait
    # for the first one's prefill of what they share); a shared block is held once and crosses
    # the link once a round for all its sharers (kvcache/manager.py). False: hits copy.
    prefix_sharing: bool = True
    # Attention over cold history on the host CPU (offloading modes): "off", or "auto" (each
    # step gives the host the share of every request's cold chunks that the measured host
    # attention rate and link rate finish together, nothing where the host is slower or the
    # round compute-bound; engine/exec/host_attention.py). None (the default): "auto" where
    # the host has cores the engine's own threads leave while a round waits on the link
    # (``spare_host_cores``: any machine of two cores or more), else "off".
    # host_attention_fraction fixes that share instead (for tests and ablations).
    host_attention: HostAttentionMode | None = None
    host_attention_fraction: float | None = None
    host_attention_threads: int | None = None  # its threads (None: the cores the engine leaves)
    # Emulated host attention rate on the cpu backend, GB/s of KV attended (as link_gbps is
    # the link's): each job takes at least its bytes at this rate, so a CPU run can take a
    # real server's link-to-host ratio (PCIe 5 ~50 GB/s against ~300-500 GB/s of a dual-socket
    # DDR5 host) instead of this machine's. None: as fast as the workers compute.
    host_attention_gbps: float | None = None
    # A request's history moves to the host once it passes this many tokens. None: derived
    # from the model by `default_offload_after` (a quarter of its context, at most 8192).
    offload_after_tokens: int | None = None
    # `stream` modes: tokens of a request's history per chunk; a chunk wave copies and attends
    # the j-th chunk of up to `wave_requests` requests, and the staging ring holds
    # `staging_buffers` waves (of one layer). None: 2048 where that ring fits in an eighth of
    # the budget, else halved down to 256 (engine/layout.py `auto_chunk_tokens`). A ring over
    # half the budget narrows to what half holds (`staging_ring`).
    chunk_tokens: int | None = None
    staging_buffers: int = 2
    wave_requests: int = 8
    # `specstream`: its two groups (one verifies while the other drafts in the transfer gaps)
    # merge into one while decode rounds' history takes the link less time than their
    # verification (policy/feedback.py, Estimates.link_bound). False: always two groups (the
    # behaviour before merging; for ablations).
    merge_groups: bool = True
    # Attention kernels: "torch", "triton" (on CPU tensors only under TRITON_INTERPRET=1), or
    # "auto" (Triton on CUDA when it is importable, torch otherwise).
    attention_backend: AttentionBackend = AttentionBackend.AUTO
    # Emulated link bandwidth (GB/s) for the cpu backend; None = copies at memory speed.
    link_gbps: float | None = None
    max_num_seqs: int = 64
    # Longest prompt + output a request may have (vLLM's max_model_len); None: the model's
    # context (max_position_embeddings). A larger value than the model's is refused.
    max_model_len: int | None = None
    # Tokens of prefill a step may carry (prefill is chunked by this).
    max_prefill_tokens: int = 1024
    # Draft tokens per round (q); None: with a proposer DEFAULT_SPECULATIVE_TOKENS under the
    # fixed policy and AUTO_MAX_DEPTH (the deepest the policy may go) under auto, else 0.
    # With token trees: the depth of a request's tree.
    num_speculative_tokens: int | None = None
    # Token trees (SGLang's --speculative-eagle-topk): children per expanded node of a
    # request's draft tree; 1 = a chain of num_speculative_tokens drafts (no tree). None: the
    # policy's to choose where the draft model proposes under speculative_policy auto (trees of
    # up to DEFAULT_TREE_TOPK children and DEFAULT_TREE_NODES nodes allowed), else 1.
    speculative_topk: int | None = None
    # Token trees: draft tokens (tree nodes) per request and round, the last accepted token not
    # counted (SGLang's --speculative-num-draft-tokens counts it). None: DEFAULT_TREE_NODES
    # where trees are allowed by default, else num_speculative_tokens (a chain's q). Each is a
    # query position of the round and a KV slot until acceptance.
    speculative_num_draft_tokens: int | None = None
    # "fixed": every round drafts num_speculative_tokens (a tree as configured). "auto":
    # before each round the engine chooses the shape (a chain of depth 0 = no speculation up
    # to num_speculative_tokens; with speculative_topk > 1 also trees of that branching up to
    # speculative_num_draft_tokens nodes) with the most expected tokens per second, from the
    # link, verification and draft time it measures and the acceptance it sees
    # (engine/policy/shaping.py). None (the default): "auto" where there is a proposer.
    speculative_policy: SpeculativePolicy | None = None
    # Ablations: the mode's drafting strategy replaced ("sequential": draft after verifying,
    # one group; "gaps": two groups, one drafting in the other's transfers). None: the mode's.
    # `specstream` with "sequential" is streaming without gap drafting.
    drafting: Drafting | None = None
    # "draft" (a draft model, needs draft_model) or "ngram".
    proposer: Proposer | None = None
    draft_model: str | None = None
    # Draft KV policy: "window" (attention sinks + recent window) or "full".
    draft_cache: DraftCache = DraftCache.WINDOW
    draft_window_tokens: int = 1024
    draft_sink_tokens: int = 4
    # Intra-op threads for compute on cpu (1 leaves a core to the copy thread).
    compute_threads: int | None = 1
    # Seeds the global generator that requests without their own seed sample from.
    seed: int = 0
    tensor_parallel_size: int = 1  # target ranks, a process each (engine/exec/ranks.py)

    def __post_init__(self) -> None:
        self._normalise()
        if not isinstance(self.device, str) or not (
                self.device == "cpu" or self.device.split(":")[0] == "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        positive = ("block_size", "host_kv_bytes", "staging_buffers",
                    "wave_requests", "max_num_seqs", "max_prefill_tokens", "draft_window_tokens",
                    "tensor_parallel_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.device_kv_bytes is not None and self.device_kv_bytes <= 0:
            raise ValueError(f"device_kv_bytes must be > 0, got {self.device_kv_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.resident_tail_tokens < 0 or (self.offload_after_tokens or 0) < 0:
            raise ValueError("resident_tail_tokens and offload_after_tokens must be >= 0")
        if self.chunk_tokens is not None and self.chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be > 0, got {self.chunk_tokens}")
        if self.chunk_tokens is not None and self.chunk_tokens % self.block_size:
            raise ValueError(f"chunk_tokens ({self.chunk_tokens}) must be a multiple of "
                             f"block_size ({self.block_size})")
        if self.link_gbps is not None and self.link_gbps <= 0:
            raise ValueError(f"link_gbps must be > 0, got {self.link_gbps}")
        if self.proposer is Proposer.DRAFT and not self.draft_model:
            raise ValueError("proposer 'draft' needs draft_model (a model folder)")
        q = self.q
        if not 0 <= q <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {q}")
        self._check_speculation(q)
        self._check_tree(q)
        self._check_policy()
        self._check_host_attention()
        self._check_drafting()
        if self.compute_threads is not None and self.compute_threads < 1:
            raise ValueError(f"compute_threads must be >= 1, got {self.compute_threads}")

    def _normalise(self) -> None:
        """Strings given for the named options become their types (``specstream.options``)
        and ``device="auto"`` the device this torch sees: the one place a frozen dataclass
        sets its own fields. Defaults that depend on other fields are properties (``q``,
        ``policy``), not filled in."""
        if self.device == "auto":
            object.__setattr__(self, "device", detect_device())
        if self.mode is None:
            object.__setattr__(self, "mode", Mode.SPECSTREAM if self.proposer else Mode.STREAM)
        if self.host_attention is None:
            spare = spare_host_cores(str(self.device).split(":")[0])
            object.__setattr__(self, "host_attention",
                               HostAttentionMode.AUTO if spare else HostAttentionMode.OFF)
        for f in fields(self):
            kind = _CHOICES.get(f.name)
            value = getattr(self, f.name)
            if kind is not None and value is not None and not isinstance(value, kind):
                if f.name == "mode" and value not in MODES:
                    raise ValueError(f"unknown mode {value!r}; choose from {sorted(MODES)}")
                object.__setattr__(self, f.name, kind.parse(f.name, value))

    def _check_speculation(self, q: int) -> None:
        """Speculation is on exactly when asked for, or the config is refused: never silently
        off."""
        spec = self.mode_spec
        if self.proposer and not spec.speculative:
            raise ValueError(
                f"mode {self.mode!r} does not speculate, so it takes no proposer: use "
                f"'offload-spec' or 'specstream' to speculate, or drop the proposer")
        if q and not self.proposer:
            raise ValueError(
                f"num_speculative_tokens={q} needs a proposer: proposer='draft' with a "
                "draft_model, or proposer='ngram'")
        if self.proposer and not q:
            raise ValueError(
                f"proposer {self.proposer!r} with num_speculative_tokens=0 would never draft; "
                "give q >= 1 or drop the proposer")
        if spec.needs_drafts and not self.proposer:
            plain = "stream" if spec.history is History.STREAM else "offload"
            raise ValueError(
                f"mode {self.mode!r} verifies drafts every round and needs a proposer "
                f"(proposer='draft' with a draft_model, or 'ngram'); mode {plain!r} decodes "
                "the same offloaded history without one")

    def _check_drafting(self) -> None:
        if self.drafting is None:
            return
        if self.drafting is Drafting.PARALLEL:
            raise ValueError(f"drafting must be 'sequential' or 'gaps' (or None: the mode's), "
                             f"got {self.drafting!r}")
        if not self.proposer or self.mode_spec.devices != 1:
            raise ValueError(f"drafting={self.drafting!r} replaces a one-device speculative "
                             f"mode's drafting; mode {self.mode!r} with proposer "
                             f"{self.proposer!r} has none to replace")

    def _check_host_attention(self) -> None:
        f = self.host_attention_fraction
        if f is not None and not 0.0 <= f <= 1.0:
            raise ValueError(f"host_attention_fraction must be in [0, 1], got {f}")
        if self.host_attention_gbps is not None and self.host_attention_gbps <= 0:
            raise ValueError(f"host_attention_gbps must be positive, got "
                             f"{self.host_attention_gbps}")
        if self.host_attention_threads is not None and self.host_attention_threads < 1:
            raise ValueError("host_attention_threads must be >= 1, got "
                             f"{self.host_attention_threads}")

    @property
    def host_attends(self) -> bool:
        """Some cold history may be attended on the host this run."""
        return self.mode_spec.offload and (self.host_attention is HostAttentionMode.AUTO
                                            or bool(self.host_attention_fraction))

    def _check_policy(self) -> None:
        if self.speculative_policy is SpeculativePolicy.AUTO and not self.proposer:
            raise ValueError("speculative_policy='auto' chooses how many drafts to verify and "
                             "needs a proposer")

    def _check_tree(self, q: int) -> None:
        """Token trees: a draft model's top-k children under a node budget of at least the
        depth; the n-gram proposer drafts chains only."""
        for name in ("speculative_topk", "speculative_num_draft_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an integer, got {value!r}")
        topk, budget = self.topk, self.speculative_num_draft_tokens
        if not 1 <= topk <= MAX_TREE_NODES:
            raise ValueError(f"speculative_topk must be in [1, {MAX_TREE_NODES}], got {topk}")
        if topk > 1 and self.proposer is not Proposer.DRAFT:
            why = ("the n-gram proposer drafts one chain (the continuation of the last match)"
                   if self.proposer is Proposer.NGRAM else "there is no proposer")
            raise ValueError(
                f"speculative_topk={topk} asks for token trees, which the draft model proposes "
                f"(proposer='draft' with a draft_model); {why}: use speculative_topk=1")
        if budget is None:
            return
        if not self.proposer:
            raise ValueError(f"speculative_num_draft_tokens={budget} needs a proposer")
        if not 1 <= budget <= MAX_TREE_NODES:
            raise ValueError(f"speculative_num_draft_tokens must be in [1, {MAX_TREE_NODES}], "
                             f"got {budget}")
        if topk == 1 and budget != q:
            raise ValueError(
                f"speculative_num_draft_tokens={budget} with speculative_topk=1: a chain "
                f"verifies exactly num_speculative_tokens={q} drafts; give speculative_topk > 1 "
                "for a tree of that many nodes, or drop speculative_num_draft_tokens")
        if budget < q:
            raise ValueError(
                f"speculative_num_draft_tokens={budget} is less than the depth "
                f"num_speculative_tokens={q}: a tree that deep needs at least {q} nodes")

    @property
    def mode_spec(self) -> ModeSpec:
        """The mode's spec (``mode`` is set once validated: None resolves in ``_normalise``)."""
        spec = MODES[self.mode or Mode.STREAM]
        return spec if self.drafting is None else replace(spec, drafting=self.drafting)

    @property
    def speculative(self) -> bool:
        """Rounds verify drafts (a proposer was given; validation makes q >= 1 then)."""
        return self.proposer is not None

    @property
    def q(self) -> int:
        """Draft tokens per round: ``num_speculative_tokens``, or without one (with a
        proposer) DEFAULT_SPECULATIVE_TOKENS under the fixed policy and AUTO_MAX_DEPTH under
        auto (the deepest the policy may choose; 0 = no proposer)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        if not self.proposer:
            return 0
        return AUTO_MAX_DEPTH if self.policy is SpeculativePolicy.AUTO else (
            DEFAULT_SPECULATIVE_TOKENS)

    @property
    def fixed_depth(self) -> int:
        """Draft tokens of a round the policy does not shape (fixed policy, seeded sampled
        requests): ``num_speculative_tokens``, or DEFAULT_SPECULATIVE_TOKENS with a proposer."""
        if self.num_speculative_tokens is not None or not self.proposer:
            return self.q
        return DEFAULT_SPECULATIVE_TOKENS

    @property
    def trees_by_default(self) -> bool:
        """No tree option was given and the policy may choose trees: a draft model proposes
        under speculative_policy auto."""
        return (self.speculative_topk is None and self.proposer is Proposer.DRAFT
                and self.policy is SpeculativePolicy.AUTO)

    @property
    def topk(self) -> int:
        """Children per expanded tree node at most: ``speculative_topk``, or without one
        DEFAULT_TREE_TOPK where trees are allowed by default, else 1 (chains)."""
        if self.speculative_topk is not None:
            return self.speculative_topk
        return DEFAULT_TREE_TOPK if self.trees_by_default else 1

    @property
    def policy(self) -> SpeculativePolicy:
        """``speculative_policy``, or without one auto where there is a proposer."""
        if self.speculative_policy is not None:
            return self.speculative_policy
        return SpeculativePolicy.AUTO if self.speculative else SpeculativePolicy.FIXED

    @property
    def tree(self) -> bool:
        """Rounds verify token trees (more than one child per expanded node)."""
        return self.topk > 1

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens (tree nodes) of one request per round: the node budget with trees,
        q for chains (0 without speculation)."""
        budget = self.speculative_num_draft_tokens
        if budget is None and self.trees_by_default:
            budget = max(DEFAULT_TREE_NODES, self.q)
        return budget if budget is not None and self.speculative else self.q

    @property
    def verify_tokens(self) -> int:
        """Query positions (and KV slots) of one request in a decode round: its last token and
        its drafts."""
        return self.num_draft_tokens + 1

    def device_budget(self, free_device_bytes: int | None = None) -> int:
        """Device bytes for KV: ``device_kv_bytes``, or without it on CUDA
        gpu_memory_utilization of ``free_device_bytes`` (what the device has free once the
        models are loaded) and on cpu CPU_DEVICE_KV_BYTES."""
        if self.device_kv_bytes is not None:
            return self.device_kv_bytes
        if self.device.startswith("cuda"):
            if free_device_bytes is None:
                raise ValueError("the CUDA device budget needs the device's free memory")
            return int(self.gpu_memory_utilization * free_device_bytes)
        return CPU_DEVICE_KV_BYTES


# the named options' types, by field (``_normalise``)
_CHOICES: dict[str, type[Choice]] = {
    "mode": Mode, "residency": Residency, "host_attention": HostAttentionMode,
    "attention_backend": AttentionBackend, "speculative_policy": SpeculativePolicy,
    "drafting": Drafting, "proposer": Proposer, "draft_cache": DraftCache,
}
