"""Replaying runs that an older engine recorded: what they ran with where the engine's defaults
have moved since, and their acceptance at the depths they ran (issue 30)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specstream.sim.engine_model import engine_config
from specstream.sim.replay import acceptance_of, depths_of, setups
from specstream.sim.workload import AcceptanceModel

RESULTS = Path(__file__).parents[1] / "bench" / "results"
# `specstream bench` with speculative_policy left to the default of its day (auto), q <= 4
AUTO_RUN = RESULTS / "bench-cpu.json"


def test_settings_a_run_predates_are_what_it_ran_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """No speculative_policy in the file: fixed chains of q (auto and trees came later); no
    host_attention: off, whatever cores the machine running the replay has."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    old = {"num_speculative_tokens": 4, "device_kv_bytes": 64 << 20}
    for mode in ("specstream", "parallel-spec"):
        c = engine_config(old, mode)
        assert c.policy.value == "fixed" and not c.tree
        assert c.host_attention.value == "off" and not c.merge_groups
    # a None policy is the auto default of the run's day; a named one is kept
    assert engine_config({**old, "speculative_policy": None}, "specstream") \
        .policy.value == "auto"
    assert engine_config({**old, "host_attention": "auto"}, "specstream") \
        .host_attention.value == "auto"


def test_acceptance_from_means_at_the_depths_run() -> None:
    """Rounds at q throughout: the closed form's inverse, as before. Shallower rounds reach
    the same mean with fewer drafts, so they imply a higher per-token rate."""
    assert AcceptanceModel.from_depth_means([(2.5, {4: 1})]).alpha == pytest.approx(
        AcceptanceModel.from_mean(2.5, 4).alpha)
    mixed = AcceptanceModel.from_depth_means([(2.0, {1: 50, 4: 50})]).alpha
    assert mixed > AcceptanceModel.from_mean(2.0, 4).alpha
    expected = 0.5 * (AcceptanceModel.closed_form(mixed, 1)
                      + AcceptanceModel.closed_form(mixed, 4))
    assert expected == pytest.approx(2.0)


def test_auto_run_acceptance_explains_every_mode() -> None:
    """bench-cpu.json ran auto: its modes chose depths 1, 2 and 4 in different mixes, so their
    mean accepted lengths differ (1.82-2.32). One alpha at the depths each ran explains every
    mode within 4%; the old inversion (every round at q = 4) fell 6-17% short, and the replay
    then needed more rounds than the engine did."""
    data = json.loads(AUTO_RUN.read_text())
    alpha = acceptance_of(data).alpha
    assert alpha is not None
    for name, m in data["modes"].items():
        if name == "offload":
            continue
        depths = depths_of(m, 4)
        mean = sum(n * AcceptanceModel.closed_form(alpha, d) for d, n in depths.items()) \
            / sum(depths.values())
        assert mean == pytest.approx(m["mean_accepted_len"], rel=0.04), name


def test_auto_run_replays_with_auto() -> None:
    for mode, s in setups(json.loads(AUTO_RUN.read_text())).items():
        if s.config.speculative:
            assert s.config.policy.value == "auto", mode
