"""The engine's own host work per decode round, at the counts of a GPU workload.

A `specstream` round of Qwen3-8B over 8 requests x 32K context on an H200 is ~760 ms on the link
and thousands of (layer, chunk) steps for the host to drive. This bench keeps every count that
drives host work as in that round (36 target layers, 8 verified requests, 16 history chunks per
request per layer, q = 4 drafts so 5 query positions per request, 8 requests of the other group
drafting in the round with a 28-layer draft) and shrinks everything per token (one KV head of
dim 8, 64-token chunks, a tiny vocabulary), with the link unthrottled, so arithmetic and memory
traffic are negligible and what remains is the host's own work: Python, launches, waits.

It builds the engine's worker on a random checkpoint and runs the round through
``Worker.run`` with a plan as the scheduler would hand it (history already on the host, as
after prefill; prefilling 32K-token contexts is not what this measures), alternating the two
groups as `specstream` does.

    python bench/host_overhead.py [--json FILE]

Prints and writes ``host_ms_per_round`` (median wall time of a round), ``host_us_per_chunk_wave``
(that over the round's layers x chunks), ``h200_link_ms_per_round`` (the round's history bytes
at the real geometry: 32 query / 8 KV heads of dim 128 in bf16, at 50 GB/s) and
``host_over_link``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from gpu_check_steps.mechanics import random_checkpoint

from specstream.config import EngineConfig
from specstream.engine.contract import DraftWork, SeqWork, StepPlan
from specstream.engine.llm_engine import LLMEngine
from specstream.sampling_params import SamplingParams

H200 = dict(num_kv_heads=8, head_dim=128, dtype_bytes=2, link_gbps=50.0)
TINY = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
            intermediate_size=64)


def _plans(args: argparse.Namespace, engine: LLMEngine) -> list[StepPlan]:
    """The two groups' rounds: one verifies its requests while the other drafts."""
    bs, chunk = args.block_size, args.chunk_tokens
    host_tokens = args.chunks * chunk
    ctx = host_tokens + args.tail_tokens  # tokens with KV; then 1 + q new positions
    per_chunk = chunk // bs
    tail_blocks = -(-(args.tail_tokens + args.q + 1) // bs)
    params = SamplingParams(max_tokens=1 << 20, temperature=args.temperature, seed=1,
                            ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (ctx + 1,), generator=gen).tolist()
               for _ in range(2 * args.requests)]
    plans = []
    for g in (0, 1):
        seqs, drafts = [], []
        for r in range(args.requests):
            i = g * args.requests + r
            host = [(i * args.chunks + c) * per_chunk + b
                    for c in range(args.chunks) for b in range(per_chunk)]
            chunks = tuple(tuple(host[c * per_chunk:(c + 1) * per_chunk])
                           for c in range(args.chunks))
            seqs.append(SeqWork(
                request_id=f"r{i}", token_ids=tuple(prompts[i][ctx - 1:]) + (5,) * args.q,
                start_pos=ctx - 1 + 0, num_drafts=args.q, prefill=False, sample=True,
                host_tokens=host_tokens,
                device_blocks=tuple(range(i * tail_blocks, (i + 1) * tail_blocks)),
                restore_chunks=chunks, params=params))
            j = (1 - g) * args.requests + r
            drafts.append(DraftWork(f"r{j}", tuple(prompts[j]), args.q, 1 << 20, params,
                                    after_verify=False))
        plans.append(StepPlan(tuple(seqs), tuple(drafts)))
    return plans


