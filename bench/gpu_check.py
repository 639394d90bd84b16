"""One-shot GPU check, step by step; `bench/gpu_check.sh` runs the steps under time limits.

Each step merges its section into one JSON file (`--out`) as soon as it has something, so a
step killed by its time limit leaves what it measured:

- `env`: versions and device;
- `bandwidth`: pinned host-to-device (and device-to-host) bandwidth of torch copies, plus the
  transfer backend's `h2d` at the engine's copy sizes (per-copy issue cost included);
- `exactness`: streamed attention (torch path and Triton kernel) vs full attention, fp32 and bf16;
- `modes`: greedy token ids of every engine mode in fp32 (they must be identical);
- `mechanics`: an 8B-shaped Qwen3 target (random bf16 weights) and a 0.6B-shaped draft at 16K-32K
  contexts under a device KV budget that forces offloading: decode throughput per mode, link GB/s
  and utilisation during decode, and round time over its floor (`mechanics.py`);
- `summary`: a table of everything, and the pass/fail of the issue's targets.

`--device cpu --tiny` runs the same code paths on the CPU with tiny shapes (a dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from specstream.attention import (
    AttentionAccumulator,
    causal_mask,
    full_attention,
    partial_attention,
)
from specstream.attention import triton_partial as tp
from specstream.backends import make_backend

TOL = {"float32": 1e-5, "bfloat16": 1e-2}
MiB = 1 << 20


# ---- JSON sections ------------------------------------------------------------------------------
def update(out: Path, section: str, value: Any) -> None:
    """Merge one section into the results file (read, replace the section, write atomically)."""
    data = json.loads(out.read_text()) if out.is_file() else {}
    data[section] = value
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(out)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- steps --------------------------------------------------------------------------------------
def step_env(args: argparse.Namespace) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "triton": getattr(tp.triton, "__version__", None), "device": args.device,
    }  # fmt: skip
    if args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count)
    return info


def _timed_copies(dst: torch.Tensor, src: torch.Tensor, reps: int, device: str) -> list[float]:
    """GB/s of `reps` whole-tensor copies, each timed alone."""
    rates = []
    for _ in range(reps + 1):  # the first is a warm-up
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        rates.append(src.numel() * src.element_size() / (time.perf_counter() - t0) / 1e9)
    return rates[1:]


def step_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    nbytes = (16 if args.tiny else 256) * MiB
    backend = make_backend(args.device)
    host = backend.alloc_host((nbytes,), torch.uint8)  # pinned on CUDA
    host.random_(0, 255)
    dev = backend.alloc_device((nbytes,), torch.uint8)
    res: dict[str, Any] = {"copy_mib": nbytes // MiB, "pinned": args.device.startswith("cuda")}
    h2d = _timed_copies(dev, host, args.reps, args.device)
    d2h = _timed_copies(host, dev, args.reps, args.device)
    res["h2d_gbps"] = {"median": statistics.median(h2d), "max": max(h2d), "all": h2d}
    res["d2h_gbps"] = {"median": statistics.median(d2h), "max": max(d2h)}
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    res["h2d_pageable_gbps"] = statistics.median(_timed_copies(dev, pageable, 2, args.device))
    sweep = {}  # the engine's pattern: one h2d_many per staging chunk of K/V block copies
    chunk = min(nbytes, 16 * MiB)
    for size_kib in (64, 256, 1024, 4096):
        n, per_chunk = nbytes // (size_kib * 1024), chunk // (size_kib * 1024)
        src, dst = host.view(n, -1), dev.view(n, -1)
        backend.reset_stats()
        sync(args.device)
        t0 = time.perf_counter()
        handles = [backend.h2d_many([(dst[i], src[i]) for i in range(c, c + per_chunk)], c)
                   for c in range(0, n, per_chunk)]
        t_issue = time.perf_counter() - t0
        for h in handles:
            h.wait()
        sync(args.device)
        wall = time.perf_counter() - t0
        stats = backend.stats()
        sweep[f"{size_kib}KiB"] = {
            "copies": n, "wall_gbps": nbytes / wall / 1e9, "issue_us_per_copy": t_issue / n * 1e6,
            "busy_gbps": stats["bytes_h2d"] / stats["busy_s"] / 1e9 if stats["busy_s"] else None,
        }  # fmt: skip
    res["backend_h2d_sweep"] = sweep
    backend.close()
    return res


def _attention_case(
    num_q: int, heads: int, kv: int, dim: int, hist: int, chunk: int, tail: int,
    dtype: torch.dtype, device: str,
) -> dict[str, float]:  # fmt: skip
    """Relative errors of the streamed torch path and the Triton kernel vs full attention."""
    gen = torch.Generator().manual_seed(hist + num_q)
    num_k = hist + tail + num_q
    q = torch.randn(num_q, heads, dim, generator=gen).to(device, dtype)  # [num_q, H, D]
    k = torch.randn(num_k, kv, dim, generator=gen).to(device, dtype)  # [num_k, KV, D]
    v = torch.randn(num_k, kv, dim, generator=gen).to(device, dtype)
    scale = dim**-0.5
    ref = full_attention(q, k, v, scale, causal_mask(num_q, num_k, device)).float()
    errs: dict[str, float] = {}
    fns = {"torch": partial_attention}
    if tp.triton_available() and (device.startswith("cuda") or _interpreting()):
        fns["triton"] = tp.partial_attention_triton
    for name, fn in fns.items():
        acc = AttentionAccumulator()
        for s in range(0, hist, chunk):
            e = min(s + chunk, hist)
            acc.add(*fn(q, k[s:e], v[s:e], scale))
        kt, vt = k[hist:], v[hist:]
        if name == "torch":
            acc.add(*fn(q, kt, vt, scale, causal_mask(num_q, tail + num_q, device)))
        else:
            acc.add(*fn(q, kt, vt, scale, tail))
        out = acc.result(dtype).float()
        errs[name] = ((out - ref).abs().max() / ref.abs().max()).item()
    return errs


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def step_exactness(args: argparse.Namespace) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False  # exactness is judged in true fp32
    torch.backends.cudnn.allow_tf32 = False
    if args.tiny:  # (num_q, heads, kv, dim, hist, chunk, tail)
        cases = [(5, 4, 2, 16, 100, 32, 20), (3, 2, 2, 32, 64, 64, 0)]
    else:
        cases = [(5, 32, 8, 128, 16384, 2048, 512), (9, 32, 8, 128, 8192, 2048, 0),
                 (256, 16, 8, 128, 4096, 2048, 300), (1, 28, 4, 128, 6000, 2048, 100)]
    res: dict[str, Any] = {"cases": [], "passed": True}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for case in cases:
            errs = _attention_case(*case, dtype=dtype, device=args.device)
            ok = all(e <= TOL[name] for e in errs.values())
            res["passed"] &= ok
            res["cases"].append({"dtype": name, "shape": case, "rel_err": errs, "ok": ok})
    res["triton_checked"] = any("triton" in c["rel_err"] for c in res["cases"])
    if res["triton_checked"] and args.device.startswith("cuda"):
        res["kernel_us"] = _time_kernels(args.device)
    return res


def _time_kernels(device: str) -> dict[str, float]:
    """Microseconds per call over one 2048-token chunk at decode shape (q+1 = 5, Qwen3-8B)."""
    q = torch.randn(5, 32, 128, device=device, dtype=torch.bfloat16)
    k = torch.randn(2048, 8, 128, device=device, dtype=torch.bfloat16)
    out = {}
    for name, fn in (("torch", partial_attention), ("triton", tp.partial_attention_triton)):
        for _ in range(3):
            fn(q, k, k, 0.088)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(50):
            fn(q, k, k, 0.088)
        sync(device)
        out[name] = (time.perf_counter() - t0) / 50 * 1e6
    return out


def step_modes(args: argparse.Namespace) -> dict[str, Any]:
    """Greedy token ids of every mode, fp32, on the embedded pair; all must be identical."""
    from specstream import LLM, SamplingParams
    from specstream.config import MODES
    from specstream.llm import default_model_dir
    from specstream.models.config import ModelConfig

    torch.backends.cuda.matmul.allow_tf32 = False
    target = default_model_dir("target")
    draft = default_model_dir("draft")
    draft = draft if (draft / "config.json").is_file() else target  # same vocabulary either way
    cfg = ModelConfig.from_dir(target)
    bs, chunk, after, tail = 16, 64, 64, 32
    lens = (300, 520) if args.tiny else (700, 1500)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
    layer_tok = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32
    block_bytes = bs * cfg.num_layers * layer_tok
    ctx = sum(lens) + 64
    budget = 2 * 48 * block_bytes + 8 * ctx * layer_tok  # fits tails, staging and restores
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    res: dict[str, Any] = {"target": str(target), "draft": str(draft), "prompt_lens": lens,
                           "token_ids": {}, "metrics": {}}
    for mode in ("resident", "offload", "stream", "offload-spec", "specstream"):
        kv_bytes = budget if mode != "resident" else 4 * ctx * cfg.num_layers * layer_tok
        spec = MODES[mode].speculative  # offload and stream take no proposer
        llm = LLM(str(target), draft_model=str(draft) if spec else None, mode=mode,
                  device=args.device, dtype="float32", device_kv_bytes=kv_bytes, block_size=bs,
                  chunk_tokens=chunk, resident_tail_tokens=tail, offload_after_tokens=after,
                  max_prefill_tokens=128, num_speculative_tokens=3 if spec else 0)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            m = llm.get_metrics()
        finally:
            llm.close()
        res["token_ids"][mode] = [o.outputs[0].token_ids for o in outs]
        res["metrics"][mode] = {k: m[k] for k in ("link_bytes_h2d", "mean_accepted_len")}
        update(args.out, "modes", res)
    first = res["token_ids"]["resident"]
    res["identical"] = all(ids == first for ids in res["token_ids"].values())
    res["offloaded"] = all(res["metrics"][m]["link_bytes_h2d"] > 0 for m in res["metrics"]
                           if m != "resident")
    res["passed"] = res["identical"] and res["offloaded"]
    return res


# ---- mechanics: 8B-shaped target, random weights, offloaded 16K-32K contexts ------------------
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


def random_checkpoint(folder: Path, shape: dict[str, Any], vocab: int, device: str) -> Path:
    """An HF-format Qwen3 folder with random bf16 weights (reused if already there)."""
    from safetensors.torch import save_file

    from specstream.models.config import ModelConfig
    from specstream.models.loader import build_model

    if (folder / "model.safetensors").is_file():
        return folder
    raw = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
           "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": vocab - 1, **shape}
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


def _geometry(args: argparse.Namespace, shape: dict[str, Any]) -> dict[str, Any]:
    """Block/chunk sizes, contexts and KV budgets: tails + staging fit, the history does not."""
    g: dict[str, Any] = (
        dict(block_size=16, chunk_tokens=64, offload_after_tokens=64, resident_tail_tokens=32,
             max_prefill_tokens=128, contexts=[600, 300], decode_tokens=8, q=3)
        if args.tiny else
        dict(block_size=1024, chunk_tokens=4096, offload_after_tokens=2048,
             resident_tail_tokens=1024, max_prefill_tokens=2048,
             contexts=[32768, 16384, 32768, 16384], decode_tokens=32, q=4)
    )  # fmt: skip
    layer_tok = 2 * shape["num_key_value_heads"] * shape["head_dim"] * 2  # bf16 K+V, one layer
    tok = layer_tok * shape["num_hidden_layers"]
    bs, n = g["block_size"], len(g["contexts"])
    steady = -(-(max(g["offload_after_tokens"], g["resident_tail_tokens"] + bs) + g["q"] + 1)
               // bs) + 1
    blocks = n * steady + -(-g["max_prefill_tokens"] // bs) + 3
    hist = sum(g["contexts"]) + n * g["decode_tokens"]  # restore modes: the whole batch a step
    g["stream_kv_bytes"] = blocks * bs * tok + 2 * g["chunk_tokens"] * layer_tok
    g["restore_kv_bytes"] = 2 * max(blocks * bs * tok, 2 * hist * layer_tok)
    total = sum(c + g["decode_tokens"] + bs for c in g["contexts"]) * tok
    g["resident_kv_bytes"] = int(1.2 * total) + blocks * bs * tok
    host_blocks = sum(-(-(c + g["decode_tokens"] + g["q"] + 1) // bs) + 1 for c in g["contexts"])
    g["host_kv_bytes"] = 1 << (host_blocks * bs * tok - 1).bit_length()  # pinned: 2^k anyway
    g["history_kv_bytes"] = total
    return g


class _FusedChunks:
    """The engine's `ChunkedAttention` interface with every chunk through the fused kernel
    (`partial_attention_auto`: Triton for unmasked CUDA chunks) and merged by
    `AttentionAccumulator`."""

    def __init__(self, q: torch.Tensor, num_kv_heads: int, scale: float) -> None:
        self.q, self.scale, self.acc = q, scale, AttentionAccumulator()

    def add(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        self.acc.add(*tp.partial_attention_auto(self.q, k, v, self.scale, mask))

    def result(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.acc.result(dtype or self.q.dtype)


def _run_mode(mode: str, target: Path, draft: Path, g: dict[str, Any],
              args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """Prefill every request, then time decode steps only (counter deltas over decode).

    `resident-ar` is resident mode without speculation: the compute floor of offload/stream.
    `<mode>+triton` runs the engine's chunk attention through the fused kernel (patched in for
    this run only, until the engine dispatches to it itself).
    """
    if mode.endswith("+triton"):
        import specstream.engine.attention as engine_attention

        saved = engine_attention.ChunkedAttention
        engine_attention.ChunkedAttention = _FusedChunks  # type: ignore[assignment,misc]
        try:
            return _run_mode(mode.removesuffix("+triton"), target, draft, g, args, deadline)
        finally:
            engine_attention.ChunkedAttention = saved  # type: ignore[misc]
    from specstream import LLM, SamplingParams
    from specstream.config import MODES

    engine_mode = mode.removesuffix("-ar")
    spec = MODES[engine_mode].speculative and not mode.endswith("-ar")
    history = MODES[engine_mode].history
    budget = {"none": g["resident_kv_bytes"], "stream": g["stream_kv_bytes"],
              "restore": g["restore_kv_bytes"]}[history]
    llm = LLM(str(target), draft_model=str(draft) if spec else None, mode=engine_mode,
              device=args.device, dtype="bfloat16", device_kv_bytes=budget,
              host_kv_bytes=g["host_kv_bytes"], block_size=g["block_size"],
              chunk_tokens=g["chunk_tokens"], resident_tail_tokens=g["resident_tail_tokens"],
              offload_after_tokens=g["offload_after_tokens"],
              max_prefill_tokens=g["max_prefill_tokens"], max_num_seqs=len(g["contexts"]),
              num_speculative_tokens=g["q"] if spec else 0)
    eng = llm.engine
    gen = torch.Generator().manual_seed(1)
    vocab = eng.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=g["decode_tokens"], ignore_eos=True)
    rids = [eng.add_request(torch.randint(0, vocab, (n,), generator=gen).tolist(), params)
            for n in g["contexts"]]
    reqs = [eng.scheduler.requests[r] for r in rids]
    res: dict[str, Any] = {"kv_budget_gib": budget / 2**30, "two_groups":
                           eng.scheduler.two_groups, "requests": len(rids)}
    t0 = time.perf_counter()
    while any(r.first_token_time is None and not r.finished for r in reqs):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{mode}: prefill not finished before the deadline")
        eng.step()
    sync(args.device)
    res["prefill_s"] = time.perf_counter() - t0
    before = dict(eng.counters)
    t1 = time.perf_counter()
    while eng.has_unfinished() and time.perf_counter() < deadline:
        eng.step()
    sync(args.device)
    decode_s = time.perf_counter() - t1
    res["complete"] = not eng.has_unfinished()
    m = eng.get_metrics()
    llm.close()
    d = {k: m[k] - before[k] for k in ("steps", "generated_tokens", "link_bytes_h2d",
                                       "link_busy_s", "compute_s", "draft_s")}
    steps, h2d, busy = max(1, d["steps"]), d["link_bytes_h2d"], d["link_busy_s"]
    res.update(
        decode_s=decode_s, steps=steps, tokens=d["generated_tokens"],
        tok_per_s=d["generated_tokens"] / decode_s, step_s=decode_s / steps, h2d_bytes=h2d,
        h2d_per_step=h2d / steps, link_busy_s=busy, link_util=busy / decode_s,
        link_gbps_busy=h2d / busy / 1e9 if busy else 0.0, link_gbps_decode=h2d / decode_s / 1e9,
        engine_compute_s=d["compute_s"], engine_draft_s=d["draft_s"],
        engine_round_time_over_floor=m["round_time_over_floor"],
        acceptance_rate=m["acceptance_rate"], mean_accepted_len=m["mean_accepted_len"],
        device_kv_peak_gib=m["device_kv_peak_bytes"] / 2**30,
    )  # fmt: skip
    return res


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
    g = _geometry(args, SHAPES[f"{prefix}target"])
    res: dict[str, Any] = {"geometry": g, "tf32": True, "checkpoint_s":
                           time.perf_counter() - start, "modes": {}}
    update(args.out, "mechanics", {**res, "status": "partial"})
    for mode in args.modes.split(","):
        if time.perf_counter() > deadline - 10:
            res["modes"][mode] = {"status": "skipped: out of time"}
            continue
        try:
            res["modes"][mode] = {"status": "ok", **_run_mode(mode, target, draft, g, args,
                                                              deadline)}
        except Exception as exc:  # one mode failing must not lose the others
            traceback.print_exc()
            res["modes"][mode] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        update(args.out, "mechanics", {**res, "status": "partial"})
        print(f"[mechanics] {mode}: {res['modes'][mode]}", flush=True)
    return res


def step_attach(args: argparse.Namespace) -> dict[str, Any]:
    """Store another tool's JSON output (e.g. `specstream bench --json`) as a section."""
    section: dict[str, Any] = {"status": "ok" if args.rc == 0 else f"failed (rc {args.rc})"}
    if args.file is not None and args.file.is_file():
        try:
            section["result"] = json.loads(args.file.read_text())
        except json.JSONDecodeError as exc:
            section["result_error"] = str(exc)
    return section


