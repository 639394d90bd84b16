"""Host attention in the step replay: what the host CPU's share of a step's cold history costs.

A run with ``host_attention`` on has the scheduler (the engine's ``split_steps``, driven by the
replay) give the host the oldest cold blocks of each request, so that the link and the host
finish together. The replay then needs what the engine's ``HostAttention`` measures: the
host's seconds per byte (a line in a request's query positions, as the engine's
``RoundFeedback`` fits it) and the device time of a step during which the host has no job
(``serial``). Both are fitted on the run's own measured steps (``HostModel.of_steps``): the
host's rate is an input of the prediction, as the link's is, not an output.

A step then waits for the host's partials when the host's work (after the serial part) outlasts
the device's compute: ``host wait = max(0, serial + host - target compute)``, and the step
takes the longer of that and its link wait (the two run side by side).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from specstream.engine.contract import StepPlan
from specstream.sim.calibrate import nnls


@dataclass(frozen=True)
class HostModel:
    """The host's attention costs, as measured on a run."""

    seconds_per_byte: float  # the fixed part of a KV byte's cost
    seconds_per_byte_per_position: float  # ... and per query position of its request
    serial_share: float  # the host's idle time of a step over the step's target compute

    @classmethod
    def of_steps(cls, steps: Iterable[dict[str, Any]]) -> HostModel | None:
        """Fitted on a bench run's steps (``rounds`` and ``prefill_steps`` records with
        ``host_bytes``, ``host_busy_s``, ``host_serial_s``); None when the host attended
        nothing."""
        rows, ys, serial, compute = [], [], 0.0, 0.0
        for r in steps:
            nbytes = float(r.get("host_bytes", 0))
            if nbytes <= 0:
                continue
            positions = float(r["query_tokens"]) / max(1.0, float(r["num_seqs"]))
            # seconds per byte against positions, the engine's own line (RoundFeedback)
            rows.append([1.0, positions])
            ys.append(float(r["host_busy_s"]) / nbytes)
            serial += float(r.get("host_serial_s", 0.0))
            compute += max(0.0, float(r["compute_s"]) - float(r.get("draft_s", 0.0)))
        if not rows:
            return None
        a, b = nnls(np.array(rows), np.array(ys))
        return cls(float(a), float(b), serial / compute if compute else 0.0)

    def per_byte(self, positions: int) -> float:
        return self.seconds_per_byte + self.seconds_per_byte_per_position * positions

    def jobs(self, plan: StepPlan, block_bytes: int, layers: int
             ) -> tuple[tuple[int, float, int], ...]:
        """Per request the host attends for: (query positions, seconds, KV bytes), as the
        engine's ``StepMeasures.host_jobs``."""
        out = []
        for s in plan.seqs:
            nbytes = s.host_bytes(block_bytes, layers)
            if nbytes:
                positions = len(s.token_ids)
                out.append((positions, nbytes * self.per_byte(positions), nbytes))
        return tuple(out)

    def wait_s(self, host_s: float, target_s: float) -> float:
        """Time a step whose target compute is ``target_s`` waits for ``host_s`` of host work
        (module docstring)."""
        return max(0.0, self.serial_share * target_s + host_s - target_s) if host_s else 0.0
