"""``specstream bench --workload multiturn``: chats that re-send their whole history every turn.

C conversations of T turns. Turn 1's prompt is a long context cut from the held-out text
(``workload.py``) plus a user message; turn k+1's is turn k's prompt + the model's turn-k output
token ids + a new user message (other held-out text). Prompts are built as token ids, nothing
is re-tokenized, so every turn's prompt starts exactly with the previous turn's prompt and
output: the case automatic prefix caching is for.

Each conversation is a closed loop through the engine (``LLM.engine.add_request`` and
``step``, as ``LLM.generate`` drives it): a conversation's next turn is submitted in the step
its previous turn finished, while the other conversations go on, so turns are sequential within
a conversation and conversations run concurrently. TTFT is the engine's, from submission.

Every mode runs the workload with the prefix cache on and off, each in a fresh engine; the
resident mode with the cache off is the reference every run's greedy outputs must equal.
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specstream.bench.runner import BenchSettings, open_llm, percentile
from specstream.bench.workload import Workload, build_prompts, held_out_ids
from specstream.llm import LLM
from specstream.sampling_params import SamplingParams
from specstream.tokenizer import Tokenizer

CACHE_RUNS = ("off", "on")  # prefix caching off first: resident's is the reference


@dataclass(frozen=True)
class MultiTurnWorkload:
    num_conversations: int
    turns: int
    context_len: int  # tokens of held-out text that open every conversation
    message_len: int  # tokens of each turn's user message
    output_len: int  # greedy output tokens of each turn (EOS ignored)
    # every conversation opens with the same context (a shared system prompt; shared.py)
    shared_context: bool = False

    def __post_init__(self) -> None:
        for name in ("num_conversations", "turns", "context_len", "message_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"multiturn {name} must be >= 1, got {getattr(self, name)}")

    def prompt_len(self, turn: int) -> int:
        """Prompt tokens of turn ``turn`` (0-based): the context, turn + 1 messages and the
        outputs of the turns before it."""
        return self.context_len + (turn + 1) * self.message_len + turn * self.output_len

    @property
    def history_len(self) -> int:
        """A conversation's tokens at its end: the last turn's prompt and output."""
        return self.prompt_len(self.turns - 1) + self.output_len

    @property
    def unique_tokens(self) -> int:
        """Tokens of KV at the end, a shared context counted once."""
        total = self.num_conversations * self.history_len
        return total - (self.num_conversations - 1) * self.context_len * self.shared_context

    def kv_workload(self) -> Workload:
        """What the device KV budget is sized on (``--device-kv-fraction``): the last turn's
        prompts and outputs, every conversation's at once."""
        return Workload((self.prompt_len(self.turns - 1),) * self.num_conversations,
                        self.output_len)

    def record(self) -> dict[str, Any]:
        return {"workload": "shared-system" if self.shared_context else "multiturn",
                "num_conversations": self.num_conversations,
                "turns": self.turns, "context_len": self.context_len,
                "message_len": self.message_len, "output_len": self.output_len,
                "first_prompt_len": self.prompt_len(0),
                "last_prompt_len": self.prompt_len(self.turns - 1),
                "history_len": self.history_len, "unique_tokens": self.unique_tokens}


@dataclass
class Conversation:
    context: list[int]
    messages: list[list[int]]  # the user message of every turn
    prompts: list[list[int]] = field(default_factory=list)  # each turn's prompt, as sent
    outputs: list[list[int]] = field(default_factory=list)  # each turn's output token ids

    @property
    def done(self) -> bool:
        return len(self.outputs) == len(self.messages)

    def next_prompt(self) -> list[int]:
        """The next turn's prompt (recorded as sent): the history so far + its message."""
        k = len(self.outputs)
        history = self.context if k == 0 else self.prompts[-1] + self.outputs[-1]
        self.prompts.append(history + self.messages[k])
        return self.prompts[-1]

    def finish_turn(self, output_ids: list[int]) -> None:
        assert len(self.outputs) < len(self.prompts), "no turn in flight"
        self.outputs.append(list(output_ids))


