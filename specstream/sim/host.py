"""Host attention in the roofline (issue 22): how much of a round's cold history the host CPU
attends where it lives, beside the link.

The host reads a KV row once for all the query positions of its request, so per byte of KV it
does ``flop_per_byte x positions`` FLOPs: QK^T and PV are 4 x heads x head_dim FLOPs per
(query, token) pair per layer against 2 x kv_heads x head_dim x dtype bytes of KV, i.e. the
GQA ratio heads / kv_heads per byte at 2-byte KV (4 for Qwen3-8B's 32:8). The host serves
``gpus_per_host`` GPUs: each gets its share of the host's memory bandwidth and cores, and its
link's DMA reads (the streamed share) come out of the same memory bandwidth. So, per GPU,

    host rate = min(host bw / gpus - link rate, host FLOP/s / gpus / (flop_per_byte x positions))

and the split that makes the link and the host finish together gives the host
host rate / (link rate + host rate) of every request's cold history: the round's cold part
then takes cold bytes / (link rate + host rate). Costs without a hardware profile (fitted on a
bench run) have no host model: the rate is 0 and nothing is split.
"""

from __future__ import annotations

from dataclasses import dataclass

from specstream.sim.costs import Costs

HOST_ATTENTION: tuple[str, ...] = ("off", "auto")


def flop_per_byte(costs: Costs) -> float:
    """Target attention FLOPs per byte of KV per query position (0 without a model profile)."""
    target = getattr(costs, "target", None)
    if target is None:
        return 0.0
    return target.attention_flops_per_pair / costs.kv_bytes("target")


@dataclass(frozen=True)
class HostSplit:
    """Rates of the two paths for the cold history of one GPU's round, and the host's share."""

    link_rate: float  # bytes/s over the link
    host_rate: float  # bytes/s the host attends (0: no host attention)
    bandwidth_rate: float = 0.0  # what the host's memory bandwidth alone would allow
    compute_rate: float = 0.0  # what its cores alone would allow

    @property
    def share(self) -> float:
        """Fraction of each request's cold history attended on the host."""
        total = self.link_rate + self.host_rate
        return self.host_rate / total if total > 0 else 0.0

    @property
    def bound(self) -> str:
        """What limits the host: "memory" bandwidth or "compute"."""
        return "memory" if self.bandwidth_rate <= self.compute_rate else "compute"

    def cold_s(self, cold_bytes: float) -> float:
        """Both paths at once, finishing together."""
        return cold_bytes / (self.link_rate + self.host_rate)


def host_split(costs: Costs, positions: float, on: bool = True) -> HostSplit:
    """The split for a round with ``positions`` query positions per request (1 + drafts for a
    chain, 1 + nodes for a tree); ``on=False`` (or no host model): all on the link."""
    hw = getattr(costs, "hardware", None)
    fpb = flop_per_byte(costs)
    if not on or hw is None or fpb <= 0:
        return HostSplit(costs.link_bw, 0.0)
    bandwidth = max(0.0, hw.host_bw_per_gpu - costs.link_bw)
    compute = hw.host_flops_per_gpu / (fpb * max(1.0, positions))
    return HostSplit(costs.link_bw, min(bandwidth, compute), bandwidth, compute)