def _h200_link_ms(args: argparse.Namespace) -> tuple[float, float]:
    """Bytes of history one such round moves at Qwen3-8B's geometry, and their link time."""
    layer_tok = 2 * H200["num_kv_heads"] * H200["head_dim"] * H200["dtype_bytes"]
    nbytes = args.layers * args.requests * args.real_context * layer_tok
    return nbytes / 1e9, nbytes / (H200["link_gbps"] * 1e9) * 1e3


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--layers", type=int, default=36, help="target layers (Qwen3-8B: 36)")
    ap.add_argument("--draft-layers", type=int, default=28, help="draft layers (Qwen3-0.6B)")
    ap.add_argument("--requests", type=int, default=8, help="requests verified per round")
    ap.add_argument("--chunks", type=int, default=16, help="history chunks per request/layer")
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tail-tokens", type=int, default=32, help="resident tail per request")
    ap.add_argument("-q", type=int, default=4, help="draft tokens per request per round")
    ap.add_argument("--real-context", type=int, default=32768,
                    help="context of the real round whose link time is the yardstick")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (after 2 warm-ups)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra EngineConfig fields (e.g. attention_backend=torch)")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    ap.add_argument("--profile", type=Path, help="cProfile the timed rounds into this file")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="specstream-host-overhead-"))
    target = random_checkpoint(work / "target", dict(TINY, num_hidden_layers=args.layers,
                                                     tie_word_embeddings=False), 64, "cpu")
    draft = random_checkpoint(work / "draft", dict(TINY, num_hidden_layers=args.draft_layers,
                                                   tie_word_embeddings=True), 64, "cpu")
    layer_tok = 2 * TINY["num_key_value_heads"] * TINY["head_dim"] * 4
    host_tokens = 2 * args.requests * (args.chunks * args.chunk_tokens + args.block_size)
    extra = {}
    for kv in args.engine_arg:
        key, value = kv.split("=", 1)
        extra[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") \
            else value
    config = EngineConfig(
        mode="specstream", dtype="float32", block_size=args.block_size,
        chunk_tokens=args.chunk_tokens, resident_tail_tokens=args.tail_tokens,
        offload_after_tokens=args.tail_tokens + args.block_size,
        device_kv_bytes=64 * args.requests * (args.tail_tokens + 2 * args.block_size)
        * args.layers * layer_tok + (1 << 24),
        host_kv_bytes=host_tokens * args.layers * layer_tok, proposer="draft",
        draft_model=str(draft), num_speculative_tokens=args.q, **extra)
    engine = LLMEngine(target, config)
    try:
        plans = _plans(args, engine)
        host = engine.store.host
        assert host is not None
        host.normal_()  # history as after prefill (values do not matter here)
        proposer = engine.proposer
        times = []
        profiler = cProfile.Profile()
        for n in range(args.rounds + 2):
            plan = plans[n % 2]
            for d in plan.drafts:  # as after the group's last verification: one new token
                proposer.rollback(d.request_id, len(d.token_ids) - 1)
            if args.profile and n >= 2:
                profiler.enable()
            t0 = time.perf_counter()
            out = engine.worker.run(plan)
            dt = time.perf_counter() - t0
            profiler.disable()
            assert not out.errors, out.errors
            assert len(out.new_tokens) == args.requests
            if n >= 2:
                times.append(dt)
    finally:
        engine.close()
    if args.profile:
        profiler.dump_stats(args.profile)
    gb, link_ms = _h200_link_ms(args)
    host_ms = statistics.median(times) * 1e3
    waves = args.layers * args.chunks
    result = {
        "host_ms_per_round": round(host_ms, 2),
        "host_us_per_chunk_wave": round(host_ms * 1e3 / waves, 1),
        "h200_link_ms_per_round": round(link_ms, 1),
        "host_over_link": round(host_ms / link_ms, 4),
        "h200_history_gb_per_round": round(gb, 2),
        "chunk_waves_per_round": waves,
        "chunk_attentions_per_round_one_per_request": waves * args.requests,
        "rounds": len(times),
        "host_ms_min": round(min(times) * 1e3, 2),
        "host_ms_max": round(max(times) * 1e3, 2),
        "torch_threads": torch.get_num_threads(),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
    }
    for key in ("host_ms_per_round", "host_us_per_chunk_wave", "h200_link_ms_per_round",
                "host_over_link"):
        print(f"{key}: {result[key]}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
