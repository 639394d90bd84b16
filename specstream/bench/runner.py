"""Run one workload through every mode in one process, with the same seeds and budget."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specstream.bench.floors import ComputeModel, add_floors
from specstream.bench.workload import Workload, build_prompts
from specstream.config import MODES, EngineConfig
from specstream.llm import LLM, default_model_dir
from specstream.models.config import ModelConfig
from specstream.models.loader import resolve_dtype
from specstream.sampling_params import SamplingParams

ALL_MODES = ("resident", "offload", "offload-spec", "specstream", "parallel-spec")


@dataclass
class BenchSettings:
    model: str | None = None
    draft_model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    device_kv_bytes: int = 64 << 20
    # The resident reference's device budget when it differs from every other mode's: with
    # --device-kv-fraction below 1 the workload does not fit a resident device at once, and the
    # reference (exact outputs, the floors' compute model) should be the usual one. None: same.
    reference_device_kv_bytes: int | None = None
    host_kv_bytes: int = 4 << 30
    link_gbps: float | None = 1.0
    # Draft tokens per round, children per expanded tree node (1: chains) and nodes per request
    # and round; None: the engine's defaults (EngineConfig: under auto the policy's limits,
    # trees included).
    num_speculative_tokens: int | None = None
    speculative_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    # "fixed" (q drafts a round) or "auto" (the engine chooses each round's shape); None: the
    # engine's default (auto)
    speculative_policy: str | None = None
    block_size: int = 128
    # The engine's chunks (None: 2048 tokens, as the reference implementation, where the budget
    # spares a ring of them: engine/layout.py). Two staging slots of two-request chunk
    # waves: four chunks in flight, not the reference's two: on the CPU backend a draft step
    # holds the one compute thread for ~6 ms, while one 2 MB chunk of the embedded target
    # crosses the 1 GB/s link in 2 ms; four keep the link busy through a draft step (see
    # engine/exec/gap_filler.py). On a GPU the draft runs on its own stream instead.
    chunk_tokens: int | None = None
    staging_buffers: int = 2
    wave_requests: int = 2
    resident_tail_tokens: int = 256
    offload_after_tokens: int = 512
    # What the offloading modes keep on the device: "fill" (free device blocks hold the newest
    # history, only the overflow streams) or "tail" (a fixed resident tail per request).
    residency: str = "fill"
    max_prefill_tokens: int = 1024
    max_num_seqs: int = 64
    # Automatic prefix caching in every run (False: --no-prefix-caching). The multi-turn
    # workload runs each mode both ways whatever this says, unless it is False.
    enable_prefix_caching: bool = True
    # Attention over cold history on the host CPU in the offloading modes ("off" | "auto";
    # None: the engine's default, auto where the host has cores to spare).
    host_attention: str | None = None
    # specstream's groups merge where the link hides nothing (EngineConfig.merge_groups)
    merge_groups: bool = True
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def engine_kwargs(self, mode: str) -> dict[str, Any]:
        device_kv = self.device_kv_bytes
        if mode == "resident" and self.reference_device_kv_bytes is not None:
            device_kv = self.reference_device_kv_bytes
        kw = dict(mode=mode, device=self.device, dtype=self.dtype,
                  device_kv_bytes=device_kv, host_kv_bytes=self.host_kv_bytes,
                  link_gbps=self.link_gbps, block_size=self.block_size,
                  chunk_tokens=self.chunk_tokens, staging_buffers=self.staging_buffers,
                  wave_requests=self.wave_requests, resident_tail_tokens=self.resident_tail_tokens,
                  offload_after_tokens=self.offload_after_tokens, residency=self.residency,
                  max_prefill_tokens=self.max_prefill_tokens, max_num_seqs=self.max_num_seqs,
                  enable_prefix_caching=self.enable_prefix_caching,
                  merge_groups=self.merge_groups, seed=self.seed)
        if self.host_attention is not None:
            kw.update(host_attention=self.host_attention)
        kw.update(self.extra)
        if MODES[mode].speculative:
            kw.update(proposer="draft", num_speculative_tokens=self.num_speculative_tokens,
                      speculative_policy=self.speculative_policy)
            kw.update(speculative_topk=self.speculative_topk,
                      speculative_num_draft_tokens=self.speculative_num_draft_tokens)
        return kw

    def resolved(self, mode: str) -> EngineConfig:
        """The EngineConfig a mode runs with (the draft's folder aside): what the engine's
        defaults make of the options left unset."""
        return EngineConfig(**self.engine_kwargs(mode), draft_model="draft")


def workload_kv_bytes(workload: Workload, s: BenchSettings) -> int:
    """The target's KV bytes of the whole workload: every request's prompt and output."""
    per_token = _target_config(s).kv_bytes_per_token(_dtype_bytes(s))
    return sum(n + workload.output_len for n in workload.context_lengths) * per_token


def resident_fit_bytes(workload: Workload, s: BenchSettings) -> int:
    """A device budget on which the resident mode holds every request at once: the blocks it
    reserves per request (prompt, output and one round's drafts, block-rounded, plus one), with
    10% to spare."""
    per_token = _target_config(s).kv_bytes_per_token(_dtype_bytes(s))
    bs = s.block_size
    step = s.resolved("specstream").verify_tokens
    blocks = sum(-(-(n + workload.output_len + step) // bs) + 1
                 for n in workload.context_lengths)
    return int(1.1 * blocks * bs * per_token)


def _target_config(s: BenchSettings) -> ModelConfig:
    return ModelConfig.from_dir(s.model or default_model_dir("target"))


def _dtype_bytes(s: BenchSettings) -> int:
    return resolve_dtype(s.dtype, s.device).itemsize


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def run_mode(
    mode: str, workload: Workload, s: BenchSettings, trace: str | None = None
) -> tuple[dict[str, Any], list[list[int]], LLM]:
    """Run the workload in one mode; returns (metrics, greedy token ids, the LLM)."""
    llm = open_llm(mode, s, trace=trace is not None)
    try:
        return _measure(llm, mode, workload, s, trace)
    except BaseException:
        llm.close()
        raise


def open_llm(mode: str, s: BenchSettings, trace: bool = False) -> LLM:
    """The engine of one mode's run: the settings' target, and its draft unless the mode
    does not speculate (the embedded draft with the embedded target)."""
    draft = s.draft_model or (str(default_model_dir("draft")) if s.model is None else None)
    return LLM(s.model, draft_model=draft if mode != "offload" else None, trace=trace,
               **s.engine_kwargs(mode))


# the warm-up request before a measured run: the first prompt's leading tokens, a few output
# tokens (the simulator's replay runs the same one: ``ReplaySetup.warmup``)
WARMUP_PROMPT_TOKENS = 64
WARMUP_OUTPUT_TOKENS = 4


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams
                   ) -> tuple[list[Any], float, dict[str, Any], dict[str, Any]]:
    """A measured run: a short warm-up (not measured), then ``prompts`` at once. Returns the
    outputs, the wall time, and the engine's metrics before and after the measured run (its
    round and prefill-step records then hold that run only)."""
    llm.generate([prompts[0][:WARMUP_PROMPT_TOKENS]], SamplingParams(
        temperature=0, max_tokens=WARMUP_OUTPUT_TOKENS, ignore_eos=True), use_tqdm=False)
    base = llm.get_metrics()
    llm.engine.rounds.clear()
    llm.engine.prefill_steps.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - t0, base, llm.get_metrics()


def measure(
    llm: LLM, mode: str, workload: Workload, s: BenchSettings,
    prompts: list[list[int]] | None = None,
) -> tuple[dict[str, Any], list[list[int]]]:
    """One measured run on an engine the caller built (its own configuration, not the
    settings': ``s`` gives the seed and the link rate reported); ``prompts`` (one per request,
    of ``workload``'s lengths) replace the held-out text's. Returns (metrics, greedy token ids)."""
    res, tokens, _ = _measure(llm, mode, workload, s, None, prompts)
    return res, tokens


def _measure(
    llm: LLM, mode: str, workload: Workload, s: BenchSettings, trace: str | None,
    prompts: list[list[int]] | None = None,
) -> tuple[dict[str, Any], list[list[int]], LLM]:
    if prompts is None:
        prompts = build_prompts(workload, llm.tokenizer, llm.engine.model_config.vocab_size,
                                seed=s.seed)
    params = SamplingParams(temperature=0, max_tokens=workload.output_len, ignore_eos=True)
    outs, wall, base, m = timed_generate(llm, prompts, params)
    tokens = [o.outputs[0].token_ids for o in outs]
    n_out = sum(len(t) for t in tokens)
    devices = llm.config.mode_spec.devices
    ttft = [o.metrics.get("ttft_s", 0.0) * 1e3 for o in outs]
    tpot = [o.metrics.get("tpot_s", 0.0) * 1e3 for o in outs]
    decode_t = m["decode_time_s"] - base["decode_time_s"]
    decode_link = m["decode_link_busy_s"] - base["decode_link_busy_s"]
    rounds = llm.engine.rounds
    # decode-only rounds (no prefill chunk in the step): what the round pipeline itself does,
    # apart from the prompt compute that every mode shares
    pure = [r for r in rounds if not r.prefill_tokens]
    pure_wall = sum(r.wall_s for r in pure)
    accepted = m["accepted_tokens"] - base["accepted_tokens"]
    nrounds = m["rounds"] - base["rounds"]
    d = {k: m[k] - base[k] for k in ("verify_steps", "decode_history_bytes",
                                     "decode_history_floor_bytes", "kv_history_block_s",
                                     "decode_history_unique_bytes",
                                     "step_wall_s")}
    result = {
        "mode": mode,
        "output_tokens": n_out,
        "wall_s": wall,
        "output_tokens_per_s": n_out / wall,
        "output_tokens_per_s_per_device": n_out / wall / devices,
        # decode only: tokens after each request's first, over the time of decode rounds
        "decode_tokens_per_s": (n_out - len(outs)) / decode_t if decode_t else 0.0,
        "devices": devices,
        "mean_accepted_len": (accepted + nrounds) / nrounds if nrounds else 1.0,
        "link_utilization": decode_link / decode_t if decode_t else 0.0,
        "decode_only_tokens_per_s": sum(r.new_tokens for r in pure) / pure_wall if pure else 0.0,
        "decode_only_link_utilization": sum(r.link_s for r in pure) / pure_wall if pure else 0.0,
        "drafting": llm.config.mode_spec.drafting,
        "prefill_share_of_wall": (wall - pure_wall) / wall if wall else 0.0,
        "mean_round_ms": 1e3 * sum(r.wall_s for r in rounds) / len(rounds) if rounds else 0.0,
        "device_kv_peak_bytes": m["device_kv_peak_bytes"],
        "device_kv_budget_bytes": m["device_kv_budget_bytes"],
        # residency (measured run only, the warm-up taken off): history bytes that crossed
        # the link per decode step; those of them that no residency could have kept on this
        # device budget; the fraction of device KV blocks holding history, time-averaged
        "link_bytes_per_round": _per(d["decode_history_bytes"], d["verify_steps"]),
        "link_bytes_floor_per_round": _per(d["decode_history_floor_bytes"], d["verify_steps"]),
        # the distinct blocks of the history moved (a block its round's requests share: once)
        "link_bytes_unique_per_round": _per(d["decode_history_unique_bytes"],
                                            d["verify_steps"]),
        "device_kv_utilization": _per(d["kv_history_block_s"], d["step_wall_s"]),
        # the same history bytes per token decoded (each request's first token comes from its
        # prefill): unlike per round, it does not grow with the requests a round batches
        "link_bytes_per_token": _per(d["decode_history_bytes"], n_out - len(outs)),
        # host attention: the rate the host attended at in this run, next to the link's, and
        # the KV bytes it attended
        "host_attention_bytes_per_s": m.get("host_attention_bytes_per_s", 0.0),
        "link_bytes_per_s": 1e9 * s.link_gbps if s.link_gbps else 0.0,
        "host_attention_bytes": m.get("host_attention_bytes", 0),
        "host_kv_peak_bytes": m["host_kv_peak_bytes"],
        # specstream: steps whose two groups merged into one (decode rounds not link-bound)
        "merged_group_steps": m.get("merged_group_steps", 0) - base.get("merged_group_steps", 0),
        "decode_steps": m["decode_steps"] - base["decode_steps"],
        "max_concurrency": m["max_concurrency"],
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99),
        "link_bytes_h2d": m["link_bytes_h2d"] - base["link_bytes_h2d"],
        "link_bytes_d2h": m["link_bytes_d2h"] - base["link_bytes_d2h"],
        "link_busy_s": m["link_busy_s"] - base["link_busy_s"],
        "prefill_only_time_s": m["prefill_only_time_s"] - base["prefill_only_time_s"],
        # the simulator's names for the same measurements (seconds, British spelling)
        "ttft_s": percentile(ttft, 50) / 1e3, "tpot_s": percentile(tpot, 50) / 1e3,
        "link_utilisation": decode_link / decode_t if decode_t else 0.0,
        "mean_round_s": sum(r.wall_s for r in rounds) / len(rounds) if rounds else 0.0,
        "acceptance_rate": m["acceptance_rate"],
        # token trees and the round-shape policy (warm-up included)
        "mean_tree_nodes_per_round": m.get("mean_tree_nodes_per_round", 0.0),
        "speculative_depth_chosen": m.get("speculative_depth_chosen", {}),
        "speculative_nodes_chosen": m.get("speculative_nodes_chosen", {}),
        # every decode round, and every step that only prefilled; run_all adds each one's
        # floor_s (see bench/floors.py)
        "rounds": [{k: v for k, v in asdict(r).items() if k != "start"} for r in rounds],
        "prefill_steps": [{k: v for k, v in asdict(r).items() if k != "start"}
                          for r in llm.engine.prefill_steps],
    }
    if trace is not None:
        path = Path(trace)
        llm.engine.tracer.to_chrome(path)
        llm.engine.tracer.to_png(path.with_suffix(".png"),
                                 title=f"{mode}: link, verify and draft lanes")
    return result, tokens, llm


def _per(total: float, count: float) -> float:
    return total / count if count else 0.0


@dataclass
class Reference:
    """The resident run every other mode is checked and floored against."""

    tokens: list[list[int]]  # its greedy outputs
    model: ComputeModel  # the compute model fitted to its steps (see floors.py)


def run_reference(workload: Workload, s: BenchSettings) -> tuple[dict[str, Any], Reference]:
    """The resident mode on the workload (on ``s.reference_device_kv_bytes`` when set)."""
    res, tokens, llm = run_mode("resident", workload, s)
    llm.close()
    ref = Reference(tokens, ComputeModel.fit(res["rounds"] + res["prefill_steps"]))
    res["outputs_match_reference"] = True
    add_floors({"resident": res}, ref.model)
    return res, ref


def run_compared(
    mode: str, workload: Workload, s: BenchSettings, ref: Reference, trace: str | None = None
) -> dict[str, Any]:
    """One mode on the workload, its outputs compared with the reference and its floors added."""
    res, tokens, llm = run_mode(mode, workload, s, trace=trace)
    llm.close()
    res["outputs_match_reference"] = tokens == ref.tokens
    add_floors({mode: res}, ref.model)
    return res


def run_all(
    workload: Workload, s: BenchSettings, modes: tuple[str, ...] = ALL_MODES,
    trace: str | None = None, progress: bool = True,
) -> dict[str, dict[str, Any]]:
    """Every mode on the same workload; ``outputs_match_reference`` compares to resident,
    whose rounds also give the compute model of every mode's floors."""
    def done(mode: str, res: dict[str, Any]) -> None:
        if progress:
            print(f"[bench] {mode}: {res['output_tokens_per_s']:.1f} tok/s, "
                  f"{res['wall_s']:.1f}s", flush=True)

    results: dict[str, dict[str, Any]] = {}
    if progress:
        print("[bench] resident ...", flush=True)
    res, ref = run_reference(workload, s)
    done("resident", res)
    if "resident" in modes:
        results["resident"] = res
    for mode in (m for m in modes if m != "resident"):
        if progress:
            print(f"[bench] {mode} ...", flush=True)
        results[mode] = run_compared(mode, workload, s, ref,
                                     trace=trace if mode == "specstream" else None)
        done(mode, results[mode])
    return results
