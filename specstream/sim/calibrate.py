"""Calibrate the simulator on a ``specstream bench`` run and predict that run's results.

The bench writes one JSON object. The simulator reads two top-level keys; anything else (e.g.
``"synthetic"``, ``"note"``, run metadata) is ignored. Times in seconds, sizes in bytes.

``"calibration"`` -- the costs measured on this machine, and what was run::

    {
      "schema": 1,
      "device": "cpu",                        # free text
      "link_bytes_per_s": 2.0e9,              # measured host->device bandwidth (emulated or
                                              #   pinned), as the engine's copy worker sees it
      "device_memory_bytes": 6.0e8,           # the device budget every mode ran under
      "device_budget_covers": "all",          # optional: "all" (weights + KV + buffers) or
                                              #   "kv" (the engine's device_kv_bytes: weights
                                              #   come on top); a bench file whose settings'
                                              #   device_kv_bytes equals the budget is "kv"
      "host_memory_bytes": 1.6e10,            # optional; default unbounded
      "target": {"name": "tiny-target", "num_layers": 8,
                 "kv_bytes_per_token": 16384, "weight_bytes": 2.4e8},
      "draft":  {"name": "tiny-draft", "num_layers": 4,
                 "kv_bytes_per_token": 8192, "weight_bytes": 4.0e7},
      "verify_time": {                        # one batched TARGET forward (all layers), the KV
                                              #   already on the device (no transfer inside)
        "coefficients": {"const_s": 0.004, "per_query_token_s": 1e-4,
                         "per_context_token_s": 2e-7, "per_context_query_s": 5e-8},
        "samples": [{"query_tokens": 20, "q_per_request": 5,
                     "context_tokens": 40000, "seconds": 0.031}]
      },                                      # either part may be absent: samples are fitted
                                              #   (non-negative least squares) when no
                                              #   coefficients are given. query_tokens = batch
                                              #   total; context_tokens = batch total attended
      "draft_step_time": {...same shape...},  # one batched DRAFT forward (q_per_request = 1,
                                              #   context_tokens = draft KV attended)
      "prefill_time": {                       # one request's prompt: const + a*t + b*t^2
        "target": {"const_s": 0.01, "per_token_s": 2e-5, "per_token_sq_s": 1e-10},
        "draft":  {"samples": [{"tokens": 4096, "seconds": 0.02}]}
      },
      "corun_slowdown": 0.05,                 # optional: measured verify slowdown with the
                                              #   draft co-running (default: policy's 0.05)
      "engine": {"chunk_tokens": 2048, "staging_buffers": 2, "resident_tail": 512,
                 "offload_threshold": 8192, "draft_window": null, "groups": 2,
                 "residency": "fill"},
                                              # SimPolicy fields as the engine ran (others are
                                              #   ignored); draft_window null = whole draft KV;
                                              #   residency absent = "tail" (files from before
                                              #   "fill" existed), else the top-level
                                              #   settings' "residency"
      "workload": {"context_lengths": [16384, 16384], "output_len": 64,
                   "num_requests": 8, "concurrency": 4, "arrival_rate": null},
      "q": 4,                                 # drafts per round the spec modes ran with
      "acceptance": {"q": 4, "accepted_counts": [30, 25, 20, 15, 10]}
    }                                         # accepted_counts[k]: verification rounds in which
                                              #   k of q drafts were accepted (or "alpha": 0.7)

``"engine"`` may also carry the scheduler's ``max_prefill_tokens``, ``block_size`` and
``max_num_seqs`` (the step replay reads them; else the top-level ``"settings"``, else 1024, 128,
64).

``"modes"`` -- what the bench measured, per mode run (any subset of the five)::

    {"offload": {"output_tokens_per_s": 41.0,   # required: output tokens / wall time
                 "ttft_s": 1.2, "tpot_s": 0.09,  # optional, compared when present
                 "link_utilisation": 0.93,       # optional: link busy / wall time
                 "mean_round_s": 0.085,          # optional
                 "max_concurrency": 9}, ...}

With per-step samples (as ``specstream bench`` writes them) the prediction is the step replay of
``specstream.sim.replay`` (the engine's own scheduler over the top-level ``"settings"``, the
bench's ``BenchSettings``), which also reads, per mode: ``"rounds"`` (decode steps) and
``"prefill_steps"`` (steps that only prefilled), each ``{"compute_s", "wait_s", "link_bytes",
"history_bytes", "query_tokens", "context_tokens", "attention_pairs", "num_seqs",
"prefill_tokens", "draft_tokens", "draft_seqs"}`` (``step_cost.py``), and
``"mean_accepted_len"`` (the acceptance, when ``"acceptance"`` has no histogram).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from specstream.sim.api import Scenario, simulate
from specstream.sim.costs import FittedCosts, LinearFit, PrefillFit
from specstream.sim.policy import MODES, SimPolicy
from specstream.sim.serving import ModeResult
from specstream.sim.workload import AcceptanceModel, Workload

_FORWARD = ("const_s", "per_query_token_s", "per_context_token_s", "per_context_query_s")
_PREFILL = ("const_s", "per_token_s", "per_token_sq_s")


def nnls(features: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (active set: drop the most negative)."""
    active = list(range(features.shape[1]))
    coef = np.zeros(features.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(features[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def _fit(spec: dict[str, Any], names: Sequence[str], rows: Any) -> dict[str, float]:
    if "coefficients" in spec or "samples" not in spec:
        src = spec.get("coefficients", spec)
        return {k: float(src.get(k, 0.0)) for k in names}
    x = np.array([rows(s) for s in spec["samples"]], dtype=float)
    y = np.array([s["seconds"] for s in spec["samples"]], dtype=float)
    return dict(zip(names, (float(v) for v in nnls(x, y)), strict=True))


def forward_fit(spec: dict[str, Any]) -> LinearFit:
    return LinearFit(**_fit(spec, _FORWARD, lambda s: (
        1.0, s["query_tokens"], s["context_tokens"],
        s["context_tokens"] * s.get("q_per_request", 1))))


def prefill_fit(spec: dict[str, Any]) -> PrefillFit:
    return PrefillFit(**_fit(spec, _PREFILL, lambda s: (1.0, s["tokens"], s["tokens"] ** 2)))


def scenario_from_calibration(cal: dict[str, Any]) -> Scenario:
    """The bench's run as a Scenario whose costs are the measured ones."""
    t, d = cal["target"], cal["draft"]
    prefill = cal.get("prefill_time", {})
    budget = float(cal["device_memory_bytes"])
    if cal.get("device_budget_covers", "all") == "kv":  # the simulator's budget holds weights
        budget += float(t.get("weight_bytes", 0)) + float(d.get("weight_bytes", 0))
    costs = FittedCosts(
        link_bw=float(cal["link_bytes_per_s"]),
        device_budget_bytes=budget,
        host_budget_bytes=float(cal.get("host_memory_bytes") or 1e18),
        num_layers=(int(t["num_layers"]), int(d["num_layers"])),
        kv_per_token=(float(t["kv_bytes_per_token"]), float(d["kv_bytes_per_token"])),
        weights=(float(t.get("weight_bytes", 0)), float(d.get("weight_bytes", 0))),
        forward=(forward_fit(cal["verify_time"]), forward_fit(cal["draft_step_time"])),
        prefill=(prefill_fit(prefill.get("target", {})), prefill_fit(prefill.get("draft", {}))),
    )
    known = SimPolicy.__dataclass_fields__
    engine = {k: v for k, v in cal.get("engine", {}).items() if k in known}
    engine.setdefault("residency", "tail")  # calibrations from before "fill" existed
    if "corun_slowdown" in cal:
        engine["corun_slowdown"] = float(cal["corun_slowdown"])
    policy = SimPolicy(q=int(cal["q"]), **engine)
    w = cal["workload"]
    workload = Workload(tuple(int(c) for c in w["context_lengths"]), int(w["output_len"]),
                        w.get("concurrency"), w.get("arrival_rate"), w.get("num_requests"))
    acc = cal["acceptance"]
    acceptance = (AcceptanceModel(alpha=float(acc["alpha"])) if "alpha" in acc else
                  AcceptanceModel(accepted_counts=tuple(int(n) for n in acc["accepted_counts"]),
                                  measured_q=int(acc["q"])))
    return Scenario(costs, workload, acceptance, policy,
                    label=f"calibrated on {cal.get('device', 'bench')}: {t['name']}+{d['name']}")


def residency_of(data: dict[str, Any]) -> str:
    """The residency a bench run used: its settings' (or calibration engine's) ``residency``;
    "tail" when neither says, as every run made before ``fill`` existed."""
    engine = data.get("calibration", {}).get("engine", {})
    return str(data.get("settings", {}).get("residency") or engine.get("residency") or "tail")


def load_bench(path: str | Path) -> tuple[Scenario, dict[str, dict[str, float]]]:
    """Read a bench JSON: (the calibrated scenario, the measured results per mode)."""
    data = _read(path)
    if "calibration" not in data:
        raise ValueError(f"{path}: no top-level 'calibration' key (see calibrate.py)")
    cal = dict(data["calibration"])
    settings = data.get("settings", {})
    kv_budget = settings.get("device_kv_bytes")
    if "device_budget_covers" not in cal and kv_budget == cal.get("device_memory_bytes"):
        cal["device_budget_covers"] = "kv"
    cal["engine"] = {**cal.get("engine", {}), "residency": residency_of(data)}
    scenario = scenario_from_calibration(cal)
    if data.get("modes"):  # the per-token rate behind the measured accepted length
        from specstream.sim.replay import acceptance_of

        scenario = replace(scenario, acceptance=acceptance_of(data))
    return scenario, dict(data.get("modes", {}))


def _read(path: str | Path) -> dict[str, Any]:
    with Path(path).open() as f:
        return dict(json.load(f))


def has_steps(data: dict[str, Any]) -> bool:
    return any(m.get("rounds") for m in data.get("modes", {}).values())


def predict(path: str | Path, model: str = "auto", costs_from: str | Path | None = None,
            ) -> tuple[Scenario, list[ModeResult], dict[str, dict[str, float]]]:
    """Predict every mode the bench measured (all five if it lists none).

    ``model``: "replay" runs the bench's workload through the engine's own scheduler step by
    step (``specstream.sim.replay``; needs the per-step samples ``modes[*].rounds``),
    "pipeline" runs the steady-state round pipeline of the datacenter model, "auto" replays
    when the samples are there. ``costs_from``: another bench JSON whose measured steps cost
    the replay (out of sample: its workload, link and acceptance stay this file's).
    """
    scenario, measured = load_bench(path)
    modes = [m for m in MODES if m in measured] or list(MODES)
    data = _read(path)
    if model == "pipeline" or (model == "auto" and not has_steps(data)):
        return scenario, simulate(scenario, modes), measured
    if not has_steps(data):
        raise ValueError(f"{path}: no per-step samples (modes[*].rounds) to replay")
    from specstream.sim.replay import replay_mean, setups

    runs = setups(data, _read(costs_from) if costs_from is not None else None)
    return scenario, [replay_mean(runs[m]).result for m in modes if m in runs], measured


METRICS = (("output_tokens_per_s", "throughput", "output tok/s"), ("tpot_s", "tpot_s", "TPOT"),
           ("ttft_s", "ttft_s", "TTFT"))


def relative_errors(results: Sequence[ModeResult], measured: dict[str, dict[str, float]],
                    metric: str = "output_tokens_per_s") -> dict[str, float]:
    """(predicted - measured) / measured per measured mode, of output throughput or of another
    of METRICS (``tpot_s``, ``ttft_s``: the bench's medians)."""
    attr = {k: a for k, a, _ in METRICS}[metric]
    out = {}
    for r in results:
        got = measured.get(r.mode, {}).get(metric)
        if got:
            out[r.mode] = (float(getattr(r, attr)) - float(got)) / float(got)
    return out


def comparison_table(results: Sequence[ModeResult],
                     measured: dict[str, dict[str, float]]) -> str:
    """Predicted vs measured per mode, markdown."""
    errors = relative_errors(results, measured)
    lines = ["| mode | predicted tok/s | measured tok/s | rel. error | predicted link util. "
             "| measured link util. | predicted TPOT ms | measured TPOT ms |",
             "|" + " --- |" * 8]
    for r in results:
        m = measured.get(r.mode, {})
        err = f"{errors[r.mode]:+.1%}" if r.mode in errors else "-"
        mlu = f"{m['link_utilisation']:.0%}" if "link_utilisation" in m else "-"
        mtpot = f"{m['tpot_s'] * 1e3:.1f}" if "tpot_s" in m else "-"
        got = m.get("output_tokens_per_s")
        got_s = f"{float(got):.2f}" if got is not None else "-"
        lines.append(f"| {r.mode} | {r.throughput:.2f} | {got_s} "
                     f"| {err} | {r.link_utilisation:.0%} | {mlu} | {r.tpot_s * 1e3:.1f} "
                     f"| {mtpot} |")
    return "\n".join(lines)


def validation_table(path: str | Path, costs_from: str | Path) -> tuple[str, dict[str, float]]:
    """Markdown: per mode and metric (output throughput, TPOT, TTFT) the measured value of
    ``path``, the replay costed from ``path`` itself (IN SAMPLE: the step costs were fitted on
    the very run they predict) and from ``costs_from`` (OUT OF SAMPLE: fitted on another run);
    and the out-of-sample errors, per "mode metric"."""
    _, own, measured = predict(path, "replay")
    _, other, _ = predict(path, "replay", costs_from)
    lines = [f"| mode | metric | measured | in sample (costs from {Path(path).name}) "
             f"| out of sample (costs from {Path(costs_from).name}) |", "|" + " --- |" * 5]
    worst: dict[str, float] = {}
    for key, attr, label in METRICS:
        e_in, e_out = relative_errors(own, measured, key), relative_errors(other, measured, key)
        scale, unit = (1.0, "") if key == "output_tokens_per_s" else (
            (1e3, " ms") if key == "tpot_s" else (1.0, " s"))
        for a, b in zip(own, other, strict=True):
            if a.mode not in e_in or a.mode not in e_out:
                continue
            got = float(measured[a.mode][key]) * scale
            lines.append(f"| {a.mode} | {label} | {got:.3g}{unit} "
                         f"| {getattr(a, attr) * scale:.3g}{unit} ({e_in[a.mode]:+.1%}) "
                         f"| {getattr(b, attr) * scale:.3g}{unit} ({e_out[a.mode]:+.1%}) |")
            worst[f"{a.mode} {label}"] = e_out[a.mode]
    return "\n".join(lines), worst


def error_summary(paths: Sequence[str | Path],
                  costs_from: Sequence[str | Path | None] | None = None) -> str:
    """Markdown: per bench file and mode, measured tok/s and the relative error of the step
    replay costed from the same file (in sample), from another file (``costs_from[i]``, out
    of sample) and of the steady-state round pipeline ("does not fit": its memory model
    admits no request)."""
    lines = ["| bench file | mode | measured tok/s | replay, in sample | replay, costs from | "
             "round pipeline |", "|" + " --- |" * 6]
    for i, path in enumerate(paths):
        other = costs_from[i] if costs_from else None
        _, replayed, measured = predict(path, "replay")
        crossed = relative_errors(predict(path, "replay", other)[1], measured) if other else {}
        pipe = predict(path, "pipeline")[1]
        piped = {m: f"{e:+.1%}" for m, e in relative_errors(pipe, measured).items()}
        piped.update({r.mode: "does not fit" for r in pipe if not r.feasible})
        errs = relative_errors(replayed, measured)
        src = Path(other).name if other else "-"
        for r in replayed:
            cross = f"{crossed[r.mode]:+.1%} ({src})" if r.mode in crossed else "-"
            lines.append(f"| {Path(path).name} | {r.mode} | "
                         f"{float(measured[r.mode]['output_tokens_per_s']):.2f} | "
                         f"{errs[r.mode]:+.1%} | {cross} | {piped.get(r.mode, '-')} |")
    return "\n".join(lines)
