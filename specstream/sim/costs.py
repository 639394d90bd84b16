"""Cost models: how long a forward, an attention pass, a prefill and a transfer take.

Two implementations share one interface: ``RooflineCosts`` derives times from a hardware and
two model profiles (weights streamed from HBM vs matrix FLOPs, attention reads KV once for all
of a request's query tokens); ``FittedCosts`` (built by ``calibrate.py``) uses coefficients
measured by ``specstream bench``. The pipeline only ever calls the methods below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from specstream.sim.hardware import HardwareProfile
from specstream.sim.model_profile import ModelProfile

Which = Literal["target", "draft"]


class Costs(Protocol):
    """Times in seconds, sizes in bytes."""

    device_budget_bytes: float  # device memory for weights + KV + buffers
    host_budget_bytes: float
    link_bw: float  # host-to-device bytes/s
    link_copy_s: float  # fixed cost of one copy on the link (a DMA)

    @property
    def gpus(self) -> int:
        """GPUs one replica of the target occupies (its tensor-parallel size)."""
        ...

    def layers(self, which: Which) -> int: ...
    def kv_bytes(self, which: Which) -> float: ...  # per token, all layers
    def weight_bytes(self, which: Which) -> float: ...

    def linear_s(self, which: Which, n_query: float) -> float:
        """All non-attention work of one forward over n_query tokens (batch total)."""
        ...

    def attention_s(self, which: Which, q_per_req: float, ctx_tokens: float) -> float:
        """Attention of q_per_req query tokens per request over ctx_tokens (batch total)."""
        ...

    def prefill_s(self, which: Which, tokens: float) -> float:
        """Prefill of one request's prompt."""
        ...


@dataclass(frozen=True)
class RooflineCosts:
    """Datasheet roofline: a kernel takes max(bytes / bandwidth, FLOPs / throughput).

    ``kv_dtype_bytes``: bytes per KV element when the KV cache is stored in another dtype than
    the weights (fp8: 1); it scales every KV size (device memory, attention reads, link
    bytes) of both models. None: the weights' dtype."""

    hardware: HardwareProfile
    target: ModelProfile
    draft: ModelProfile
    kv_dtype_bytes: float | None = None

    def __post_init__(self) -> None:
        if self.kv_dtype_bytes is not None and self.kv_dtype_bytes <= 0:
            raise ValueError("kv_dtype_bytes must be positive")

    def _model(self, which: Which) -> ModelProfile:
        return self.target if which == "target" else self.draft

    @property
    def device_budget_bytes(self) -> float:
        return self.hardware.usable_memory_bytes

    @property
    def host_budget_bytes(self) -> float:
        return self.hardware.host_memory_bytes

    @property
    def link_bw(self) -> float:
        return self.hardware.link_bw

    @property
    def link_copy_s(self) -> float:
        return self.hardware.link_copy_s

    @property
    def gpus(self) -> int:
        return 1

    def layers(self, which: Which) -> int:
        return self._model(which).num_layers

    def kv_bytes(self, which: Which) -> float:
        m = self._model(which)
        if self.kv_dtype_bytes is None:
            return float(m.kv_bytes_per_token)
        return m.kv_bytes_per_token / m.dtype_bytes * self.kv_dtype_bytes

    def weight_bytes(self, which: Which) -> float:
        return float(self._model(which).weight_bytes)

    def linear_s(self, which: Which, n_query: float) -> float:
        m, hw = self._model(which), self.hardware
        if n_query <= 0:
            return 0.0
        weights = m.decode_read_bytes / hw.mem_bw
        matmul = m.flops_per_token * n_query / hw.flops
        return m.num_layers * hw.layer_overhead_s + max(weights, matmul)

    def attention_s(self, which: Which, q_per_req: float, ctx_tokens: float) -> float:
        m, hw = self._model(which), self.hardware
        reads = ctx_tokens * self.kv_bytes(which) / hw.mem_bw
        math = q_per_req * ctx_tokens * m.attention_flops_per_pair / hw.flops
        return max(reads, math)

    def prefill_s(self, which: Which, tokens: float) -> float:
        # causal attention: tokens^2 / 2 query-context pairs
        return self.linear_s(which, tokens) + self.attention_s(which, tokens / 2, tokens)


@dataclass(frozen=True)
class LinearFit:
    """t = const + a * query_tokens + b * context_tokens + c * context_tokens * q_per_req."""

    const_s: float = 0.0
    per_query_token_s: float = 0.0
    per_context_token_s: float = 0.0
    per_context_query_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.const_s, self.per_query_token_s, self.per_context_token_s,
               self.per_context_query_s) < 0:
            raise ValueError("fitted coefficients must be non-negative")


@dataclass(frozen=True)
class PrefillFit:
    """t = const + a * tokens + b * tokens^2 (one request's prompt)."""

    const_s: float = 0.0
    per_token_s: float = 0.0
    per_token_sq_s: float = 0.0


@dataclass(frozen=True)
class FittedCosts:
    """Costs measured on a machine (see calibrate.py for where each number comes from)."""

    link_bw: float
    device_budget_bytes: float
    host_budget_bytes: float
    num_layers: tuple[int, int]  # target, draft
    kv_per_token: tuple[float, float]
    weights: tuple[float, float]
    forward: tuple[LinearFit, LinearFit]
    prefill: tuple[PrefillFit, PrefillFit]
    link_copy_s: float = 0.0  # not measured: the bench's copies are inside its link rate

    @property
    def gpus(self) -> int:
        return 1

    def _i(self, which: Which) -> int:
        return 0 if which == "target" else 1

    def layers(self, which: Which) -> int:
        return self.num_layers[self._i(which)]

    def kv_bytes(self, which: Which) -> float:
        return self.kv_per_token[self._i(which)]

    def weight_bytes(self, which: Which) -> float:
        return self.weights[self._i(which)]

    def linear_s(self, which: Which, n_query: float) -> float:
        f = self.forward[self._i(which)]
        return 0.0 if n_query <= 0 else f.const_s + f.per_query_token_s * n_query

    def attention_s(self, which: Which, q_per_req: float, ctx_tokens: float) -> float:
        f = self.forward[self._i(which)]
        return ctx_tokens * (f.per_context_token_s + f.per_context_query_s * q_per_req)

    def prefill_s(self, which: Which, tokens: float) -> float:
        p = self.prefill[self._i(which)]
        return p.const_s + p.per_token_s * tokens + p.per_token_sq_s * tokens * tokens
