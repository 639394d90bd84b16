"""``specstream bench --workload shared-doc | shared-system``: requests that share a long prefix,
every offloading mode with prefix sharing on and off side by side.

- ``shared-doc``: N requests, one shared document (``--context-len`` tokens of held-out text)
  followed by each request's own question (``--own-len`` tokens from elsewhere in that text),
  all arriving together; greedy ``--output-len`` tokens each.
- ``shared-system``: N conversations of ``--turns`` turns that all open with the same system
  prompt (``--context-len`` tokens), then each its own multi-turn history (the multiturn
  workload, ``multiturn.py``, with one context for every conversation).

Each offloading mode runs with ``prefix_sharing`` off (prefix-cache hits copy blocks) and on,
each in a fresh engine, the prefix cache on in both; resident without sharing is the reference
every run's greedy outputs must equal. Beside throughput each run reports the history its
rounds moved (``link_bytes_per_round``) next to the distinct blocks of it
(``link_bytes_unique_per_round``: a block several requests of a round read, once) and the
device-budget floor, and the host KV peak next to the workload's unique KV bytes (the shared
prefix once, every request's own tokens).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from specstream.bench.multiturn import MultiTurnWorkload, run_multiturn
from specstream.bench.runner import BenchSettings, measure, open_llm, workload_kv_bytes
from specstream.bench.workload import Workload, build_prompts, held_out_ids
from specstream.config import MODES

SHARED_DOC = (3584, 8, 64)  # document tokens, requests, output tokens (the setting)
SHARED_DOC_QUICK = (1536, 6, 32)
OWN_LEN = 256  # each request's own question
SHARING_RUNS = ("off", "on")


@dataclass(frozen=True)
class SharedDocWorkload:
    num_requests: int
    doc_len: int
    own_len: int
    output_len: int

    def __post_init__(self) -> None:
        for name in ("num_requests", "doc_len", "own_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"shared-doc {name} must be >= 1, got {getattr(self, name)}")

    def kv_workload(self) -> Workload:
        """Every request's prompt (document + question) and output, as the single workload."""
        return Workload((self.doc_len + self.own_len,) * self.num_requests, self.output_len)

    @property
    def unique_tokens(self) -> int:
        """Tokens of KV with the document counted once."""
        return self.doc_len + self.num_requests * (self.own_len + self.output_len)

    def prompts(self, tokenizer: Any, vocab_size: int, seed: int = 0) -> list[list[int]]:
        """The document (the single workload's first prompt), then each request's question:
        text at the single workload's offsets after the document's (random ids without a
        tokenizer)."""
        n = self.num_requests
        doc = build_prompts(Workload((self.doc_len,), 1), tokenizer, vocab_size, seed)[0]
        own = build_prompts(Workload((self.own_len,) * n, 1), tokenizer, vocab_size, seed + 7)
        if tokenizer is not None:  # other text than the document's: from the end backwards
            ids = held_out_ids(tokenizer, self.doc_len + (n + 1) * self.own_len)
            own = [ids[len(ids) - (i + 1) * self.own_len : len(ids) - i * self.own_len]
                   for i in range(n)]
        return [doc + q for q in own]

    def record(self) -> dict[str, Any]:
        return {"workload": "shared-doc", "num_requests": self.num_requests,
                "doc_len": self.doc_len, "own_len": self.own_len, "output_len": self.output_len,
                "unique_tokens": self.unique_tokens}


def add_shared_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--own-len", type=int, default=OWN_LEN,
                   help=f"shared-doc: tokens of each request's own question after the shared "
                        f"document (default {OWN_LEN})")


def resolve_shared(args: argparse.Namespace) -> None:
    """shared-doc's sizes where the flags leave them unset (shared-system: multiturn's)."""
    sizes = SHARED_DOC_QUICK if args.quick else SHARED_DOC
    for name, default in zip(("context_len", "num_requests", "output_len"), sizes):
        if getattr(args, name) is None or args.quick:
            setattr(args, name, default)


