"""The engine: schedule, run the round, update; plus request bookkeeping and metrics."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from specstream.attention.waves import ATTENTION, resolve_backend
from specstream.backends import limit_compute_threads, make_backend
from specstream.config import EngineConfig
from specstream.engine.contract import StepOutput, StepPlan
from specstream.engine.exec.drafting import DRAFTING, drafting_for
from specstream.engine.exec.history import make_source
from specstream.engine.exec.host_attention import HostAttention
from specstream.engine.exec.ranks import RankGroup
from specstream.engine.exec.worker import Worker
from specstream.engine.layout import RuntimeLayout
from specstream.engine.meter import StepMeter
from specstream.engine.outputs import OutputBuilder
from specstream.engine.policy.feedback import RoundFeedback
from specstream.engine.policy.shaping import RoundShaper
from specstream.engine.request import Request, RequestOutput
from specstream.engine.sched.host_split import HostSplitter
from specstream.engine.sched.scheduler import Scheduler
from specstream.engine.stats import EngineMetrics, EngineStats, RoundStats
from specstream.engine.trace import Tracer
from specstream.errors import RequestError
from specstream.kvcache.storage import KVStore
from specstream.models.loader import load_model, resolve_dtype
from specstream.models.tensor_parallel import Shard
from specstream.options import Proposer as ProposerKind
from specstream.sampling_params import SamplingParams
from specstream.spec.draft import DraftModelProposer
from specstream.spec.proposer import Proposer, make_proposer
from specstream.structured import grammar_tokenizer
from specstream.structured.rounds import GrammarRounds
from specstream.tokenizer import Tokenizer

log = logging.getLogger("specstream.engine")
MAX_ROUND_RECORDS = 100_000  # round records kept for the bench and traces (~10 MB)


class LLMEngine:
    """Continuous-batching engine over one target model (and optionally a proposer)."""

    def __init__(self, model: str | Path, config: EngineConfig, trace: bool = False,
                 proposer: Proposer | None = None, host_split: HostSplitter | None = None,
                 shaper: RoundShaper | None = None, shard: Shard | None = None) -> None:
        """``proposer``: a proposer object to draft with instead of the one ``config.proposer``
        names (tests, experiments); the config must still ask for speculation, and its draft
        model is then not loaded. ``host_split``: how the host's share of cold history is
        chosen, ``shaper``: the round-shape policy, instead of the configured ones (tests,
        ablations). ``shard``: a tensor-parallel rank's part (set by ``exec/ranks.py``; the
        engine itself is rank 0 and starts the others)."""
        if proposer is not None and not config.speculative:
            raise ValueError("a proposer was given but the config does not speculate: set "
                             "proposer (and num_speculative_tokens) in the config too")
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
        tp = config.tensor_parallel_size
        self.ranks = RankGroup(model, config) if shard is None and tp > 1 else None
        shard = shard or Shard(0, tp, self.ranks.group if self.ranks else None)
        self.model = load_model(model, self.dtype, device, shard=shard)
        self.model_config = self.model.config
        self.tokenizer = _maybe_tokenizer(model)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.attention = ATTENTION.get(resolve_backend(config.attention_backend, device))
        self.proposer = (proposer if proposer is not None
                         else self._make_proposer() if config.speculative else None)
        self.layout = layout = RuntimeLayout.build(config, self.model_config,
                                                   self.dtype.itemsize, frozenset(eos),
                                                   _free_device_bytes(device))
        self.eos_token_ids = layout.eos_token_ids
        tok = self.tokenizer
        self.grammar = None if tok is None else GrammarRounds(
            lambda: grammar_tokenizer(tok.to_json(), tuple(sorted(self.eos_token_ids)),
                                      self.model_config.vocab_size),
            self.model_config.vocab_size)
        self.max_model_len = layout.max_model_len
        self.backend = make_backend(device.split(":")[0], link_gbps=config.link_gbps)
        mode = config.mode_spec
        self.scheduler = Scheduler.for_layout(config, layout, tokenizer=self.tokenizer,
                                              shaper=shaper, host_split=host_split)
        self.kv = self.scheduler.kv
        self.store = KVStore(self.model_config, self.dtype, config.block_size,
                             layout.num_device_blocks, layout.num_host_blocks, self.backend)
        self.history = make_source(mode.history, self.store, layout.chunk_tokens,
                                   layout.staging_buffers, layout.wave_requests)
        host = (HostAttention(self.store, config.host_attention_threads,
                              config.host_attention_gbps) if config.host_attends else None)
        self.worker = Worker(self.model, self.store, self.history, self.proposer,
                             DRAFTING.get(drafting_for(mode.drafting, device))(
                                 self.tracer, self.backend),
                             self.attention, self.tracer, stop_ids=self.eos_token_ids,
                             host=host, grammar=self.grammar)
        if self.ranks is not None:
            self.worker = self.ranks.driving(self.worker)  # type: ignore[assignment]
        # the draft model's share of the parameters (the policy's first estimate of its cost
        # per token, from the target's prefill)
        draft_share = (_num_params(self.proposer.model) / _num_params(self.model)
                       if isinstance(self.proposer, DraftModelProposer) else 0.0)
        self.feedback = RoundFeedback(config, self.scheduler.shaper, draft_share)
        self._ids = itertools.count()
        self.stats = EngineStats(accepted_per_pos=[0] * max(1, config.q))
        self.meter = StepMeter(self.backend, self.store, self.kv, host, self.stats, self.tracer)
        self.output = OutputBuilder(self.tokenizer)
        # The newest decode steps, and steps that only prefilled (bounded: a server runs for
        # weeks).
        self.rounds: deque[RoundStats] = deque(maxlen=MAX_ROUND_RECORDS)
        self.prefill_steps: deque[RoundStats] = deque(maxlen=MAX_ROUND_RECORDS)

    def _make_proposer(self) -> Proposer:
        cfg = self.config
        if cfg.proposer is ProposerKind.NGRAM:
            return make_proposer("ngram")
        assert cfg.draft_model is not None
        draft = load_model(cfg.draft_model, self.dtype, cfg.device)
        if draft.config.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"draft vocabulary ({draft.config.vocab_size}) differs from the "
                             f"target's ({self.model_config.vocab_size})")
        return DraftModelProposer(draft, cfg.draft_cache, cfg.draft_window_tokens,
                                  cfg.draft_sink_tokens, cfg.q, attention=self.attention,
                                  max_draft_topk=cfg.topk)

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
            raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                             f"({params.max_tokens}) = {total} exceeds the model's context of "
                             f"{self.max_model_len} tokens")
        if params.structured is not None:
            if self.grammar is None:
                raise ValueError("a structured output needs the model's tokenizer.json")
            self.grammar.check(params.structured)  # GrammarError (a ValueError) if rejected
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.scheduler.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        self.scheduler.add(Request(rid, [int(t) for t in prompt_token_ids], params))
        self.stats.prompt_tokens += len(prompt_token_ids)
        return rid

    def abort_request(self, request_id: str) -> None:
        req = self.scheduler.requests.pop(request_id, None)
        if req is not None and not req.finished:
            self.scheduler.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One round: schedule, run (restore, verify, draft), update, observe.

        No error inside a round stops the engine: a request's own failure (a transfer, its
        drafting) fails that request; anything else fails the round's requests, frees their KV,
        and the engine goes on with the rest.
        """
        est = self.feedback.estimates()
        plan = self.scheduler.schedule(est)
        residency = self.meter.residency(plan)  # before the step changes what lives where
        output = self._run(plan, est.link_bps)
        update = self.scheduler.update(plan, output)
        self._write_back(update.writebacks)
        self._observe(plan, output, update.num_appended, *residency)
        return self._outputs(update.touched)

    def _run(self, plan: StepPlan, link_bps: float) -> StepOutput:
        t0 = time.perf_counter()
        try:
            return self.worker.run(plan, link_bps)
        except Exception as exc:
            log.exception("engine step failed")
            rid = exc.request_id if isinstance(exc, RequestError) else None
            out = StepOutput.failed(
                plan, f"the request's round failed: {type(exc).__name__}: {exc}", rid)
            out.start, out.wall_s = t0, time.perf_counter() - t0
            return out

    def _write_back(self, writebacks: dict[str, list[tuple[int, int]]]) -> None:
        """A prefill chunk's tail blocks, copied right after its step (the next needs room)."""
        if writebacks:
            errors = self.worker.writeback(writebacks)
            self.scheduler.complete_writebacks(writebacks, errors)

    def _outputs(self, touched: list[Request]) -> list[RequestOutput]:
        outputs = [self.output.build(r) for r in touched]
        for r in touched:  # finished requests are reported once, then forgotten
            if r.finished:
                self.scheduler.requests.pop(r.request_id, None)
        return outputs

    def _observe(self, plan: StepPlan, result: StepOutput, appended: int, history_floor: int,
                 kv_held: float, history_unique: int) -> None:
        """What the step measured: into the feedback (the next steps' estimates), the stats
        and the round records, the trace."""
        m = self.meter.measure(plan, result)
        self.feedback.observe(plan, result, m)
        self.stats.generated_tokens += appended
        record = self.stats.record(plan, result, m, self.feedback.link_bps, history_floor,
                                   kv_held, history_unique)
        if record is None:
            return
        (self.rounds if m.decode else self.prefill_steps).append(record)
        if m.decode:
            self.tracer.add("round", "round", result.start, result.start + m.wall_s)
            shape = self.scheduler.drafts.shape
            self.tracer.add("shape", f"depth {shape.depth} nodes {shape.num_nodes}",
                            result.start, result.start, depth=shape.depth,
                            nodes=shape.num_nodes, topk=shape.topk)

    # ---- metrics ----------------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        """The stats plus KV usage of both tiers and the queues, as a typed record."""
        shaper, cache = self.scheduler.shaper, self.kv.cache
        dev, host = self.kv.device, self.kv.host
        block_bytes, worker_host = self.store.block_bytes, self.worker.host
        shared = self.kv.shared_block_refs()
        return EngineMetrics(
            stats=self.stats, mode=self.config.mode_spec.name,
            speculative_depth_chosen=dict(shaper.chosen) if shaper is not None else {},
            speculative_nodes_chosen=dict(shaper.chosen_nodes) if shaper is not None else {},
            device_kv_blocks_used=dev.num_used, device_kv_blocks_total=dev.num_blocks,
            host_kv_blocks_used=host.num_used, host_kv_blocks_total=host.num_blocks,
            prefix_cache_queries_total=cache.queries if cache else 0,
            prefix_cache_hits_total=cache.hits if cache else 0,
            prefix_cache_hits_by_tier=dict(cache.hits_by_tier) if cache else {},
            prefix_cache_blocks={"device": dev.num_cached, "host": host.num_cached},
            host_attention_bytes=worker_host.bytes if worker_host else 0,
            host_attention_bytes_per_s=worker_host.rate if worker_host else 0.0,
            host_attention_share=self.scheduler.host_share,
            device_kv_budget_bytes=self.layout.device_budget_bytes,
            device_kv_peak_bytes=dev.peak_used * block_bytes + self.history.peak_bytes,
            host_kv_peak_bytes=host.peak_used * block_bytes,
            device_kv_used_bytes=dev.num_used * block_bytes,
            host_kv_used_bytes=host.num_used * block_bytes,
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            max_concurrency=self.scheduler.max_concurrency,
            tree_kv_moves=self.worker.verifier.moved_slots,
            promoted_blocks=self.kv.promoted_blocks,
            merged_group_steps=self.scheduler.groups.merged_steps,
            shared_block_refs=shared[0], shared_blocks=shared[1],
            unique_kv_bytes=(sum(s.num_tokens for s in self.kv.seqs.values())
                             - self.kv.duplicate_blocks() * self.kv.block_size)
            * block_bytes // self.kv.block_size,
            structured_mask_s=self.grammar.mask_s if self.grammar else 0.0,
            structured_mask_rows=self.grammar.mask_rows if self.grammar else 0)

    def get_metrics(self) -> dict[str, Any]:
        """``metrics()`` as a dict (the stats' counters and ratios, then the engine's state)."""
        return self.metrics().as_dict()

    def close(self) -> None:
        if self.worker.host is not None:
            self.worker.host.close()
        self.backend.close()
        self.store.release()
        if self.ranks is not None:
            self.ranks.close()


def _maybe_tokenizer(folder: str | Path) -> Tokenizer | None:
    return Tokenizer(folder) if (Path(folder) / "tokenizer.json").is_file() else None


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _free_device_bytes(device: str) -> int | None:
    """The CUDA device's free memory now (None on cpu: its budget is a fixed default)."""
    if not device.startswith("cuda"):
        return None
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return int(free)
