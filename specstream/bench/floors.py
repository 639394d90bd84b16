"""Honest round floors: the least time a decode round's work could take.

A round moves ``link_bytes`` over the link and does some verification and drafting. Its floor
is max(link bytes at the link's rate, the same verification and drafting timed with the history
already on the device). The second term is not measured in the round itself (a round that never
waits would score 1.00 by construction): it comes from a cost model fitted on the `resident`
rounds of the same run, whose history is on the device and whose drafting is sequential:

    verify = c0 + c1 * seqs + c2 * query tokens + c3 * context tokens
             + c4 * query x key pairs + c5 * prefill tokens
    draft  = d1 * drafting requests + d2 * draft tokens

(non-negative least squares on relative errors, so the many short decode rounds weigh as much as
the few long prefill steps). A mode that drafts on a second device (`parallel-spec`) has
max(verify, draft) as its compute floor, the others verify + draft. The floor is a property of
the work, not of the schedule: modes that generate the same tokens over the same history get
floors within a few percent of each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

VERIFY = ("one", "num_seqs", "query_tokens", "context_tokens", "attention_pairs",
          "prefill_tokens")
DRAFT = ("draft_seqs", "draft_tokens")


def _features(r: dict[str, Any]) -> list[float]:
    return [1.0 if name == "one" else float(r[name]) for name in VERIFY + DRAFT]


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients: fit, drop the negative ones, refit."""
    keep = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    while keep.any():
        sol = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (sol >= 0).all():
            coef[keep] = sol
            return coef
        idx = np.flatnonzero(keep)
        keep[idx[np.argmin(sol)]] = False
    return coef


@dataclass(frozen=True)
class ComputeModel:
    """Seconds of verification and drafting of a round, history on the device."""

    verify: tuple[float, ...]  # coefficients of VERIFY
    draft: tuple[float, ...]  # coefficients of DRAFT
    fit_error: float  # mean |relative error| on the rounds it was fitted on

    @classmethod
    def fit(cls, rounds: Sequence[dict[str, Any]]) -> ComputeModel:
        if len(rounds) < len(VERIFY + DRAFT):
            raise ValueError(f"{len(rounds)} resident rounds are too few to fit a compute model")
        x = np.array([_features(r) for r in rounds])
        y = np.array([r["wall_s"] for r in rounds])
        w = 1.0 / np.maximum(y, 1e-6)  # relative errors
        coef = _nnls(x * w[:, None], y * w)
        pred = x @ coef
        err = float(np.mean(np.abs(pred - y) / np.maximum(y, 1e-9)))
        n = len(VERIFY)
        return cls(tuple(coef[:n].tolist()), tuple(coef[n:].tolist()), err)

    def parts(self, r: dict[str, Any]) -> tuple[float, float]:
        """(verify, draft) seconds of one round record."""
        f = _features(r)
        n = len(VERIFY)
        return (float(np.dot(self.verify, f[:n])), float(np.dot(self.draft, f[n:])))

    def floor(self, r: dict[str, Any], parallel_draft: bool) -> float:
        verify, draft = self.parts(r)
        compute = max(verify, draft) if parallel_draft else verify + draft
        return max(r["link_floor_s"], compute)


def add_floors(results: dict[str, dict[str, Any]], model: ComputeModel) -> None:
    """Per mode: ``floor_s`` (every step: decode rounds and prefill-only steps, so the whole
    run's work) and ``decode_only_floor_s`` (rounds without a prefill chunk), each the steps'
    floors summed; ``round_time_over_floor`` and ``decode_only_round_time_over_floor`` are the
    same steps' wall time over that floor (so long steps weigh more)."""
    for res in results.values():
        parallel = res.get("drafting") == "parallel"
        steps = res["rounds"] + res.get("prefill_steps", [])
        for r in steps:
            r["floor_s"] = model.floor(r, parallel)
        pure = [r for r in res["rounds"] if not r["prefill_tokens"]]
        for prefix, rs in (("", steps), ("decode_only_", pure)):
            floor = sum(r["floor_s"] for r in rs)
            res[f"{prefix}floor_s"] = floor
            res[f"{prefix}round_time_over_floor"] = (
                sum(r["wall_s"] for r in rs) / floor if floor else 0.0)
        res["compute_model"] = {"verify": dict(zip(VERIFY, model.verify)),
                                "draft": dict(zip(DRAFT, model.draft)),
                                "fit_error": model.fit_error}
