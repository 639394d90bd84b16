"""The step replay of a ``specstream bench --workload shared-doc`` run: N requests over one shared
document, every offloading mode with prefix sharing off and on.

Such a file holds ``{"command", "workload", "modes": {mode: {"off": run, "on": run}}}``: per
run the same per-step samples as a single-workload bench (``rounds``, ``prefill_steps``), but
no ``calibration`` or ``settings`` block. What the replay needs is read as follows:

- the engine's settings: the recorded command through the bench's own parser, presets and
  ``settings_from`` (the device is the CPU: the run emulated its link, ``link_bytes_per_s``);
  ``prefix_sharing`` per run, as the bench set it; host attention on where the run's steps
  attended on the host (the engine's default ``auto`` turned it on there), with the host's
  costs fitted on that run's steps (``host_replay.HostModel``);
- the geometry: the target's layers from its model folder, its KV bytes per token from the
  file's own ``unique_kv_bytes`` / ``unique_tokens``;
- the workload: ``doc_len + own_len`` tokens per request, the first ``doc_len`` the same token
  ids for all (``ReplaySetup.shared_prefix``), so the engine's prefix sharing engages exactly
  as it did in the run;
- step costs: fitted jointly on every run's measured steps (``step_cost.fit_modes``: the
  target's forward shared, each run's constant and draft columns its own), in sample unless
  ``costs_from`` names another shared-doc file;
- acceptance: the i.i.d. rate at which the fake worker's chains and trees explain every
  speculative run's mean accepted length with the shapes it verified (``acceptance_of``).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from specstream.engine.policy.round_shape import AcceptanceEstimate, Shape, expected_tokens
from specstream.sim.engine_model import Geometry, engine_config
from specstream.sim.fake_worker import RANK_DECAY
from specstream.sim.host_replay import HostModel
from specstream.sim.replay import ReplayRun, ReplaySetup, depths_of, replay_mean
from specstream.sim.step_cost import fit_modes
from specstream.sim.workload import AcceptanceModel

SHARING = ("off", "on")


def is_shared_bench(data: dict[str, Any]) -> bool:
    """Whether a bench JSON is a shared-prefix run (``modes[mode]`` = {"off", "on"})."""
    modes = data.get("modes") or {}
    return bool(modes) and all(isinstance(v, dict) and set(v) <= set(SHARING) and v
                               for v in modes.values())


def runs_of(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every measured run, keyed ``"mode sharing"`` (e.g. ``"specstream on"``)."""
    return {f"{mode} {sh}": run for mode, v in data["modes"].items() for sh, run in v.items()}


def settings_of(command: str) -> dict[str, Any]:
    """The ``BenchSettings`` a recorded ``specstream bench ...`` command ran with, as a bench
    JSON's ``settings`` (the bench's own parser, presets and ``settings_from``)."""
    from specstream.bench.cli import add_parser, settings_from

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    words = shlex.split(command)
    args = parser.parse_args(words[words.index("bench"):])
    if args.device == "auto":  # an emulated link: the run was on the CPU
        args.device = "cpu"
    s = settings_from(args)
    return {**{k: v for k, v in vars(s).items() if k != "extra"}, **s.extra}


