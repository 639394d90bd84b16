"""Tensor parallelism in the deployment model: one rank of a TP group, and the TP table.

A TP group of ``tp`` GPUs runs the target sharded as vLLM shards it (attention heads and KV
heads split across ranks, column-parallel q/k/v and gate/up, row-parallel o and down, an
all-reduce of the hidden states after each), so each rank holds 1/tp of the target's weights and
of its KV cache (a KV head is replicated where there are fewer KV heads than ranks), streams its
KV shard over its own PCIe link, and pays two all-reduces per layer. The simulator models one
rank (``TensorParallelCosts``): its memory, its link and its compute; every rank runs the same
round in lockstep, so the group's throughput is one rank's, on ``tp`` GPUs (``gpus``).

The draft is replicated on every rank by default: sharding a 0.6B draft halves its weight
reads but adds two all-reduces per layer to every draft step, and the latencies win. Modelled
(``shard_draft=True``), a Qwen3-0.6B step at TP 2 takes 0.59 ms replicated against 0.88-0.92 ms
sharded on H200s (NVLink), 1.05-1.10 ms against 2.07-2.82 ms on A800s over PCIe (1-128 tokens).

The all-reduce: a ring over ``tp`` ranks moves 2 (tp - 1) / tp of the message per rank at the
interconnect's bus bandwidth (NVLink on SXM parts; PCIe where there is none), plus a fixed
latency per call. Assumptions, per hardware (``ALLREDUCE``): NVLink 4 (H100/H200 SXM) 360 GB/s
bus bandwidth, NVLink 3 (A100 SXM) 230 GB/s, A800 (NVLink capped at 400 GB/s) 150 GB/s where
bridged, and PCIe 4 without NVLink 20 GB/s; 8 us per all-reduce on NVLink, 25 us over PCIe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specstream.sim.costs import RooflineCosts, Which
from specstream.sim.hardware import GB, HardwareProfile
from specstream.sim.model_profile import ModelProfile

# hardware name -> (all-reduce bus bytes/s, seconds per all-reduce) between the GPUs of a host
ALLREDUCE: dict[str, tuple[float, float]] = {
    "H100-SXM": (360 * GB, 8e-6), "H200": (360 * GB, 8e-6), "A100-80GB": (230 * GB, 8e-6),
    "A800-80GB-PCIe": (20 * GB, 25e-6), "L40S": (20 * GB, 25e-6),
}
A800_NVLINK_BRIDGE = (150 * GB, 8e-6)


def kv_heads_per_rank(model: ModelProfile, tp: int) -> int:
    """KV heads each rank holds: its share, or one replicated head per rank past the count."""
    return max(1, math.ceil(model.num_kv_heads / tp))


def check_tp(model: ModelProfile, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if model.num_heads % tp:
        raise ValueError(f"{model.name}: {model.num_heads} attention heads do not split over "
                         f"{tp} ranks")
    if tp > model.num_kv_heads and tp % model.num_kv_heads:
        raise ValueError(f"{model.name}: {model.num_kv_heads} KV heads cannot be replicated "
                         f"evenly over {tp} ranks")


@dataclass(frozen=True)
class TensorParallelCosts:
    """One rank of a TP group of ``tp`` GPUs (``base``: the whole model on one GPU of the same
    kind). Implements ``costs.Costs``; ``gpus`` is what one replica occupies."""

    base: RooflineCosts
    tp: int
    allreduce_bytes_per_s: float = 0.0  # 0: the hardware's default (ALLREDUCE)
    allreduce_s: float = -1.0  # seconds per all-reduce; < 0: the hardware's default
    shard_draft: bool = False
    _defaults: tuple[float, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_tp(self.base.target, self.tp)
        if self.shard_draft:
            check_tp(self.base.draft, self.tp)
        bw, lat = ALLREDUCE.get(self.base.hardware.name, (20 * GB, 25e-6))
        object.__setattr__(self, "_defaults", (self.allreduce_bytes_per_s or bw,
                                               lat if self.allreduce_s < 0 else self.allreduce_s))

    @property
    def hardware(self) -> HardwareProfile:
        return self.base.hardware

    @property
    def gpus(self) -> int:
        return self.tp

    @property
    def device_budget_bytes(self) -> float:
        return self.base.device_budget_bytes  # each rank has a whole GPU

    @property
    def host_budget_bytes(self) -> float:
        return self.base.host_budget_bytes

    @property
    def link_bw(self) -> float:
        return self.base.link_bw  # each GPU streams over its own x16 link

    @property
    def link_copy_s(self) -> float:
        return self.base.link_copy_s

    def _ranks(self, which: Which) -> int:
        return self.tp if which == "target" or self.shard_draft else 1

    def _model(self, which: Which) -> ModelProfile:
        return self.base.target if which == "target" else self.base.draft

    def layers(self, which: Which) -> int:
        return self.base.layers(which)

    def kv_bytes(self, which: Which) -> float:
        """This rank's KV bytes per token (its KV heads' share)."""
        m, ranks = self._model(which), self._ranks(which)
        return self.base.kv_bytes(which) * kv_heads_per_rank(m, ranks) / m.num_kv_heads

    def weight_bytes(self, which: Which) -> float:
        return self.base.weight_bytes(which) / self._ranks(which)

    def allreduce_time(self, which: Which, n_query: float) -> float:
        """The two all-reduces per layer of one forward over ``n_query`` tokens."""
        ranks = self._ranks(which)
        if ranks == 1 or n_query <= 0:
            return 0.0
        m = self._model(which)
        bw, lat = self._defaults
        message = n_query * m.hidden_size * m.dtype_bytes
        return 2 * m.num_layers * (lat + 2 * (ranks - 1) / ranks * message / bw)

    def linear_s(self, which: Which, n_query: float) -> float:
        m, hw, ranks = self._model(which), self.hardware, self._ranks(which)
        if n_query <= 0:
            return 0.0
        weights = m.decode_read_bytes / ranks / hw.mem_bw
        matmul = m.flops_per_token * n_query / ranks / hw.flops
        return (m.num_layers * hw.layer_overhead_s + max(weights, matmul)
                + self.allreduce_time(which, n_query))

    def attention_s(self, which: Which, q_per_req: float, ctx_tokens: float) -> float:
        m, hw = self._model(which), self.hardware
        reads = ctx_tokens * self.kv_bytes(which) / hw.mem_bw
        math_s = q_per_req * ctx_tokens * m.attention_flops_per_pair / self._ranks(which) \
            / hw.flops
        return max(reads, math_s)

    def prefill_s(self, which: Which, tokens: float) -> float:
        return self.linear_s(which, tokens) + self.attention_s(which, tokens / 2, tokens)


def with_tp(costs: RooflineCosts, tp: int, allreduce_bytes_per_s: float = 0.0,
            shard_draft: bool = False) -> RooflineCosts | TensorParallelCosts:
    """``costs`` at TP size ``tp`` (``costs`` itself at 1)."""
    if tp == 1:
        return costs
    return TensorParallelCosts(costs, tp, allreduce_bytes_per_s, shard_draft=shard_draft)



@dataclass(frozen=True)
class TPSetting:
    hardware: str
    pcie: int
    target: str
    draft: str
    note: str = ""
    allreduce_bytes_per_s: float = 0.0  # 0: ALLREDUCE's default for the hardware


TP_SETTINGS = (
    TPSetting("H200", 5, "Qwen3-32B", "Qwen3-0.6B"),
    TPSetting("H200", 5, "Qwen3-8B", "Qwen3-0.6B"),
    TPSetting("A800-80GB-PCIe", 4, "Qwen3-32B", "Qwen3-0.6B",
              "the reference's setup: TP 2 on two A800s (all-reduce over PCIe)"),
    TPSetting("A800-80GB-PCIe", 4, "Qwen3-32B", "Qwen3-0.6B", "the same, NVLink-bridged",
              A800_NVLINK_BRIDGE[0]),
)


def tp_table(settings: tuple[TPSetting, ...] = TP_SETTINGS, sizes: tuple[int, ...] = (1, 2, 4),
             context: int = 32768, concurrency: int = 32, alpha: float = 0.75,
             output_len: int = 512) -> str:
    """Markdown: per setting and TP size, specstream and offload-spec (residency fill, q and
    shapes chosen per round): throughput, per GPU, the requests in flight, and one rank's link
    bytes and link time in a full-batch specstream round."""
    from specstream.sim.api import Scenario, by_mode, simulate  # api imports this module

    head = ("| hardware | target + draft | TP | GPUs | specstream tok/s | per GPU "
            "| offload-spec tok/s | specstream / offload-spec | in flight "
            "| link MB / round / rank | link ms / round / rank | note |")
    lines = [head, "|" + " --- |" * 12]
    for s in settings:
        for tp in sizes:
            sc = Scenario.from_names(s.hardware, s.target, s.draft, (context,), concurrency,
                                     alpha, output_len, pcie_gen=s.pcie,
                                     tensor_parallel_size=tp,
                                     allreduce_bytes_per_s=s.allreduce_bytes_per_s)
            res = by_mode(simulate(sc, ("offload-spec", "specstream")))
            ss, base = res["specstream"], res["offload-spec"]
            rnd = ss.round
            cells = [f"{s.hardware} PCIe{s.pcie}", f"{s.target} + {s.draft}", str(tp),
                     str(ss.gpus)]
            if not ss.feasible:
                lines.append("| " + " | ".join(cells + ["does not fit"] + ["-"] * 6
                                               + [s.note]) + " |")
                continue
            gain = ss.throughput / base.throughput if base.throughput else float("inf")
            cells += [f"{ss.throughput:.0f}", f"{ss.throughput_per_gpu:.0f}",
                      f"{base.throughput:.0f}" if base.feasible else "does not fit",
                      f"{gain:.2f}x" if base.feasible else "-", str(ss.admitted),
                      f"{rnd.link_bytes / 1e6:.0f}" if rnd else "-",
                      f"{rnd.link_s * 1e3:.1f}" if rnd else "-", s.note]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
