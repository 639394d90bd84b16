"""The ``calibration`` section of a bench report, in the schema ``specstream simulate`` reads
(see ``specstream.sim.calibrate``): measured link rate, per-round compute samples, models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specstream.bench.runner import BenchSettings
from specstream.bench.workload import Workload
from specstream.engine.layout import auto_chunk_tokens
from specstream.models.config import ModelConfig


def _model_info(folder: str | Path, name: str, dtype_bytes: int) -> dict[str, Any]:
    cfg = ModelConfig.from_dir(folder)
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    attn = h * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    params = cfg.num_layers * (attn + 3 * h * i) + v * h * (1 if cfg.tie_word_embeddings else 2)
    return {"name": name, "num_layers": cfg.num_layers,
            "kv_bytes_per_token": cfg.kv_bytes_per_token(dtype_bytes),
            "weight_bytes": params * dtype_bytes}


def calibration_from(
    results: dict[str, dict[str, Any]], s: BenchSettings, workload: Workload
) -> dict[str, Any]:
    from specstream.llm import default_model_dir

    target = s.model or default_model_dir("target")
    draft = s.draft_model or default_model_dir("draft")
    dtype_bytes = 4 if s.device == "cpu" and s.dtype in ("auto", "float32") else 2
    q = s.resolved("resident").q
    verify, draft_steps = [], []
    for r in results.get("resident", {}).get("rounds", []):
        # resident rounds: no link; compute = verification + sequential drafting. Rounds that
        # also carried a prefill chunk are left out: they are not one verification.
        if r["prefill_tokens"]:
            continue
        verify.append({"query_tokens": r["query_tokens"], "q_per_request": q + 1,
                       "context_tokens": r["context_tokens"],
                       "seconds": max(0.0, r["compute_s"] - r["draft_s"])})
        if r["draft_s"] > 0:
            draft_steps.append({"query_tokens": r["num_seqs"], "q_per_request": 1,
                                "context_tokens": r["num_seqs"] * 1024,
                                "seconds": r["draft_s"] / max(1, q)})
    # link rate as the copies achieved it: all bytes moved over the time the link was busy
    moved = sum(m["link_bytes_h2d"] + m["link_bytes_d2h"] for m in results.values())
    busy = sum(m["link_busy_s"] for m in results.values())
    link_rate = moved / busy if busy else (s.link_gbps or 0) * 1e9
    # prefill: a request's prompt, from resident's prefill-only steps (no link involved)
    res = results.get("resident", {})
    prefill = {}
    if res.get("prefill_only_time_s"):
        per_request = res["prefill_only_time_s"] / workload.num_requests
        prefill = {"target": {"samples": [{"tokens": max(workload.context_lengths),
                                           "seconds": per_request}]}}
    ss = results.get("specstream") or results.get("offload-spec") or {}
    info = _model_info(target, Path(target).name, dtype_bytes)
    chunk = s.chunk_tokens or auto_chunk_tokens(  # the chunk the engine resolved
        s.device_kv_bytes, s.staging_buffers * s.wave_requests * info["kv_bytes_per_token"]
        // info["num_layers"], s.block_size)
    return {
        "schema": 1,
        "device": s.device,
        "link_bytes_per_s": link_rate,
        "device_memory_bytes": s.device_kv_bytes,
        "device_budget_covers": "kv",  # the engine's KV budget; weights are outside it
        "host_memory_bytes": s.host_kv_bytes,
        "target": info,
        "draft": _model_info(draft, Path(draft).name, dtype_bytes),
        "verify_time": {"samples": verify},
        "draft_step_time": {"samples": draft_steps},
        "prefill_time": prefill,
        "engine": {"chunk_tokens": chunk, "staging_buffers": s.staging_buffers,
                   "wave_requests": s.wave_requests,
                   "resident_tail": s.resident_tail_tokens,
                   "offload_threshold": s.offload_after_tokens, "draft_window": 1024,
                   "groups": 2,
                   # the scheduler's knobs the step replay (specstream.sim.replay) needs; it
                   # costs steps with the per-step samples under modes[*].rounds
                   "max_prefill_tokens": s.max_prefill_tokens, "block_size": s.block_size,
                   "max_num_seqs": s.max_num_seqs},
        "workload": {"context_lengths": list(workload.context_lengths),
                     "output_len": workload.output_len, "num_requests": workload.num_requests,
                     "concurrency": workload.num_requests, "arrival_rate": None},
        "q": q,
        "acceptance": {"alpha": max(0.01, min(0.99, ss.get("acceptance_rate", 0.5)))},
    }