def geometry_of(data: dict[str, Any], settings: dict[str, Any]) -> Geometry:
    from specstream.llm import default_model_dir
    from specstream.models.config import ModelConfig

    w = data["workload"]
    folder = settings.get("model") or default_model_dir("target")
    layers = ModelConfig.from_dir(folder).num_layers
    return Geometry(layers, int(w["unique_kv_bytes"]) // int(w["unique_tokens"]))


def acceptance_of(data: dict[str, Any], topk: int) -> AcceptanceModel:
    """The i.i.d. rate at which the fake worker's chains and trees (``FakeWorker``: rank r
    accepted at ``RANK_DECAY`` ** r of rank 0) explain every speculative run's mean accepted
    length with the shapes it verified: its depths (``speculative_depth_chosen``), as trees
    of its mean nodes per tree round (``mean_tree_nodes_per_round``, ``topk`` children a
    node) where it verified trees. ``AcceptanceModel.from_depth_means`` reads every round as
    a chain: these runs verified 10-29-node trees, which accept more than a chain of their
    depth, so it would credit the draft with a higher rate (0.81 here against 0.68) and the
    replay's round-shape policy, seeing chains that good, would verify smaller trees than the
    engine did."""
    runs = [r for r in runs_of(data).values()
            if r.get("mean_accepted_len", 0) > 1.0 and r.get("speculative_depth_chosen")]
    if not runs:
        raise ValueError("no speculative run with a mean accepted length")

    def excess(alpha: float) -> float:
        est = AcceptanceEstimate(prior=tuple(alpha * RANK_DECAY ** k for k in range(topk)))
        total = 0.0
        for r in runs:
            depths, nodes = depths_of(r, 4), round(r.get("mean_tree_nodes_per_round") or 0)
            shapes = {d: Shape(d, topk, nodes) if topk > 1 and nodes > d else Shape(d)
                      for d in depths}
            total += sum(n * expected_tokens(shapes[d], est) for d, n in depths.items()) / sum(
                depths.values()) - float(r["mean_accepted_len"])
        return total

    lo, hi = 0.0, 1.0 - 1e-9
    for _ in range(60):  # expected tokens increase with alpha: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
    return AcceptanceModel(alpha=(lo + hi) / 2)


def shared_setups(data: dict[str, Any], costs_from: dict[str, Any] | None = None
                  ) -> dict[str, ReplaySetup]:
    """One replay setup per measured run, keyed as ``runs_of``."""
    settings = settings_of(data["command"])
    w = data["workload"]
    if w.get("workload") != "shared-doc":
        raise ValueError(f"the replay models the shared-doc workload, not {w.get('workload')}")
    geometry = geometry_of(data, settings)
    runs = runs_of(data)
    link_bw = float(next(iter(runs.values()))["link_bytes_per_s"])
    source = runs_of(costs_from) if costs_from is not None else runs
    costs = fit_modes(source, link_bw)
    acceptance: AcceptanceModel | None = None
    out = {}
    for key, run in runs.items():
        mode, sharing = key.split()
        host = HostModel.of_steps(list(run.get("rounds", ())) + list(run.get("prefill_steps", ())))
        config = engine_config(settings, mode, prefix_sharing=sharing == "on",
                               host_attention="auto" if host is not None else "off")
        if acceptance is None and config.speculative:
            acceptance = acceptance_of(data, config.topk)
        out[key] = ReplaySetup(
            mode=mode, config=config, geometry=geometry,
            prompts=(int(w["doc_len"]) + int(w["own_len"]),) * int(w["num_requests"]),
            output_len=int(w["output_len"]),
            acceptance=acceptance or AcceptanceModel(alpha=0.0), cost=costs[key],
            link_bw=link_bw, shared_prefix=int(w["doc_len"]), host=host)
    return out


def shared_predictions(path: str | Path, costs_from: str | Path | None = None,
                       seeds: int | None = None) -> tuple[dict[str, Any], dict[str, ReplayRun]]:
    """(the file's data, the replay of each of its runs)."""
    import json

    data = json.loads(Path(path).read_text())
    other = json.loads(Path(costs_from).read_text()) if costs_from else None
    return data, {k: replay_mean(s, seeds) for k, s in shared_setups(data, other).items()}


def shared_table(data: dict[str, Any], predicted: dict[str, ReplayRun]) -> tuple[str, dict]:
    """Markdown: per mode and sharing, throughput, TPOT and history bytes per round, predicted
    against measured; then the sharing gain (on over off), predicted against measured. Also
    the throughput errors, keyed as ``runs_of``."""
    runs = runs_of(data)
    lines = ["| mode | sharing | measured tok/s | predicted tok/s | error | measured TPOT ms "
             "| predicted TPOT ms | error | measured MB / round | predicted MB / round |",
             "|" + " --- |" * 10]
    errors: dict[str, float] = {}
    for key, p in predicted.items():
        m, r = runs[key], p.result
        got, tpot = float(m["output_tokens_per_s"]), float(m["tpot_s"])
        errors[key] = r.throughput / got - 1
        lines.append(f"| {key.replace(' ', ' | ')} | {got:.1f} | {r.throughput:.1f} "
                     f"| {errors[key]:+.1%} | {tpot * 1e3:.1f} | {r.tpot_s * 1e3:.1f} "
                     f"| {r.tpot_s / tpot - 1:+.1%} "
                     f"| {float(m['link_bytes_per_round']) / 1e6:.2f} "
                     f"| {p.link_bytes_per_round / 1e6:.2f} |")
    lines += ["", "| mode | measured sharing gain | predicted sharing gain |", "|" + " --- |" * 3]
    for mode in data["modes"]:
        on, off = f"{mode} on", f"{mode} off"
        if on in predicted and off in predicted:
            got = float(runs[on]["output_tokens_per_s"]) / float(runs[off]["output_tokens_per_s"])
            want = predicted[on].result.throughput / predicted[off].result.throughput
            lines.append(f"| {mode} | {got:.2f}x | {want:.2f}x |")
    return "\n".join(lines), errors