def _token_bytes(s: BenchSettings) -> int:
    """The target's KV bytes of one token (all layers)."""
    return workload_kv_bytes(Workload((1,), 0), s)


def run_shared_bench(args: argparse.Namespace, s: BenchSettings, modes: tuple[str, ...]
                     ) -> dict[str, Any]:
    """The shared workload the flags ask for: ``{"workload", "modes": {mode: {"off", "on"}},
    "ratios"}`` (the caller adds the command and the machine)."""
    offloading = [m for m in modes if MODES[m].offload]
    if not offloading:
        raise ValueError("--workload shared-*: give at least one offloading mode in --modes")
    if args.workload == "shared-system":
        w = MultiTurnWorkload(args.num_requests, args.turns, args.context_len,
                              args.message_len, args.output_len, shared_context=True)
        record, unique = w.record(), w.unique_tokens
    else:
        d = SharedDocWorkload(args.num_requests, args.context_len, args.own_len,
                              args.output_len)
        record, unique = d.record(), d.unique_tokens

    def run(mode: str, sharing: str) -> tuple[dict[str, Any], Any]:
        tokens: Any
        rs = replace(s, extra={**s.extra, "prefix_sharing": sharing == "on"})
        print(f"[bench] {mode}, prefix sharing {sharing} ...", flush=True)
        if args.workload == "shared-system":
            res, tokens = run_multiturn(mode, w, rs)
        else:
            llm = open_llm(mode, rs)
            try:
                prompts = d.prompts(llm.tokenizer, llm.engine.model_config.vocab_size, s.seed)
                res, tokens = measure(llm, mode, d.kv_workload(), rs, prompts)
                m = llm.get_metrics()
                res.update(prefix_cache_hits=m["prefix_cache_hits_total"])
            finally:
                llm.close()
        res["prefix_sharing"] = sharing
        for key, _ in COLUMNS:  # what a multi-turn run does not measure
            res.setdefault(key, 0)
        res["host_kv_peak_over_unique"] = res["host_kv_peak_bytes"] / (unique * token_bytes)
        print(f"[bench] {mode}, prefix sharing {sharing}: {res['output_tokens_per_s']:.1f} "
              f"tok/s, {res.get('link_bytes_per_round', 0) / 1e6:.1f} MB a round, "
              f"{res['wall_s']:.1f}s", flush=True)
        return res, tokens

    token_bytes = _token_bytes(s)
    _, reference = run("resident", "off")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for mode in offloading:
        results[mode] = {}
        for sharing in SHARING_RUNS:
            res, tokens = run(mode, sharing)
            res["outputs_match_reference"] = tokens == reference
            results[mode][sharing] = res
    ratios = {f"{mode}_sharing_on_over_off": (r["on"]["output_tokens_per_s"]
                                              / r["off"]["output_tokens_per_s"])
              for mode, r in results.items()}
    for mode, r in results.items():
        on = r["on"]
        if on.get("link_bytes_unique_per_round"):
            ratios[f"{mode}_link_bytes_over_unique"] = (on["link_bytes_per_round"]
                                                        / on["link_bytes_unique_per_round"])
        ratios[f"{mode}_host_kv_peak_over_unique"] = on["host_kv_peak_over_unique"]
    return {"workload": {**record, "unique_kv_bytes": unique * token_bytes},
            "modes": results, "ratios": ratios}


COLUMNS = [
    ("mode", "{}"), ("prefix_sharing", "{}"), ("output_tokens_per_s", "{:.1f}"),
    ("mean_accepted_len", "{:.2f}"), ("link_bytes_per_round", "{:.3g}"),
    ("link_bytes_unique_per_round", "{:.3g}"), ("link_bytes_floor_per_round", "{:.3g}"),
    ("host_kv_peak_bytes", "{:.3g}"), ("host_kv_peak_over_unique", "{:.2f}"),
    ("prefix_cache_hits", "{}"), ("ttft_ms_p50", "{:.0f}"), ("outputs_match_reference", "{}"),
]
