"""`mechanics`: an 8B-shaped Qwen3 target (random bf16 weights) and a 0.6B-shaped draft at
16K-32K contexts under a device KV budget that forces offloading: decode throughput per mode,
link GB/s and utilisation during decode, and round time over its floor.

Each mode runs the engine's own attention path: ``attention_backend`` is an engine option,
``--attention-backend`` for every mode, or a ``+torch`` / ``+triton`` suffix on one mode
(``specstream+torch``: the same run with the torch path, for comparison)."""

from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .device import sync
from .results import update

SHAPES = {  # Qwen3-8B / Qwen3-0.6B layer shapes; tiny ones for the CPU dry run
    "target": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                   tie_word_embeddings=False),
    "draft": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                  tie_word_embeddings=True),
    "tiny-target": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=128,
                        tie_word_embeddings=False),
    "tiny-draft": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, intermediate_size=64,
                       tie_word_embeddings=True),
}


def _raw_config(shape: dict[str, Any], vocab: int) -> dict[str, Any]:
    """The HF config.json of a Qwen3 model of ``shape``."""
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
            "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": vocab - 1, **shape}


def random_checkpoint(folder: Path, shape: dict[str, Any], vocab: int, device: str) -> Path:
    """An HF-format Qwen3 folder with random bf16 weights (reused if already there)."""
    from safetensors.torch import save_file

    from specstream.models.config import ModelConfig
    from specstream.models.loader import build_model

    if (folder / "model.safetensors").is_file():
        return folder
    raw = _raw_config(shape, vocab)
    model = build_model(ModelConfig.from_dict(raw), torch.bfloat16, device)
    gen = torch.Generator(device).manual_seed(len(folder.name))
    tensors = {}
    for name, param in model.named_parameters():  # tied lm_head is listed once
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)
        tensors[name] = param.data.cpu()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return folder


def _geometry(args: argparse.Namespace, shape: dict[str, Any], vocab: int) -> dict[str, Any]:
    """Block/chunk sizes, contexts and KV budgets: tails + staging fit, the history does not.
    The budgets are the engine's own accounting (``_budgets``), not a copy of it."""
    g: dict[str, Any] = (
        dict(block_size=16, chunk_tokens=64, offload_after_tokens=64, resident_tail_tokens=32,
             max_prefill_tokens=128, contexts=[200, 100], decode_tokens=8, q=3)
        if args.tiny else
        dict(block_size=1024, chunk_tokens=4096, offload_after_tokens=2048,
             resident_tail_tokens=1024, max_prefill_tokens=2048,
             contexts=[32768, 16384, 32768, 16384], decode_tokens=32, q=4)
    )  # fmt: skip
    g["wave_requests"] = len(g["contexts"])  # a chunk wave can serve every request
    g.update(_budgets(g, shape, vocab))
    tok = 2 * shape["num_key_value_heads"] * shape["head_dim"] * 2 * shape["num_hidden_layers"]
    g["history_kv_bytes"] = sum(c + g["decode_tokens"] for c in g["contexts"]) * tok  # bf16
    return g


def _budgets(g: dict[str, Any], shape: dict[str, Any], vocab: int) -> dict[str, int]:
    """The least device KV budget that admits every request of ``g`` at once, per way of
    moving history, from the engine's own accounting: its layout (blocks, the staging ring)
    and what admission reserves (``Scheduler.reservation`` of each request, the prefill
    scratch); so in the offloading modes the tails, staging and restore room fit and the
    history does not. Host: every request's whole history, rounded up to a power of two."""
    from specstream.config import EngineConfig
    from specstream.engine.layout import RuntimeLayout
    from specstream.engine.request import Request
    from specstream.engine.sched.scheduler import Scheduler
    from specstream.models.config import ModelConfig
    from specstream.sampling_params import SamplingParams

    model = ModelConfig.from_dict(_raw_config(shape, vocab))
    # a layout with room for everything (only its block size and staging ring are read)
    room = 4 * (sum(g["contexts"]) + len(g["contexts"]) * g["decode_tokens"]) * (
        model.kv_bytes_per_token(2)) + (1 << 30)
    out: dict[str, int] = {}
    for name, mode in (("resident", "resident"), ("stream", "specstream"),
                       ("restore", "offload-spec")):
        cfg = EngineConfig(
            mode=mode, device_kv_bytes=room, block_size=g["block_size"],
            chunk_tokens=g["chunk_tokens"], wave_requests=g["wave_requests"],
            resident_tail_tokens=g["resident_tail_tokens"],
            offload_after_tokens=g["offload_after_tokens"],
            max_prefill_tokens=g["max_prefill_tokens"], max_num_seqs=len(g["contexts"]),
            proposer="ngram", num_speculative_tokens=g["q"])  # the speculative modes' reserve
        layout = RuntimeLayout.build(cfg, model, 2, frozenset())  # bf16 KV
        sched = Scheduler.for_layout(cfg, layout)
        params = SamplingParams(max_tokens=g["decode_tokens"])
        reserved = [sched.reservation(Request(str(i), [0] * n, params))
                    for i, n in enumerate(g["contexts"])]
        blocks = sum(r.device_total for r in reserved) + sched.scratch_blocks
        out[f"{name}_kv_bytes"] = layout.history_reserve_bytes + blocks * layout.block_bytes
        if cfg.mode_spec.offload:
            host = sum(r.host_blocks for r in reserved) * layout.block_bytes
            out["host_kv_bytes"] = max(out.get("host_kv_bytes", 0),
                                       1 << (host - 1).bit_length())  # pinned: 2^k anyway
    return out