def build_conversations(
    w: MultiTurnWorkload, tokenizer: Tokenizer | None, vocab_size: int, seed: int = 0
) -> list[Conversation]:
    """Contexts at the single workload's offsets; messages cut at random offsets of the same
    text (random token ids without a tokenizer)."""
    contexts = build_prompts(Workload((w.context_len,) * w.num_conversations, w.output_len),
                             tokenizer, vocab_size, seed=seed)
    if w.shared_context:
        contexts = [contexts[0]] * w.num_conversations
    n = w.num_conversations * w.turns
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed + 1)
        flat = torch.randint(0, vocab_size, (n, w.message_len), generator=g).tolist()
    else:
        ids = held_out_ids(tokenizer, 2 * w.message_len)
        rng = random.Random(seed + 1)
        starts = [rng.randrange(len(ids) - w.message_len) for _ in range(n)]
        flat = [ids[i : i + w.message_len] for i in starts]
    return [Conversation(ctx, flat[c * w.turns : (c + 1) * w.turns])
            for c, ctx in enumerate(contexts)]


@dataclass(frozen=True)
class TurnResult:
    conversation: int
    turn: int  # 0-based
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float


def converse(llm: LLM, convs: list[Conversation], params: SamplingParams) -> list[TurnResult]:
    """Every conversation to its end, each a closed loop (see the module docstring)."""
    engine = llm.engine
    in_flight: dict[str, int] = {}
    results: list[TurnResult] = []

    def submit(c: int) -> None:
        in_flight[engine.add_request(convs[c].next_prompt(), params)] = c

    for c in range(len(convs)):
        submit(c)
    while in_flight:
        if not engine.has_unfinished():
            raise RuntimeError(f"the engine stopped with {len(in_flight)} turns unfinished")
        for out in engine.step():
            if not out.finished or out.request_id not in in_flight:
                continue
            c, o = in_flight.pop(out.request_id), out.outputs[0]
            if o.finish_reason in ("error", "abort"):
                raise RuntimeError(f"conversation {c}, turn {len(convs[c].outputs) + 1}: "
                                   f"{o.finish_reason}: {o.error}")
            convs[c].finish_turn(o.token_ids)
            results.append(TurnResult(c, len(convs[c].outputs) - 1, len(out.prompt_token_ids),
                                      len(o.token_ids), out.metrics.get("ttft_s", 0.0),
                                      out.metrics.get("tpot_s", 0.0)))
            if not convs[c].done:
                submit(c)
    return results


def run_multiturn(
    mode: str, w: MultiTurnWorkload, s: BenchSettings
) -> tuple[dict[str, Any], list[list[list[int]]]]:
    """The workload in one mode with ``s``'s prefix caching; returns (metrics, the output
    token ids of every conversation's every turn)."""
    llm = open_llm(mode, s)
    try:
        convs = build_conversations(w, llm.tokenizer, llm.engine.model_config.vocab_size,
                                    seed=s.seed)
        # warm-up on tokens no conversation starts with, so that it seeds no cache hit
        llm.generate([convs[0].context[:64][::-1]],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        base = llm.get_metrics()
        params = SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True)
        t0 = time.perf_counter()
        turns = converse(llm, convs, params)
        wall = time.perf_counter() - t0
        m = llm.get_metrics()
        devices = llm.config.mode_spec.devices
    finally:
        llm.close()
    return _metrics(mode, s, w, turns, wall, devices, base, m), [c.outputs for c in convs]


