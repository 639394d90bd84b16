"""Python API: describe a scenario, simulate every mode, sweep context lengths.

>>> from specstream.sim import Scenario, simulate
>>> sc = Scenario.from_names("H200", "Qwen3-8B", "Qwen3-0.6B", contexts=(32768,),
...                          concurrency=16, alpha=0.75)
>>> results = simulate(sc)          # one ModeResult per mode
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from specstream.sim.costs import Costs, RooflineCosts
from specstream.sim.hardware import HardwareProfile, get_hardware
from specstream.sim.model_profile import ModelProfile, get_model
from specstream.sim.policy import MODES, SimPolicy, check_mode
from specstream.sim.serving import ModeResult, simulate_mode
from specstream.sim.tensor_parallel import with_tp
from specstream.sim.workload import AcceptanceModel, Workload


@dataclass(frozen=True)
class Scenario:
    """Everything one simulation needs; ``label`` names it in reports."""

    costs: Costs
    workload: Workload
    acceptance: AcceptanceModel
    policy: SimPolicy = field(default_factory=SimPolicy)
    label: str = ""
    hardware: HardwareProfile | None = None  # for descriptions (None when calibrated)
    target: ModelProfile | None = None
    draft: ModelProfile | None = None

    @classmethod
    def from_names(cls, hardware: str | HardwareProfile, target: str | ModelProfile,
                   draft: str | ModelProfile, contexts: Sequence[int] = (32768,),
                   concurrency: int | None = 16, alpha: float = 0.75, output_len: int = 512,
                   pcie_gen: int | None = None, policy: SimPolicy | None = None,
                   tensor_parallel_size: int = 1, allreduce_bytes_per_s: float = 0.0,
                   **workload: object) -> Scenario:
        """Built-in names (or profiles) in, a roofline-costed scenario out; at
        ``tensor_parallel_size`` > 1 the costs are one rank's (``sim.tensor_parallel``)."""
        hw = hardware if isinstance(hardware, HardwareProfile) else get_hardware(hardware,
                                                                                   pcie_gen)
        tgt = target if isinstance(target, ModelProfile) else get_model(target)
        drf = draft if isinstance(draft, ModelProfile) else get_model(draft)
        wl = Workload(tuple(contexts), output_len, concurrency, **workload)  # type: ignore[arg-type]
        costs = with_tp(RooflineCosts(hw, tgt, drf), tensor_parallel_size,
                        allreduce_bytes_per_s)
        tp = f" TP{tensor_parallel_size}" if tensor_parallel_size > 1 else ""
        return cls(costs, wl, AcceptanceModel(alpha=alpha), policy or SimPolicy(),
                   f"{hw.name} PCIe{hw.pcie_gen} {tgt.name}+{drf.name}{tp}", hw, tgt, drf)

    def with_contexts(self, contexts: Sequence[int]) -> Scenario:
        return replace(self, workload=replace(self.workload, context_lengths=tuple(contexts),
                                              weights=None))

    def with_concurrency(self, concurrency: int) -> Scenario:
        return replace(self, workload=replace(self.workload, concurrency=concurrency))


def simulate(scenario: Scenario, modes: Sequence[str] = MODES) -> list[ModeResult]:
    """One result per mode, in the order given."""
    return [simulate_mode(check_mode(m), scenario.costs, scenario.policy, scenario.workload,
                          scenario.acceptance) for m in modes]


def sweep_contexts(scenario: Scenario, contexts: Sequence[int],
                   modes: Sequence[str] = MODES) -> dict[str, list[ModeResult]]:
    """Per mode, results at each (single) context length: the data of the sweep plot."""
    out: dict[str, list[ModeResult]] = {m: [] for m in modes}
    for ctx in contexts:
        for result in simulate(scenario.with_contexts([ctx]), modes):
            out[result.mode].append(result)
    return out


def by_mode(results: Sequence[ModeResult]) -> dict[str, ModeResult]:
    return {r.mode: r for r in results}


def ratio(results: Sequence[ModeResult], num: str, den: str, per_gpu: bool = False) -> float:
    """Throughput (or throughput per GPU) of mode ``num`` over mode ``den``."""
    r = by_mode(results)
    a, b = r[num], r[den]
    x, y = (a.throughput_per_gpu, b.throughput_per_gpu) if per_gpu else (a.throughput,
                                                                         b.throughput)
    return x / y if y else float("inf")