def _parse(name: str, default_backend: str) -> tuple[str, str]:
    """``"specstream+torch"`` -> ("specstream", "torch"); no suffix: the step's backend."""
    mode, _, backend = name.partition("+")
    return mode, backend or default_backend


def _run_mode(name: str, target: Path, draft: Path, g: dict[str, Any],
              args: argparse.Namespace, deadline: float
              ) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """Prefill every request, then time decode steps only (counter deltas over decode).

    ``name`` is ``<mode>[+<attention backend>]``: `resident-ar` is resident mode without
    speculation (the compute floor of offload/stream); the suffix sets the engine's
    ``attention_backend`` (default: ``--attention-backend``). Returns the mode's results, its
    decode-phase round records and all of its step records (round and prefill-only).
    """
    from specstream import LLM, SamplingParams
    from specstream.attention.waves import resolve_backend
    from specstream.config import MODES

    mode, backend = _parse(name, args.attention_backend)
    engine_mode = mode.removesuffix("-ar")
    spec = MODES[engine_mode].speculative and not mode.endswith("-ar")
    history = MODES[engine_mode].history
    budget = {"none": g["resident_kv_bytes"], "stream": g["stream_kv_bytes"],
              "restore": g["restore_kv_bytes"]}[history]
    llm = LLM(str(target), draft_model=str(draft) if spec else None, mode=engine_mode,
              device=args.device, dtype="bfloat16", device_kv_bytes=budget,
              host_kv_bytes=g["host_kv_bytes"], block_size=g["block_size"],
              chunk_tokens=g["chunk_tokens"], wave_requests=g["wave_requests"],
              resident_tail_tokens=g["resident_tail_tokens"],
              offload_after_tokens=g["offload_after_tokens"],
              max_prefill_tokens=g["max_prefill_tokens"], max_num_seqs=len(g["contexts"]),
              num_speculative_tokens=g["q"] if spec else 0, attention_backend=backend)
    eng = llm.engine
    gen = torch.Generator().manual_seed(1)
    vocab = eng.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=g["decode_tokens"], ignore_eos=True)
    rids = [eng.add_request(torch.randint(0, vocab, (n,), generator=gen).tolist(), params)
            for n in g["contexts"]]
    reqs = [eng.scheduler.requests[r] for r in rids]
    res: dict[str, Any] = {"kv_budget_gib": budget / 2**30, "two_groups":
                           eng.scheduler.two_groups, "requests": len(rids),
                           "attention_backend": resolve_backend(backend, args.device)}
    t0 = time.perf_counter()
    while any(r.first_token_time is None and not r.finished for r in reqs):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{name}: prefill not finished before the deadline")
        eng.step()
    sync(args.device)
    res["prefill_s"] = time.perf_counter() - t0
    before = eng.get_metrics()
    first_round = len(eng.rounds)
    t1 = time.perf_counter()
    while eng.has_unfinished() and time.perf_counter() < deadline:
        eng.step()
    sync(args.device)
    decode_s = time.perf_counter() - t1
    res["complete"] = not eng.has_unfinished()
    m = eng.get_metrics()
    decode_rounds = [asdict(r) for r in list(eng.rounds)[first_round:]]
    steps = [asdict(r) for r in (*eng.rounds, *eng.prefill_steps)]
    llm.close()
    d = {k: m[k] - before[k] for k in ("steps", "generated_tokens", "link_bytes_h2d",
                                       "link_busy_s", "compute_s", "draft_s", "decode_time_s",
                                       "decode_link_busy_s", "decode_link_floor_s")}
    n, h2d, busy = max(1, d["steps"]), d["link_bytes_h2d"], d["link_busy_s"]
    dt, floor = d["decode_time_s"], d["decode_link_floor_s"]
    res.update(
        decode_s=decode_s, steps=n, tokens=d["generated_tokens"],
        tok_per_s=d["generated_tokens"] / decode_s, step_s=decode_s / n, h2d_bytes=h2d,
        h2d_per_step=h2d / n, link_busy_s=busy, link_util=busy / decode_s,
        link_gbps_busy=h2d / busy / 1e9 if busy else 0.0, link_gbps_decode=h2d / decode_s / 1e9,
        engine_compute_s=d["compute_s"], engine_draft_s=d["draft_s"],
        engine_decode_time_over_link_floor=m["decode_time_over_link_floor"],
        # the engine's own decode-round metrics (get_metrics keys), over the decode phase only:
        # link busy over decode-round wall time, and that wall time over the rounds' bytes at
        # the engine's measured link rate
        link_utilization=d["decode_link_busy_s"] / dt if dt else 0.0,
        decode_time_over_link_floor=dt / floor if floor else 0.0,
        acceptance_rate=m["acceptance_rate"], mean_accepted_len=m["mean_accepted_len"],
        device_kv_peak_gib=m["device_kv_peak_bytes"] / 2**30,
    )  # fmt: skip
    return res, decode_rounds, steps