def _metrics(mode: str, s: BenchSettings, w: MultiTurnWorkload, turns: list[TurnResult],
             wall: float, devices: int, base: dict[str, Any], m: dict[str, Any]) -> dict[str, Any]:
    def delta(k: str) -> Any:
        return m.get(k, 0) - base.get(k, 0)

    ttft = [t.ttft_s * 1e3 for t in turns]
    tpot = [t.tpot_s * 1e3 for t in turns]
    n_out = sum(t.output_tokens for t in turns)
    rounds, queries, hits = delta("rounds"), delta("prefix_cache_queries_total"), \
        delta("prefix_cache_hits_total")
    by_tier_now, by_tier_base = (m.get("prefix_cache_hits_by_tier") or {},
                                 base.get("prefix_cache_hits_by_tier") or {})
    return {
        "mode": mode,
        "prefix_caching": "on" if s.enable_prefix_caching else "off",
        "enable_prefix_caching": s.enable_prefix_caching,
        "requests": len(turns),
        "output_tokens": n_out,
        "wall_s": wall,
        "output_tokens_per_s": n_out / wall,
        "output_tokens_per_s_per_device": n_out / wall / devices,
        "devices": devices,
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
        # turn 1 prefills its context in every run; later turns are where a cache hits
        "ttft_ms_p50_by_turn": [percentile([t.ttft_s * 1e3 for t in turns if t.turn == k], 50)
                                for k in range(w.turns)],
        "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99),
        "mean_accepted_len": (delta("accepted_tokens") + rounds) / rounds if rounds else 1.0,
        # per draft token verified: with speculative_policy auto the chosen depths (and so the
        # mean accepted length) follow measured times, this much less
        "acceptance_rate": (delta("accepted_tokens") / delta("proposed_tokens")
                            if delta("proposed_tokens") else 0.0),
        # prompt tokens sent, and those the target prefilled (the rest came from the cache)
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "prefill_tokens": delta("prefill_tokens"),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefix_cache_hits_by_tier": {k: v - by_tier_base.get(k, 0)
                                      for k, v in by_tier_now.items()},
        "prefix_cache_blocks": dict(m.get("prefix_cache_blocks") or {}),  # at the end
        "prefill_only_time_s": delta("prefill_only_time_s"),
        "max_concurrency": m["max_concurrency"],
        "device_kv_peak_bytes": m["device_kv_peak_bytes"],
        "device_kv_budget_bytes": m["device_kv_budget_bytes"],
        "host_kv_peak_bytes": m["host_kv_peak_bytes"],
        "link_bytes_h2d": delta("link_bytes_h2d"),
        # history bytes a decode round moved, the distinct blocks of it, and the floor
        **{f"link_bytes{name}_per_round": (delta(f"decode_history{name}_bytes")
                                           / delta("verify_steps") if delta("verify_steps")
                                           else 0.0)
           for name in ("", "_unique", "_floor")},
    }