def targets(data: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets from the sections: exactness, identical modes, link use, floor."""
    out: dict[str, Any] = {
        "attention_exact": data.get("exactness", {}).get("passed"),
        "greedy_identical_across_modes": data.get("modes", {}).get("passed"),
    }
    pinned = data.get("bandwidth", {}).get("h2d_gbps", {}).get("median")
    modes = data.get("mechanics", {}).get("modes", {})
    for name, m in modes.items():
        if "step_s" not in m or not pinned:
            continue
        link_floor = m["h2d_per_step"] / (pinned * 1e9)
        # compute floor: the same work with all KV on the device (resident, with or without
        # speculation); a two-group step verifies half the batch and drafts the other half
        spec = name.split("+")[0] in ("resident", "offload-spec", "specstream", "parallel-spec")
        ref = modes.get("resident" if spec else "resident-ar", {})
        share = 0.5 if m["two_groups"] else 1.0
        compute = ref.get("step_s", 0.0) * share
        m["floor_s"] = max(link_floor, compute)
        m["over_floor"] = m["step_s"] / m["floor_s"] if m["floor_s"] else None
        m["link_frac_of_pinned"] = m["link_gbps_decode"] / pinned
    ss = modes.get("specstream", {})
    if "over_floor" in ss:
        out["specstream_link_ge_85pct"] = ss["link_frac_of_pinned"] >= 0.85
        out["specstream_round_le_1.2x_floor"] = ss["over_floor"] is not None and (
            ss["over_floor"] <= 1.2)
    base = modes.get("offload", {}).get("tok_per_s")
    if base and ss.get("tok_per_s"):
        out["specstream_over_offload"] = ss["tok_per_s"] / base
    return out


def print_summary(out: Path) -> int:
    data = json.loads(out.read_text()) if out.is_file() else {}
    data["targets"] = targets(data)
    update(out, "targets", data["targets"])
    print(f"\n== GPU check summary ({out}) ==")
    for name, sec in data.items():
        if isinstance(sec, dict) and name not in ("targets",):
            print(f"{name:<12} {str(sec.get('status', '-')):<22} {sec.get('seconds', '-')} s")
    bw = data.get("bandwidth", {})
    if "h2d_gbps" in bw:
        print(f"pinned h2d {bw['h2d_gbps']['median']:.1f} GB/s (max {bw['h2d_gbps']['max']:.1f}),"
              f" d2h {bw['d2h_gbps']['median']:.1f}, pageable h2d {bw['h2d_pageable_gbps']:.1f}")
        for size, r in bw.get("backend_h2d_sweep", {}).items():
            print(f"  backend.h2d {size:>8}: {r['wall_gbps']:.1f} GB/s wall, "
                  f"{r['issue_us_per_copy']:.1f} us issue/copy")
    for c in data.get("exactness", {}).get("cases", []):
        errs = ", ".join(f"{k} {v:.1e}" for k, v in c["rel_err"].items())
        print(f"  attention {c['dtype']:<8} {str(c['shape']):<34} {errs}  ok={c['ok']}")
    modes = data.get("mechanics", {}).get("modes", {})
    if modes:
        cols = ("tok_per_s", "step_s", "link_gbps_decode", "link_gbps_busy", "link_util",
                "over_floor", "mean_accepted_len", "prefill_s")
        print(f"{'mode':<13}" + "".join(f"{c:>18}" for c in cols))
        for name, m in modes.items():
            cells = "".join(f"{m[c]:>18.3f}" if isinstance(m.get(c), float | int) else
                            f"{str(m.get(c, '-')):>18}" for c in cols)
            print(f"{name:<13}{cells}  {m.get('status', '')}")
    for k, v in data["targets"].items():
        print(f"target {k:<34} {v}")
    return 0


def step_mark(args: argparse.Namespace) -> dict[str, Any]:
    """Record that a step died (timeout or crash) without writing its own section."""
    data = json.loads(args.out.read_text()) if args.out.is_file() else {}
    section = dict(data.get(args.target, {}))
    section.update(status="timeout" if args.rc in (124, 137) else "failed", rc=args.rc)
    return section


STEPS = {"env": step_env, "bandwidth": step_bandwidth, "exactness": step_exactness,
         "modes": step_modes, "mechanics": run_mechanics, "mark": step_mark,
         "attach": step_attach}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=[*STEPS, "summary"])
    p.add_argument("target", nargs="?", help="for mark/attach: the section to write")
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu-check.json"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU dry run)")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--rc", type=int, default=1, help="mark/attach: the exit status seen")
    p.add_argument("--file", type=Path, default=None, help="attach: the JSON file to store")
    p.add_argument("--budget-s", type=float, default=200.0, help="mechanics: time for all modes")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/specstream-gpu-check"))
    p.add_argument("--modes", help="mechanics: modes in run order (resident-ar: no speculation)",
                   default="specstream,resident,offload-spec,offload,resident-ar,stream,"
                           "specstream+triton")
    args = p.parse_args(argv)
    if args.step == "summary":
        return print_summary(args.out)
    section = args.target if args.step in ("mark", "attach") else args.step
    t0 = time.perf_counter()
    try:
        value = STEPS[args.step](args)
        value.setdefault("status", "ok")
    except Exception as exc:  # a failed step must not stop the others: record it and go on
        traceback.print_exc()
        value = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    if args.step not in ("mark", "attach"):
        value["seconds"] = round(time.perf_counter() - t0, 2)
    update(args.out, section, value)
    print(f"[gpu_check] {section}: {value.get('status')} in {value.get('seconds', '-')} s")
    return 0 if value["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
