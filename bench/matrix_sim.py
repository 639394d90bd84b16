"""bench/matrix.py's simulator figures: each cell's step replay (``specstream.sim.replay``)
with step costs fitted on another cell's runs, and the saved step records (``--save-steps``)
that let ``--replay-only`` refit it without running the cells again."""

from __future__ import annotations

import gzip
import json
import pickle
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

REPLAY_SEEDS = 8  # acceptance draws the replay averages over


# bench/ is no package: bench/matrix.py loads matrix_report by its path, then this module
report = sys.modules["matrix_report"]
BASELINE = report.BASELINE


def link_rate(record: dict[str, Any]) -> float:
    """The link as the cell's copies achieved it: bytes moved over the time it was busy."""
    runs = [r for r in record["_steps"].values() if r.get("link_busy_s")]
    moved = sum(r["link_bytes_h2d"] + r["link_bytes_d2h"] for r in runs)
    busy = sum(r["link_busy_s"] for r in runs)
    return moved / busy if busy else record["cell"]["link_gbps"] * 1e9


def sources_of(records: list[dict[str, Any]], i: int, calibration: str) -> list[dict[str, Any]]:
    """The cells cell ``i``'s replay takes its step costs from, never itself: ``next``, the
    next cell of the selection; ``pair``, that cell and the first cell after it whose prompts
    are of another length and whose default run held another number of requests at once
    (else the first of another length). A calibration pair: in one cell every request is of
    one length, so a request's price and its context tokens' cannot be told apart, and a
    price fitted at 1K extrapolates to 6K at random; and where both cells' rounds verified
    three requests, a round's fixed price and its per-request price cannot be told apart
    either (c04's replay, one request at a time, read a 21 ms constant off c05 and c06 and
    predicted its 14 ms rounds at 30 ms)."""
    n = len(records)
    first = records[(i + 1) % n]
    if calibration == "next":
        return [first]
    others = [records[(i + k) % n] for k in range(2, n)]
    others = [r for r in others if r["cell"]["context"] != first["cell"]["context"]]
    spans = [r for r in others if _at_once(r) != _at_once(first)]
    return [first, (spans or others)[0]] if others else [first]


def _at_once(record: dict[str, Any]) -> int | None:
    """The most requests the cell's default run held at once (None: not run)."""
    return (record.get("_steps", {}).get("default") or {}).get("max_concurrency")