def run_multiturn_all(
    w: MultiTurnWorkload, s: BenchSettings, modes: tuple[str, ...],
    progress: bool = True,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Every mode with the prefix cache off and on (off only when ``s`` turns it off):
    ``{mode: {"off": metrics, "on": metrics}}``. ``outputs_match_reference`` compares every
    turn's output with resident's without the cache; ``outputs_match_cache_off`` (the "on"
    runs) with the same mode's without the cache."""
    runs = CACHE_RUNS if s.enable_prefix_caching else ("off",)

    def run(mode: str, cache: str) -> tuple[dict[str, Any], list[list[list[int]]]]:
        if progress:
            print(f"[bench] {mode}, prefix caching {cache} ...", flush=True)
        res, tokens = run_multiturn(mode, w, replace(s, enable_prefix_caching=cache == "on"))
        if progress:
            print(f"[bench] {mode}, prefix caching {cache}: {res['output_tokens_per_s']:.1f} "
                  f"tok/s, TTFT p50 {res['ttft_ms_p50']:.0f} ms, {res['wall_s']:.1f}s",
                  flush=True)
        return res, tokens

    ref_res, ref_tokens = run("resident", "off")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for mode in sorted(modes, key=lambda m: m != "resident"):
        tokens: dict[str, list[list[list[int]]]] = {}
        results[mode] = {}
        for cache in runs:
            if (mode, cache) == ("resident", "off"):
                res, tokens[cache] = ref_res, ref_tokens
            else:
                res, tokens[cache] = run(mode, cache)
            res["outputs_match_reference"] = tokens[cache] == ref_tokens
            res["outputs_match_cache_off"] = (tokens[cache] == tokens["off"]
                                              if cache == "on" else None)
            results[mode][cache] = res
    return results


def multiturn_ratios(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, float]:
    """Per mode: TTFT p50 without the cache over with it, output tokens/s with over without,
    and the mean accepted length with over without (the cache must keep it)."""
    out: dict[str, float] = {}
    for mode, runs in results.items():
        on, off = runs.get("on"), runs.get("off")
        if on is None or off is None:
            continue
        if on["ttft_ms_p50"]:
            out[f"{mode}_ttft_p50_off_over_on"] = off["ttft_ms_p50"] / on["ttft_ms_p50"]
        out[f"{mode}_throughput_on_over_off"] = (on["output_tokens_per_s"]
                                                 / off["output_tokens_per_s"])
        out[f"{mode}_accepted_len_on_over_off"] = (on["mean_accepted_len"]
                                                   / off["mean_accepted_len"])
    return out


COLUMNS = [
    ("mode", "{}"), ("prefix_caching", "{}"), ("output_tokens_per_s", "{:.1f}"),
    ("output_tokens_per_s_per_device", "{:.1f}"), ("ttft_ms_p50", "{:.0f}"),
    ("ttft_ms_p99", "{:.0f}"), ("ttft_ms_p50_by_turn", "{}"), ("tpot_ms_p50", "{:.1f}"),
    ("mean_accepted_len", "{:.2f}"), ("prefill_tokens", "{}"),
    ("prefix_cache_hit_rate", "{:.2f}"), ("hits_device/host", "{}"), ("max_concurrency", "{}"),
    ("outputs_match_cache_off", "{}"), ("outputs_match_reference", "{}"),
]


def format_multiturn(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The bench's table, one row per mode and cache setting."""
    from specstream.bench.cli import format_rows  # the bench's table (cli imports this module)

    rows = []
    for runs in results.values():
        for r in runs.values():
            tiers = r["prefix_cache_hits_by_tier"]
            rows.append({**r,
                         "ttft_ms_p50_by_turn": "/".join(f"{v:.0f}"
                                                         for v in r["ttft_ms_p50_by_turn"]),
                         "hits_device/host": f"{tiers.get('device', 0)}/{tiers.get('host', 0)}",
                         "outputs_match_cache_off": ("-" if r["outputs_match_cache_off"] is None
                                                     else r["outputs_match_cache_off"])})
    return format_rows(rows, COLUMNS)


def run_multiturn_bench(args: argparse.Namespace, s: BenchSettings,
                        modes: tuple[str, ...]) -> dict[str, Any]:
    """``--workload multiturn``: every mode with the prefix cache on and off; prints the
    table and the ratios, returns the report."""
    from specstream.bench.cli import apply_fraction, command_args  # (cli imports this module)

    w = MultiTurnWorkload(args.num_requests, args.turns, args.context_len, args.message_len,
                          args.output_len)
    budget = ({} if args.device_kv_fraction is None
              else apply_fraction(s, w.kv_workload(), args.device_kv_fraction))
    results = run_multiturn_all(w, s, modes)
    print(format_multiturn(results))
    r = multiturn_ratios(results)
    for k, v in r.items():
        print(f"{k}: {v:.2f}")
    return {
        "command": "specstream bench " + " ".join(command_args(args)),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "workload": w.record(),
        "settings": {**{k: v for k, v in vars(s).items() if k != "extra"}, **s.extra,
                     "prefix_caching_runs": list(CACHE_RUNS if s.enable_prefix_caching
                                                 else ("off",)), **budget},
        "modes": results,
        "ratios": r,
    }
