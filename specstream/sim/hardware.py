"""Hardware profiles: device memory, HBM bandwidth, matrix throughput, host link.

Datasheet defaults for the GPUs the simulator knows; every field can be overridden with a
measured value (``get_hardware("H200", link_bytes_per_s=48e9)``). Bandwidths are bytes/s,
throughputs FLOP/s (dense bf16, no sparsity). The link figure is the *effective* pinned
host-to-device bandwidth of an x16 slot, not the line rate: ~25 GB/s on PCIe 4 and ~50 GB/s on
PCIe 5, the figures of design.md.

The host side (issue 22, host attention) is three assumptions per machine, none measured on a
GPU server: the host's sustained memory bandwidth, the FLOP/s its cores reach on attention with
AVX-512 or AMX, and how many GPUs share that host (its memory bandwidth and cores, and the
bandwidth the GPUs' own DMA reads draw from host memory).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9
TB = 1e12

#: Effective pinned host-to-device bandwidth of an x16 link, by PCIe generation.
PCIE_LINK_BYTES_PER_S: dict[int, float] = {3: 12.5 * GB, 4: 25 * GB, 5: 50 * GB, 6: 100 * GB}

HOST_ISAS: tuple[str, ...] = ("avx512", "amx")

# Host defaults, assumptions (docs/simulator.md, "Host attention"):
# - DDR5 hosts (the PCIe 5 GPUs): 2 sockets x 8 channels DDR5-4800 (Sapphire Rapids) = 614 GB/s
#   peak, ~430 GB/s sustained (70%; the low end of the 430-560 GB/s the issue quotes);
#   AVX-512: 2 x 56 cores x 64 fp32 FLOP/cycle x ~2 GHz = 14 TFLOP/s peak, ~8 reached;
#   AMX: ~230 TFLOP/s bf16 peak, but decode attention has few query rows per KV head to fill
#   the tiles: ~20 TFLOP/s assumed (the 64-node-tree figures: AVX-512 ~1.6x, AMX ~2.6x).
# - DDR4 hosts (the PCIe 4 GPUs): 2 sockets x 8 channels DDR4-3200 (Ice Lake) = 410 GB/s peak,
#   ~300 sustained; AVX-512 2 x 40 cores: ~5 TFLOP/s reached; no AMX before Sapphire Rapids,
#   so "amx" runs at the AVX-512 rate.
DDR5_HOST: dict[str, float] = {"host_bytes_per_s": 430 * GB, "host_avx512_flops": 8 * TB,
                               "host_amx_flops": 20 * TB}
DDR4_HOST: dict[str, float] = {"host_bytes_per_s": 300 * GB, "host_avx512_flops": 5 * TB,
                               "host_amx_flops": 5 * TB}


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator and its host link.

    The efficiencies turn datasheet peaks into what decode kernels reach; they are assumptions
    (documented in docs/simulator.md), and calibration replaces the whole cost model anyway.
    """

    name: str
    device_memory_bytes: float  # HBM capacity
    hbm_bytes_per_s: float  # peak memory bandwidth (datasheet)
    matrix_flops: float  # peak dense bf16 tensor throughput (datasheet)
    pcie_gen: int  # host link generation, x16
    link_bytes_per_s: float = 0.0  # effective H2D bandwidth; 0 = from pcie_gen
    host_memory_bytes: float = 1024 * GB  # pinned host memory available for offloaded KV
    hbm_efficiency: float = 0.8  # fraction of peak bandwidth a decode kernel streams at
    flops_efficiency: float = 0.6  # fraction of peak matrix throughput reached (MFU)
    layer_overhead_s: float = 10e-6  # fixed cost per layer per forward (launches, syncs)
    memory_utilisation: float = 0.9  # share of device memory the engine may use
    # fixed cost of one DMA copy on the link (descriptor setup, launch, completion), paid per
    # request per layer by a layer-wise restore and per request per chunk per layer by a
    # streamed one; 0 = bytes / bandwidth only
    link_copy_s: float = 0.0
    # the host CPU (host attention): sustained memory bandwidth of the whole host, and the
    # FLOP/s its cores reach on attention per instruction set (defaults: DDR5_HOST)
    host_bytes_per_s: float = DDR5_HOST["host_bytes_per_s"]
    host_avx512_flops: float = DDR5_HOST["host_avx512_flops"]
    host_amx_flops: float = DDR5_HOST["host_amx_flops"]
    host_isa: str = "avx512"  # which of HOST_ISAS the host attention kernel uses
    gpus_per_host: int = 1  # GPUs offloading through this host: they share its bandwidth, cores

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("hardware needs a name")
        for field in ("device_memory_bytes", "hbm_bytes_per_s", "matrix_flops"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.link_bytes_per_s < 0:
            raise ValueError("link_bytes_per_s must be >= 0 (0 = PCIe default)")
        if self.link_bytes_per_s == 0 and self.pcie_gen not in PCIE_LINK_BYTES_PER_S:
            raise ValueError(f"unknown PCIe generation {self.pcie_gen}")
        for field in ("hbm_efficiency", "flops_efficiency", "memory_utilisation"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"{field} must be in (0, 1]")
        if self.link_copy_s < 0:
            raise ValueError("link_copy_s must be >= 0")
        if self.layer_overhead_s < 0 or self.host_memory_bytes <= 0:
            raise ValueError("layer_overhead_s must be >= 0 and host memory positive")
        if self.host_isa not in HOST_ISAS:
            raise ValueError(f"host_isa must be one of {', '.join(HOST_ISAS)}, "
                             f"got {self.host_isa!r}")
        if self.gpus_per_host < 1 or int(self.gpus_per_host) != self.gpus_per_host:
            raise ValueError("gpus_per_host must be an integer >= 1")
        for field in ("host_bytes_per_s", "host_avx512_flops", "host_amx_flops"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0")

    @property
    def link_bw(self) -> float:
        """Effective host-to-device bytes/s."""
        return self.link_bytes_per_s or PCIE_LINK_BYTES_PER_S[self.pcie_gen]

    @property
    def mem_bw(self) -> float:
        """Bytes/s a decode kernel actually streams from HBM."""
        return self.hbm_bytes_per_s * self.hbm_efficiency

    @property
    def flops(self) -> float:
        """FLOP/s a GEMM actually reaches."""
        return self.matrix_flops * self.flops_efficiency

    @property
    def host_flops(self) -> float:
        """FLOP/s the whole host's cores reach on attention with ``host_isa``."""
        return self.host_amx_flops if self.host_isa == "amx" else self.host_avx512_flops

    @property
    def host_bw_per_gpu(self) -> float:
        """This GPU's share of the host's memory bandwidth (its DMA reads included)."""
        return self.host_bytes_per_s / self.gpus_per_host

    @property
    def host_flops_per_gpu(self) -> float:
        """This GPU's share of the host's attention FLOP/s."""
        return self.host_flops / self.gpus_per_host

    @property
    def usable_memory_bytes(self) -> float:
        """Device memory the engine may fill (weights, KV, buffers)."""
        return self.device_memory_bytes * self.memory_utilisation

    def describe(self) -> str:
        return (
            f"{self.name}: {self.device_memory_bytes / GB:.0f} GB, "
            f"{self.hbm_bytes_per_s / TB:.2f} TB/s HBM, {self.matrix_flops / TB:.0f} TFLOP/s, "
            f"PCIe {self.pcie_gen} ({self.link_bw / GB:.1f} GB/s)"
        )

    def describe_host(self) -> str:
        return (f"host: {self.host_bytes_per_s / GB:.0f} GB/s memory, "
                f"{self.host_flops / TB:.0f} TFLOP/s attention ({self.host_isa}), "
                f"{self.gpus_per_host} GPU(s) per host")


HARDWARE: dict[str, HardwareProfile] = {}


def register_hardware(profile: HardwareProfile) -> HardwareProfile:
    """Add a profile to the registry under its lower-cased name; returns it."""
    HARDWARE[profile.name.lower()] = profile
    return profile


# Datasheet values (dense bf16; HBM capacity as sold).
register_hardware(HardwareProfile("H100-SXM", 80 * GB, 3.35 * TB, 989 * TB, pcie_gen=5))
register_hardware(HardwareProfile("H200", 141 * GB, 4.8 * TB, 989 * TB, pcie_gen=5))
register_hardware(HardwareProfile("A100-80GB", 80 * GB, 2.039 * TB, 312 * TB, pcie_gen=4,
                                  **DDR4_HOST))
register_hardware(HardwareProfile("A800-80GB-PCIe", 80 * GB, 1.935 * TB, 312 * TB, pcie_gen=4,
                                  **DDR4_HOST))
register_hardware(HardwareProfile("L40S", 48 * GB, 0.864 * TB, 362 * TB, pcie_gen=4,
                                  **DDR4_HOST))

_ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "a800": "a800-80gb-pcie"}


def get_hardware(name: str, pcie_gen: int | None = None,
                 **overrides: float | str | None) -> HardwareProfile:
    """A built-in profile by name (case-insensitive), with an optional PCIe generation and
    field overrides; overrides of ``None`` are ignored so CLI defaults pass straight through."""
    key = name.lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key not in HARDWARE:
        known = ", ".join(p.name for p in HARDWARE.values())
        raise KeyError(f"unknown hardware {name!r}; known: {known}")
    changes: dict[str, float | str] = {k: v for k, v in overrides.items() if v is not None}
    if pcie_gen is not None:
        changes["pcie_gen"] = pcie_gen
    return replace(HARDWARE[key], **changes)