def _pinned_gbps(out: Path) -> float | None:
    """The `bandwidth` step's pinned host-to-device rate (median GB/s), if it ran."""
    try:
        return float(json.loads(out.read_text())["bandwidth"]["h2d_gbps"]["median"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _add_round_floors(modes: dict[str, dict[str, Any]], rounds: dict[str, list[dict[str, Any]]],
                      resident_steps: list[dict[str, Any]], pinned_gbps: float | None) -> None:
    """``round_time_over_floor`` of every mode's decode rounds, as ``specstream/bench/floors.py``
    defines it: a round's floor is max(its link bytes at the pinned rate (the engine's measured
    rate without a `bandwidth` result), verify + draft predicted by a cost model fitted on the
    `resident` steps of this run); the ratio is the rounds' wall time over their floors."""
    from specstream.bench.floors import ComputeModel

    try:
        model = ComputeModel.fit(resident_steps)
    except ValueError:  # too few resident steps
        return
    for name, rs in rounds.items():
        if not rs:
            continue
        floor = 0.0
        for r in rs:
            link = r["link_bytes"] / (pinned_gbps * 1e9) if pinned_gbps else r["link_floor_s"]
            floor += model.floor({**r, "link_floor_s": link}, parallel_draft=False)
        modes[name].update(
            round_floor_s=floor, floor_link_gbps=pinned_gbps,
            round_time_over_floor=sum(r["wall_s"] for r in rs) / floor if floor else None,
            compute_model_fit_error=model.fit_error,
        )


def run_mechanics(args: argparse.Namespace) -> dict[str, Any]:
    import gc

    start = time.perf_counter()
    deadline = start + args.budget_s
    torch.backends.cuda.matmul.allow_tf32 = True  # timing run: attention scores like a fast path
    prefix = "tiny-" if args.tiny else ""
    vocab = 512 if args.tiny else 151936
    target = random_checkpoint(args.work_dir / f"{prefix}target", SHAPES[f"{prefix}target"],
                               vocab, args.device)
    draft = random_checkpoint(args.work_dir / f"{prefix}draft", SHAPES[f"{prefix}draft"],
                              vocab, args.device)
    g = _geometry(args, SHAPES[f"{prefix}target"], vocab)
    res: dict[str, Any] = {"geometry": g, "tf32": True, "checkpoint_s":
                           time.perf_counter() - start, "modes": {}}
    update(args.out, "mechanics", {**res, "status": "partial"})
    res["attention_backend"] = args.attention_backend
    pinned = _pinned_gbps(args.out)
    rounds: dict[str, list[dict[str, Any]]] = {}  # decode-phase rounds of each mode that ran
    resident_steps: list[dict[str, Any]] = []  # every step of the first `resident` run
    for name in args.modes.split(","):
        if time.perf_counter() > deadline - 10:
            res["modes"][name] = {"status": "skipped: out of time"}
            continue
        try:
            out, rounds[name], steps = _run_mode(name, target, draft, g, args, deadline)
            res["modes"][name] = {"status": "ok", **out}
            if not resident_steps and _parse(name, args.attention_backend)[0] == "resident":
                resident_steps = steps
        except Exception as exc:  # one mode failing must not lose the others
            traceback.print_exc()
            res["modes"][name] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        if resident_steps:  # the floors of every mode so far (resident's model covers all)
            _add_round_floors(res["modes"], rounds, resident_steps, pinned)
        update(args.out, "mechanics", {**res, "status": "partial"})
        print(f"[mechanics] {name}: {res['modes'][name]}", flush=True)
    return res
