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
from specstream.engine.exec.worker import Worker
from specstream.engine.layout import RuntimeLayout
from specstream.engine.policy.shaping import RoundShaper
from specstream.engine.request import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    Request,
    RequestOutput,
    TokenLogprobs,
)
from specstream.engine.sched.scheduler import Scheduler
from specstream.engine.stats import EngineStats, RoundStats
from specstream.engine.trace import Tracer
from specstream.errors import RequestError
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

    def __init__(self, model: str | Path, config: EngineConfig, trace: bool = False,
                 proposer: Proposer | None = None) -> None:
        """``proposer``: a proposer object to draft with instead of the one ``config.proposer``
        names (tests, experiments); the config must still ask for speculation, and its draft
        model is then not loaded."""
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
        self.scheduler = Scheduler.for_layout(config, layout, tokenizer=self.tokenizer)
        self.kv = self.scheduler.kv
        self.store = KVStore(self.model_config, self.dtype, config.block_size,
                             layout.num_device_blocks, layout.num_host_blocks, self.backend)
        self.history = make_source(mode.history, self.store, config.chunk_tokens,
                                   config.staging_buffers, config.wave_requests)
        if config.link_gbps:  # a first estimate; completed copies refine it (see _account)
            self.history.link_bps = config.link_gbps * 1e9
        self.attention = ATTENTION.get(resolve_backend(config.attention_backend, device))
        self.proposer = (proposer if proposer is not None
                         else self._make_proposer() if config.speculative else None)
        self.worker = Worker(self.model, self.store, self.backend, self.history, self.proposer,
                             DRAFTING.get(drafting_for(mode.drafting, device))(
                                 self.tracer, self.backend),
                             self.attention, self.tracer, stop_ids=self.eos_token_ids)
        # the draft model's share of the parameters (the policy's first estimate of its cost
        # per token, from the target's prefill)
        self._draft_share = (_num_params(self.proposer.model) / _num_params(self.model)
                             if isinstance(self.proposer, DraftModelProposer) else 0.0)
        if config.host_attends:
            self.worker.host = HostAttention(self.store, config.host_attention_threads,
                                             config.host_attention_gbps)
            self.scheduler.host_cost = self.worker.host.seconds_per_byte
        self._ids = itertools.count()
        self._token_texts: dict[int, str] = {}
        self.stats = EngineStats(accepted_per_pos=[0] * max(1, config.q))
        # The newest decode steps, and steps that only prefilled (bounded: a server runs for
        # weeks).
        self.rounds: deque[RoundStats] = deque(maxlen=MAX_ROUND_RECORDS)
        self.prefill_steps: deque[RoundStats] = deque(maxlen=MAX_ROUND_RECORDS)

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
                                  cfg.draft_sink_tokens, cfg.q, attention=self.attention,
                                  max_draft_topk=cfg.speculative_topk)

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
        """One round: schedule, run (restore, verify, draft), update.

        No error inside a round stops the engine: a request's own failure (a transfer, its
        drafting) fails that request; anything else fails the round's requests, frees their KV,
        and the engine goes on with the rest.
        """
        plan = self.scheduler.schedule()
        residency = self._residency(plan)
        output = self._run(plan)
        update = self.scheduler.update(plan, output)
        if update.writebacks:
            errors = self.worker.writeback(update.writebacks)
            self.scheduler.complete_writebacks(update.writebacks, errors)
        self.stats.generated_tokens += update.num_appended
        self._account(plan, output, *residency)
        return self._outputs(update.touched)

    def _residency(self, plan: StepPlan) -> tuple[int, float]:
        """The step's history floor (bytes of its requests' history that cannot be resident
        given the device budget: with K tokens of KV in all running requests and room for C on
        the device, a 1 - C/K share of every request's history must cross the link, whichever
        requests keep what) and the fraction of device KV blocks holding history."""
        kv, bs = self.kv, self.config.block_size
        held = 0
        total = 0
        for seq in kv.seqs.values():
            total += seq.num_tokens
            held += -(-(seq.num_tokens - seq.first * bs) // bs)
        num_blocks = kv.device.num_blocks
        capacity = num_blocks * bs
        history = sum(s.start_pos for s in plan.seqs)
        share = max(0.0, 1.0 - capacity / total) if total else 0.0
        floor = int(history * share) * self.store.block_bytes // bs
        return floor, held / num_blocks if num_blocks else 0.0

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

    def _account(self, plan: StepPlan, result: StepOutput, history_floor: int = 0,
                 kv_held: float = 0.0) -> None:
        """Fold one step's link records, timings and speculation into the stats; a decode step
        (one that verifies or drafts) also gets a round record. ``history_floor`` and
        ``kv_held``: see ``_residency``."""
        st = self.stats
        for s in plan.seqs:
            new = result.new_tokens.get(s.request_id)
            if s.sample and not s.prefill and new is not None:
                st.count_accepted(s.num_drafts, len(new) - 1, max(s.depths, default=0),
                                  tree=bool(s.parents))
        end = time.perf_counter()
        records = self.backend.busy_intervals()
        self.backend.reset_stats()
        busy, cur = 0.0, (0.0, 0.0)
        for r in records:
            if r.direction == "h2d":
                st.link_bytes_h2d += r.nbytes
            else:
                st.link_bytes_d2h += r.nbytes
            self.tracer.add(f"link {r.direction}", str(r.tag), r.start, r.end, bytes=r.nbytes)
            if r.start > cur[1]:
                busy += cur[1] - cur[0]
                cur = (r.start, r.end)
            else:
                cur = (cur[0], max(cur[1], r.end))
        busy += cur[1] - cur[0]
        nbytes = sum(r.nbytes for r in records)
        history = sum(r.nbytes for r in records if r.direction == "h2d")
        self.history.observe_link(nbytes, busy)
        wall = end - result.start
        st.step_wall_s += wall
        st.kv_history_block_s += kv_held * wall
        compute = wall - result.wait_s
        st.steps += 1
        st.link_busy_s += busy
        st.compute_s += compute
        st.draft_s += result.draft_s
        prefill_tokens = sum(len(s.token_ids) for s in plan.seqs if s.prefill)
        st.prefill_tokens += prefill_tokens
        decode = bool(result.drafts) or any(s.sample and not s.prefill for s in plan.seqs)
        if not decode and not prefill_tokens:
            return  # nothing was done
        self.scheduler.note_step(self._link_rate(), compute if prefill_tokens else None)
        host_busy = host_wait = host_serial = 0.0
        host_bytes = self._host_bytes(plan)
        if self.worker.host is not None:
            host_busy, host_wait, host_serial = self.worker.host.since_last()
            self._note_host(plan, history, host_bytes, compute, decode and not prefill_tokens,
                            host_wait, host_serial)
        shaper = self.scheduler.shaper
        if shaper is not None and prefill_tokens:
            shaper.prior_catch_up(compute / prefill_tokens * self._draft_share)
        link_floor = nbytes / self._link_rate()
        if decode and plan.seqs:  # a verification round: the history it moved
            st.verify_steps += 1
            st.decode_history_bytes += history
            st.decode_history_floor_bytes += history_floor
        if decode:
            st.decode_steps += 1
            st.decode_time_s += wall
            st.decode_link_busy_s += busy
            st.decode_link_floor_s += link_floor
        else:
            st.prefill_only_time_s += wall
        (self.rounds if decode else self.prefill_steps).append(RoundStats(
            start=result.start, wall_s=wall, link_s=busy, link_bytes=nbytes, compute_s=compute,
            draft_s=result.draft_s, wait_s=result.wait_s, query_tokens=plan.num_tokens,
            context_tokens=sum(s.start_pos + len(s.token_ids) for s in plan.seqs),
            attention_pairs=sum(len(s.token_ids) * (s.start_pos + len(s.token_ids))
                                for s in plan.seqs),
            num_seqs=len(plan.seqs), prefill_tokens=prefill_tokens,
            new_tokens=sum(len(result.new_tokens.get(s.request_id, ())) for s in plan.seqs
                           if s.sample and not s.prefill),
            draft_tokens=sum(len(d) for d in result.drafts.values()),
            draft_seqs=len(result.drafts), link_floor_s=link_floor, history_bytes=history,
            history_floor_bytes=history_floor,
            tree_nodes=sum(s.num_drafts for s in plan.seqs if s.parents),
            draft_fed_tokens=sum(d.unseen for d in plan.drafts if result.drafts.get(d.request_id)),
            host_bytes=host_bytes,
            host_busy_s=host_busy, host_wait_s=host_wait, host_serial_s=host_serial,
        ))
        if decode:
            self.tracer.add("round", "round", result.start, end)
        if shaper is not None and decode:
            self._observe_shape(shaper, plan, result, busy, wall - host_wait,
                                bool(prefill_tokens))

    def _observe_shape(self, shaper: RoundShaper, plan: StepPlan, result: StepOutput,
                       link_s: float, wall: float, prefill: bool) -> None:
        """What a decode round measured, for the next rounds' shape (speculative_policy auto):
        verification = the time neither blocked on the link (``wall``: less any wait for the
        host's partials) nor drafting."""
        shaper.observe_step(plan, result, link_s,
                            max(0.0, wall - result.wait_s - result.draft_s), result.draft_s,
                            prefill)
        shape = self.scheduler.draft_shape
        self.tracer.add("shape", f"depth {shape.depth} nodes {shape.num_nodes}", result.start,
                        result.start, depth=shape.depth, nodes=shape.num_nodes,
                        topk=shape.topk)

    def _note_host(self, plan: StepPlan, streamed: int, on_host: int, compute: float,
                   decode: bool, waited: float, serial: float) -> None:
        """Host attention, after a decode round: the device time the host had nothing to do
        (for the split), and whether the round is link-bound, i.e. streaming all its cold
        history (what the host attended included) would take longer than the device's
        compute (its wait for the host excluded): only then does ``auto`` give the host a
        share. The host's own cost per byte it measures itself."""
        host, sch = self.worker.host, self.scheduler
        assert host is not None
        cold = streamed + on_host
        if not (decode and cold):  # (a step without cold history, e.g. drafts only, says nothing)
            return
        sch.host_pays = cold / self._link_rate() > compute - waited
        if on_host:
            sch.host_serial_s = (0.7 * sch.host_serial_s + 0.3 * serial if sch.host_serial_s
                                 else serial)
        if sch.shaper is not None:  # the round-shape policy weighs shapes with the split
            verified = sum(1 for s in plan.seqs if s.sample and not s.prefill)
            sch.shaper.observe_host(cold / max(1, verified), self._link_rate(),
                                    host.cost_line() if sch.host_pays else (0.0, 0.0),
                                    sch.host_serial_s)

    def _host_bytes(self, plan: StepPlan) -> int:
        """KV bytes the step attended on the host (host_attention)."""
        layers = self.layout.num_layers
        return sum(s.host_bytes(self.store.block_bytes, layers) for s in plan.seqs)

    def _link_rate(self) -> float:
        """Bytes/s of the link: the emulated rate where one is set, else the measured one."""
        gbps = self.config.link_gbps
        return gbps * 1e9 if gbps else self.history.link_bps

    # ---- outputs and metrics ------------------------------------------------------------
    def _output(self, req: Request) -> RequestOutput:
        """What the API hands back for a request now (its text so far while it runs: the
        incremental decoder's, nothing decoded again)."""
        logprobs = None if req.logprobs is None else [self._logprobs(e) for e in req.logprobs]
        comp = CompletionOutput(
            index=0, text=req.output_text, token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason, num_proposed_tokens=req.num_proposed,
            num_accepted_tokens=req.num_accepted, num_rounds=req.num_rounds, error=req.error,
            logprobs=logprobs,
            cumulative_logprob=None if logprobs is None else req.cumulative_logprob,
            stop_reason=req.stop_reason,
        )
        metrics = {"arrival_time": req.arrival_time}
        for key in ("first_scheduled_time", "first_token_time", "last_token_time"):
            if getattr(req, key) is not None:
                metrics[key] = getattr(req, key)
        if req.finish_time is not None:
            metrics["finished_time"] = req.finish_time
        if req.first_token_time is not None:
            metrics["ttft_s"] = req.first_token_time - req.arrival_time
        if req.finish_time is not None and req.first_token_time is not None:
            n = max(1, len(req.output_token_ids) - 1)
            metrics["tpot_s"] = (req.finish_time - req.first_token_time) / n
        prompt = None
        if req.prompt_logprobs is not None:  # the first prompt token has none
            prompt = [None, *(self._logprobs(e) for e in req.prompt_logprobs)]
        return RequestOutput(req.request_id, None, list(req.prompt_token_ids), [comp],
                             req.finished, metrics, req.num_computed_tokens,
                             prompt_logprobs=prompt, num_cached_tokens=req.num_cached_tokens)

    def _logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        """One position's log-probabilities as vLLM hands them out: the chosen token's, then
        the most likely ones', by token id, with each token's text."""
        out = {entry.token: Logprob(entry.logprob, entry.rank, self._token_text(entry.token))}
        for rank, (tok, lp) in enumerate(entry.top, 1):
            if tok not in out:
                out[tok] = Logprob(lp, rank, self._token_text(tok))
        return out

    def _token_text(self, token: int) -> str | None:
        """A token's own text (cached: the same few thousand tokens come back again and
        again)."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode(
                [token], skip_special_tokens=False)
        return text

    def get_metrics(self) -> dict[str, Any]:
        """The stats (``EngineStats.as_dict``) plus KV usage of both tiers and the queues."""
        c = self.stats.as_dict()
        shaper = self.scheduler.shaper
        # speculative_policy auto: how often each chain depth was chosen (0 = no drafts)
        c["speculative_depth_chosen"] = dict(shaper.chosen) if shaper is not None else {}
        c["speculative_nodes_chosen"] = dict(shaper.chosen_nodes) if shaper is not None else {}
        block_bytes = self.store.block_bytes
        dev, host, cache = self.kv.device, self.kv.host, self.kv.cache
        c.update({
            "device_kv_blocks_used": dev.num_used, "device_kv_blocks_total": dev.num_blocks,
            "host_kv_blocks_used": host.num_used, "host_kv_blocks_total": host.num_blocks,
            # automatic prefix caching (named as vLLM names them; tokens)
            "prefix_cache_queries_total": cache.queries if cache else 0,
            "prefix_cache_hits_total": cache.hits if cache else 0,
            "prefix_cache_hits_by_tier": dict(cache.hits_by_tier) if cache else {},
            "prefix_cache_blocks": {"device": dev.num_cached, "host": host.num_cached},
            # host attention: KV bytes attended on the host CPU, its measured rate, the share
            "host_attention_bytes": self.worker.host.bytes if self.worker.host else 0,
            "host_attention_bytes_per_s": self.worker.host.rate if self.worker.host else 0.0,
            "host_attention_share": self.scheduler.host_share,
            "device_kv_usage": dev.num_used / dev.num_blocks if dev.num_blocks else 0.0,
            "host_kv_usage": host.num_used / host.num_blocks if host.num_blocks else 0.0,
            "mode": self.config.mode,
            "device_kv_budget_bytes": self.config.device_budget,
            "device_kv_peak_bytes": dev.peak_used * block_bytes + self.history.peak_bytes,
            "host_kv_peak_bytes": host.peak_used * block_bytes,
            "device_kv_used_bytes": dev.num_used * block_bytes,
            "host_kv_used_bytes": host.num_used * block_bytes,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "max_concurrency": self.scheduler.max_concurrency,
        })
        return c

    def close(self) -> None:
        if self.worker.host is not None:
            self.worker.host.close()
        self.backend.close()


def _maybe_tokenizer(folder: str | Path) -> Tokenizer | None:
    return Tokenizer(folder) if (Path(folder) / "tokenizer.json").is_file() else None


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
