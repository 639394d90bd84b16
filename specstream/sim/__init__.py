"""Deployment simulator: a discrete-event model of SpecStream's round pipeline.

Given a hardware profile, target and draft model profiles, a workload and an acceptance model,
it predicts each mode's throughput, throughput per GPU, memory-limited concurrency, TTFT, TPOT
and link utilisation (see docs/simulator.md). Entry points: ``Scenario``, ``simulate``,
``sweep_contexts``; ``specstream.sim.cli.add_parser`` wires the ``simulate`` subcommand.
"""

from __future__ import annotations

from specstream.sim.api import Scenario, ratio, simulate, sweep_contexts
from specstream.sim.hardware import HardwareProfile, get_hardware
from specstream.sim.model_profile import ModelProfile, get_model
from specstream.sim.policy import MODES, SimPolicy
from specstream.sim.serving import ModeResult
from specstream.sim.workload import AcceptanceModel, Workload

__all__ = [
    "MODES", "AcceptanceModel", "HardwareProfile", "ModeResult", "ModelProfile", "Scenario",
    "SimPolicy", "Workload", "get_hardware", "get_model", "ratio", "simulate", "sweep_contexts",
]