def _merged_steps(sources: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """Run ``name``'s steps of every source cell, each step stamped with its cell's link."""
    runs = [(src, src["_steps"].get(name)) for src in sources]
    if any(r is None for _, r in runs):
        return None

    def stamp(rows: list[dict[str, Any]], src: dict[str, Any]) -> list[dict[str, Any]]:
        return [{**r, "link_bytes_per_s": link_rate(src)} for r in rows]

    return {"rounds": [x for src, r in runs for x in stamp(list(r["rounds"]), src)],
            "prefill_steps": [x for src, r in runs
                              for x in stamp(list(r.get("prefill_steps") or []), src)]}


def simulate(record: dict[str, Any], sources: list[dict[str, Any]]) -> dict[str, Any]:
    """The step replay of this cell's default and offload-spec runs, their step costs fitted
    on the ``sources`` cells' (never this one) resident, default and offload-spec runs."""
    from specstream.bench.runner import WARMUP_OUTPUT_TOKENS, WARMUP_PROMPT_TOKENS
    from specstream.models.config import ModelConfig
    from specstream.models.loader import resolve_dtype
    from specstream.sim.engine_model import Geometry
    from specstream.sim.host_replay import HostModel
    from specstream.sim.replay import ReplaySetup, replay_mean
    from specstream.sim.step_cost import (
        compute_ratio,
        fit_modes,
        pairs_per_query_token,
        scaled,
    )
    from specstream.sim.workload import AcceptanceModel

    # the bench's warm-up before the measured run: the policy's first decisions follow it
    warmup = (WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS)
    as_mode = {"resident": "resident", "default": "specstream", BASELINE: "offload-spec"}
    merged = {m: _merged_steps(sources, n) for n, m in as_mode.items()}
    fit_on = {m: v for m, v in merged.items() if v is not None}
    tcfg = ModelConfig.from_dir(_target_dir())
    # a cell's requests are all of one length: its attention pairs move with its query
    # tokens, and the pair's price comes from the model's shape (step_cost.fit_modes)
    prior = pairs_per_query_token(tcfg.num_layers, tcfg.hidden_size, tcfg.num_heads,
                                  tcfg.num_kv_heads, tcfg.head_dim, tcfg.intermediate_size)
    costs = fit_modes(fit_on, link_rate(sources[0]), pair_prior=prior)
    chain = record["_steps"].get("q4") or record["_steps"].get(BASELINE)
    mean = min(max(chain["mean_accepted_len"], 1.0), 4.999) if chain else 1.0
    acceptance = AcceptanceModel.from_mean(mean, 4)
    out: dict[str, Any] = {"costs_from": "+".join(s["cell"]["name"] for s in sources),
                           "alpha": acceptance.alpha,
                           "costs": {m: c.describe() for m, c in costs.items()}}
    for name in ("default", BASELINE):
        cfg, measured = record["_configs"].get(name), record["_steps"].get(name)
        mode = as_mode[name]
        if cfg is None or measured is None or mode not in costs:
            continue
        geometry = Geometry(tcfg.num_layers,
                            tcfg.kv_bytes_per_token(resolve_dtype(cfg.dtype, "cpu").itemsize))
        config, host = replace(cfg, link_gbps=None), None
        if config.host_attends:  # the host's costs as the other cells' same run measured them
            run = _merged_steps(sources, name) or {}
            host = HostModel.of_steps(list(run.get("rounds", ())) + list(
                run.get("prefill_steps", ())))
            if host is None:  # the host attended nothing there
                config = replace(config, host_attention="off")
        setup = ReplaySetup(mode=mode, config=config, geometry=geometry,
                            prompts=tuple(record["context_lengths"]),
                            output_len=record["output_len"], acceptance=acceptance,
                            cost=costs[mode], link_bw=link_rate(record), host=host,
                            warmup=warmup)
        got = replay_mean(setup, seeds=REPLAY_SEEDS).result
        out[name] = {"throughput": got.throughput, "tpot_s": got.tpot_s,
                     **errors(got, measured)}
        # the same replay at the cell's own compute speed (a diagnostic, not the target: it
        # reads one number off this cell's measured steps): what is left is the replay's
        # steps and waits, not the other cells' machine time
        ratio = compute_ratio(costs[mode], list(measured["rounds"]) + list(
            measured.get("prefill_steps") or ()), link_rate(record))
        if ratio is not None:
            own = replay_mean(replace(setup, cost=scaled(costs[mode], ratio)),
                              seeds=REPLAY_SEEDS).result
            out[name].update({"compute_ratio": ratio, **{
                f"{k}_own_speed": v for k, v in errors(own, measured).items()}})
    return out


def errors(got: Any, measured: dict[str, Any]) -> dict[str, float | None]:
    """A replay's relative errors on the measured run's throughput and TPOT."""
    return {"throughput_error": report.rel_error(got.throughput,
                                                 measured["output_tokens_per_s"]),
            "tpot_error": report.rel_error(got.tpot_s, measured["tpot_s"])}


def add_replay(records: list[dict[str, Any]], calibration: str = "pair") -> None:
    """Each cell's replay, its costs fitted on other cells' runs (``sources_of``), and its
    figures."""
    for i, rec in enumerate(records):
        if len(records) > 1:
            try:
                rec["sim"] = simulate(rec, sources_of(records, i, calibration))
            except (ValueError, RuntimeError) as e:
                rec["sim"] = {"error": f"{type(e).__name__}: {e}"}
        rec["analysis"] = report.analyse(rec)


def save_steps(out: dict[str, Any], records: list[dict[str, Any]], path: Path) -> None:
    """The cells' records with their step records and resolved configs, and the run's other
    fields (``--save-steps``); paths in the configs relative to the checkout, as in the
    JSON."""
    root = str(Path(__file__).resolve().parents[1]) + "/"

    def local(cfg: Any) -> Any:
        paths = {f.name: getattr(cfg, f.name).removeprefix(root) for f in fields(cfg)
                 if isinstance(getattr(cfg, f.name), str)
                 and getattr(cfg, f.name).startswith(root)}
        return replace(cfg, **paths) if paths else cfg

    kept = [{**r, "_configs": {n: local(c) for n, c in r.get("_configs", {}).items()}}
            for r in records]
    with gzip.open(path, "wb") as f:
        pickle.dump({"out": {k: v for k, v in out.items() if k != "cells"},
                     "records": kept}, f)


def replay_only(path: Path, results: Path, name: str | None, calibration: str = "pair") -> int:
    """``--replay-only``: the replay and the figures of saved cells, nothing run again (the
    runs' figures are the saved ones; only ``sim`` and ``analysis`` are recomputed)."""
    with gzip.open(path, "rb") as f:
        saved = pickle.load(f)
    records: list[dict[str, Any]] = saved["records"]
    add_replay(records, calibration)
    out = {**saved["out"], "replayed_from": path.name, "calibration": calibration,
           "cells": [{k: v for k, v in r.items() if not k.startswith("_")} for r in records]}
    out["summary"] = report.summary(out["cells"])
    stem = name or path.name.removesuffix(".pkl.gz").removesuffix("-steps") + "-replay"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{stem}.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    md = report.markdown(out)
    (results / f"{stem}.md").write_text(md)
    print(md)
    return 0


def _target_dir() -> Path:
    from specstream.llm import default_model_dir

    return default_model_dir("target")
