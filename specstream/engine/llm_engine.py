"""The engine: schedule, run the round, postprocess; plus request bookkeeping and metrics."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specstream.backends import limit_compute_threads, make_backend
from specstream.config import EngineConfig
from specstream.engine.drafting import DRAFTING
from specstream.engine.history import make_source
from specstream.engine.layout import RuntimeLayout
from specstream.engine.request import CompletionOutput, Request, RequestError, RequestOutput
from specstream.engine.scheduler import Scheduler
from specstream.engine.step import StepOutput, StepPlan
from specstream.engine.trace import Tracer
from specstream.engine.worker import Worker
from specstream.kvcache.manager import KVManager, OffloadPolicy
from specstream.kvcache.storage import KVStore
from specstream.models.loader import load_model, resolve_dtype
from specstream.sampling_params import SamplingParams
from specstream.spec import make_proposer
from specstream.spec.draft import DraftModelProposer
from specstream.spec.proposer import Proposer
from specstream.tokenizer import Tokenizer

log = logging.getLogger("specstream.engine")
MAX_ROUND_RECORDS = 100_000  # round records kept for the bench and traces (~10 MB)


class LLMEngine:
    """Continuous-batching engine over one target model (and optionally a proposer)."""

    def __init__(self, model: str | Path, config: EngineConfig, trace: bool = False) -> None:
        self.config = config
        self.tracer = Tracer(trace)
        device = config.device
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r}: this torch ({torch.__version__}) sees no CUDA device "
                f"(built with CUDA: {torch.version.cuda or 'no'}); use device='cpu'")
        torch.manual_seed(config.seed)  # requests without their own seed draw from it (as vLLM)
        if device.startswith("cpu") and config.compute_threads is not None:
            limit_compute_threads(config.compute_threads)
        self.dtype = resolve_dtype(config.dtype, device)
        self.model = load_model(model, self.dtype, device)
        self.model_config = self.model.config
        self.tokenizer = _maybe_tokenizer(model)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.layout = layout = RuntimeLayout.build(config, self.model_config,
                                                   self.dtype.itemsize, frozenset(eos))
        self.eos_token_ids = layout.eos_token_ids
        self.max_model_len = layout.max_model_len
        self.backend = make_backend(device.split(":")[0], link_gbps=config.link_gbps)
        mode = config.mode_spec
        policy = OffloadPolicy(
            offload=mode.offload,
            resident_tail_tokens=config.resident_tail_tokens,
            offload_after_tokens=layout.offload_after_tokens,
            chunk_tokens=config.chunk_tokens,
        )
        self.kv = KVManager(config.block_size, layout.num_device_blocks, layout.num_host_blocks,
                            policy)
        self.store = KVStore(self.model_config, self.dtype, config.block_size,
                             layout.num_device_blocks, layout.num_host_blocks, self.backend)
        self.history = make_source(mode.history, self.store, config.chunk_tokens,
                                   config.staging_buffers)
        if config.link_gbps:  # a first estimate; completed copies refine it (see _account)
            self.history.link_bps = config.link_gbps * 1e9
        tok = self.tokenizer
        self.scheduler = Scheduler(config, self.kv, restore_token_cap=layout.restore_token_cap,
                                   max_model_len=layout.max_model_len,
                                   eos_token_ids=layout.eos_token_ids,
                                   decode=tok.decode if tok is not None else None)
        self.proposer = self._make_proposer() if config.speculative else None
        self.worker = Worker(self.model, self.store, self.backend, self.history, self.proposer,
                             DRAFTING.get(mode.drafting)(self.tracer), self.tracer)
        self._ids = itertools.count()
        self.counters: dict[str, float] = {
            "steps": 0, "decode_steps": 0, "prompt_tokens": 0, "generated_tokens": 0,
            "proposed_tokens": 0, "accepted_tokens": 0, "rounds": 0, "link_bytes_h2d": 0,
            "link_bytes_d2h": 0, "link_busy_s": 0.0, "compute_s": 0.0, "draft_s": 0.0,
            "decode_time_s": 0.0, "decode_link_busy_s": 0.0, "prefill_tokens": 0,
            "prefill_only_time_s": 0.0, "num_drafts": 0,
        }
        # accepted_per_pos[i]: rounds whose draft at position i was accepted (vLLM's
        # spec_decode_num_accepted_tokens_per_pos), so acceptance by position can be windowed
        self.accepted_per_pos = [0] * max(1, config.q)
        # The newest decode rounds (bounded: a server runs for weeks); the floor ratio is kept
        # as running sums over every round.
        self.rounds: deque[RoundStats] = deque(maxlen=MAX_ROUND_RECORDS)
        self._floor_ratio_sum, self._floor_rounds = 0.0, 0

    def _make_proposer(self) -> Proposer:
        cfg = self.config
        if cfg.proposer == "ngram":
            return make_proposer("ngram")
        assert cfg.draft_model is not None
        draft = load_model(cfg.draft_model, self.dtype, cfg.device)
        if draft.config.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft.config.vocab_size}) differs from the target's "
                f"({self.model_config.vocab_size})"
            )
        return DraftModelProposer(draft, cfg.draft_cache, cfg.draft_window_tokens,
                                  cfg.draft_sink_tokens, cfg.q)

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        if not prompt_token_ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"= {total} exceeds the model's context of {self.max_model_len} tokens"
            )
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.scheduler.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        self.scheduler.add(Request(rid, [int(t) for t in prompt_token_ids], params))
        self.counters["prompt_tokens"] += len(prompt_token_ids)
        return rid

    def abort_request(self, request_id: str) -> None:
        req = self.scheduler.requests.pop(request_id, None)
        if req is not None and not req.finished:
            self.scheduler.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One round: schedule, run (restore, verify, draft), update.

        No error inside a round stops the engine: a request's own failure (a transfer, its
        drafting) fails that request; anything else fails the round's requests, frees their KV,
        and the engine goes on with the rest.
        """
        plan = self.scheduler.schedule()
        output = self._run(plan)
        update = self.scheduler.update(plan, output)
        if update.writebacks:
            errors = self.worker.writeback(update.writebacks)
            self.scheduler.complete_writebacks(update.writebacks, errors)
        self.counters["generated_tokens"] += update.num_appended
        self._account(plan, output)
        return self._outputs(update.touched)

    def _run(self, plan: StepPlan) -> StepOutput:
        t0 = time.perf_counter()
        try:
            return self.worker.run(plan)
        except Exception as exc:
            log.exception("engine step failed")
            rid = exc.request_id if isinstance(exc, RequestError) else None
            out = StepOutput.failed(
                plan, f"the request's round failed: {type(exc).__name__}: {exc}", rid)
            out.start, out.wall_s = t0, time.perf_counter() - t0
            return out

    def _outputs(self, touched: list[Request]) -> list[RequestOutput]:
        outputs = [self._output(r) for r in touched]
        for r in touched:  # finished requests are reported once, then forgotten
            if r.finished:
                self.scheduler.requests.pop(r.request_id, None)
        return outputs

    def _account(self, plan: StepPlan, result: StepOutput) -> None:
        """Fold one step's link records, timings and speculation into the counters and round
        stats."""
        self._count_speculation(plan, result)
        end = time.perf_counter()
        records = self.backend.busy_intervals()
        self.backend.reset_stats()
        busy, cur = 0.0, (0.0, 0.0)
        for r in records:
            self.counters["link_bytes_h2d" if r.direction == "h2d" else "link_bytes_d2h"] += (
                r.nbytes)
            self.tracer.add(f"link {r.direction}", str(r.tag), r.start, r.end, bytes=r.nbytes)
            if r.start > cur[1]:
                busy += cur[1] - cur[0]
                cur = (r.start, r.end)
            else:
                cur = (cur[0], max(cur[1], r.end))
        busy += cur[1] - cur[0]
        self.history.observe_link(sum(r.nbytes for r in records), busy)
        wall = end - result.start
        compute = wall - result.wait_s
        c = self.counters
        c["steps"] += 1
        c["link_busy_s"] += busy
        c["compute_s"] += compute
        c["draft_s"] += result.draft_s
        decode = any(s.sample and not s.prefill for s in plan.seqs)
        prefill_tokens = sum(len(s.token_ids) for s in plan.seqs if s.prefill)
        c["prefill_tokens"] += prefill_tokens
        if prefill_tokens and not decode:
            c["prefill_only_time_s"] += wall
        if decode:
            c["decode_steps"] += 1
            c["decode_time_s"] += wall
            c["decode_link_busy_s"] += busy
            floor = max(busy, compute if self.config.mode_spec.drafting != "parallel"
                        else max(compute, result.draft_s))
            self.rounds.append(RoundStats(
                result.start, wall, busy, compute, result.draft_s, result.wait_s, floor,
                plan.num_tokens, sum(s.start_pos + len(s.token_ids) for s in plan.seqs),
                len(plan.seqs), prefill_tokens,
                sum(len(result.new_tokens.get(s.request_id, ())) for s in plan.seqs
                    if s.sample and not s.prefill),
            ))
            if floor > 0:
                self._floor_ratio_sum += wall / floor
                self._floor_rounds += 1
            self.tracer.add("round", "round", result.start, end)

    def _count_speculation(self, plan: StepPlan, result: StepOutput) -> None:
        """Verification rounds (a prefill's first token is none), drafts and acceptances."""
        c = self.counters
        for s in plan.seqs:
            new = result.new_tokens.get(s.request_id)
            if not s.sample or s.prefill or new is None:
                continue
            c["rounds"] += 1
            c["proposed_tokens"] += s.num_drafts
            c["accepted_tokens"] += len(new) - 1
            if s.num_drafts:
                c["num_drafts"] += 1
                if s.num_drafts > len(self.accepted_per_pos):
                    self.accepted_per_pos.extend([0] * (s.num_drafts
                                                        - len(self.accepted_per_pos)))
                for i in range(len(new) - 1):
                    self.accepted_per_pos[i] += 1

    # ---- outputs and metrics ------------------------------------------------------------
    def _output(self, req: Request) -> RequestOutput:
        text = req.output_text
        if not req.finished and self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids)
        comp = CompletionOutput(
            index=0, text=text, token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason, num_proposed_tokens=req.num_proposed,
            num_accepted_tokens=req.num_accepted, num_rounds=req.num_rounds, error=req.error,
        )
        metrics = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            metrics["ttft_s"] = req.first_token_time - req.arrival_time
        if req.finish_time is not None and req.first_token_time is not None:
            n = max(1, len(req.output_token_ids) - 1)
            metrics["tpot_s"] = (req.finish_time - req.first_token_time) / n
        return RequestOutput(req.request_id, None, list(req.prompt_token_ids), [comp],
                             req.finished, metrics, req.num_computed_tokens)

    def get_metrics(self) -> dict[str, Any]:
        c: dict[str, Any] = dict(self.counters)
        block_bytes = self.store.block_bytes
        dev, host = self.kv.device, self.kv.host
        c.update({
            "accepted_per_pos": list(self.accepted_per_pos),
            "device_kv_blocks_used": dev.num_used, "device_kv_blocks_total": dev.num_blocks,
            "host_kv_blocks_used": host.num_used, "host_kv_blocks_total": host.num_blocks,
            "device_kv_usage": dev.num_used / dev.num_blocks if dev.num_blocks else 0.0,
            "host_kv_usage": host.num_used / host.num_blocks if host.num_blocks else 0.0,
            "mode": self.config.mode,
            "device_kv_budget_bytes": self.config.device_budget,
            "device_kv_peak_bytes": self.kv.device.peak_used * block_bytes
            + self.history.peak_bytes,
            "host_kv_peak_bytes": self.kv.host.peak_used * block_bytes,
            "device_kv_used_bytes": self.kv.device.num_used * block_bytes,
            "host_kv_used_bytes": self.kv.host.num_used * block_bytes,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "max_concurrency": self.scheduler.max_concurrency,
        })
        rounds, proposed = c["rounds"], c["proposed_tokens"]
        c["acceptance_rate"] = c["accepted_tokens"] / proposed if proposed else 0.0
        c["mean_accepted_len"] = (c["accepted_tokens"] + rounds) / rounds if rounds else 0.0
        dt = c["decode_time_s"]
        c["link_utilization"] = c["decode_link_busy_s"] / dt if dt else 0.0
        n = self._floor_rounds
        c["round_time_over_floor"] = self._floor_ratio_sum / n if n else 0.0
        return c

    def close(self) -> None:
        self.backend.close()


@dataclass(frozen=True)
class RoundStats:
    """One decode round: wall time against its floor max(link busy, compute)."""

    start: float
    wall_s: float
    link_s: float
    compute_s: float  # on the target's device: wall minus time blocked on the link
    draft_s: float
    wait_s: float
    floor_s: float
    query_tokens: int = 0  # tokens the target processed in the round (all requests)
    context_tokens: int = 0  # tokens attended (all requests)
    num_seqs: int = 0
    prefill_tokens: int = 0  # prompt tokens prefilled in the same step (mixed steps)
    new_tokens: int = 0  # tokens the round's verifications emitted (accepted + bonus)


def _maybe_tokenizer(folder: str | Path) -> Tokenizer | None:
    return Tokenizer(folder) if (Path(folder) / "tokenizer.json").is_file() else None

