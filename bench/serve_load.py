"""Load test for ``specstream serve`` (in the spirit of vLLM's benchmark_serving).

Streams ``/v1/completions`` requests with token-id prompts cut from the bench workload's
held-out text (exact prompt lengths), either closed-loop (``--concurrency N`` requests always in
flight) or open-loop (Poisson arrivals at ``--request-rate R``, optionally capped by
``--concurrency``), for ``--num-requests`` requests or ``--duration`` seconds. Reports TTFT,
TPOT and end-to-end latency percentiles, request and token throughput, and every failure with
its message: a request either completes or is counted as an error, never lost.

    specstream serve --port 8000 &
    python bench/serve_load.py --concurrency 8 --duration 120 --prompt-len 512 \
        --output-len 64 --json load.json

``--workload multiturn`` sends conversations instead (``specstream bench --workload multiturn``'s,
specstream/bench/multiturn.py): ``--num-conversations`` of ``--turns`` turns, turn 1 a
``--prompt-len`` context plus a ``--message-len`` user message, every later turn the previous
prompt + the previous output + a new message, as token ids. Closed loop per conversation:
``--concurrency`` conversations in flight, each sending its next turn when the previous one has
finished. The server answers text, so a turn's output is re-encoded with ``--tokenizer`` (as a
chat client's history is) and a later turn's prompt holds the server's output tokens exactly
only where that text re-encodes to them; with ``--tokenizer none`` outputs are left out of the
history. TTFT percentiles are reported per turn as well as overall, with the server's prefix
cache counters over the run; for the cache's effect, run it against ``specstream serve`` and
``specstream serve --no-prefix-caching``:

    python bench/serve_load.py --workload multiturn --concurrency 4 --turns 4 \
        --prompt-len 3584 --message-len 96 --output-len 64 --json multiturn.json

``--workload shared-doc`` sends ``--num-prompts`` prompts that all open with one
``--prompt-len``-token document, each followed by its own ``--own-len``-token question
(``specstream bench --workload shared-doc``'s, specstream/bench/shared.py); ``shared-system``
is multiturn with one context (a system prompt) opening every conversation. For prefix
sharing's effect, run them against ``specstream serve`` and ``specstream serve
--no-prefix-sharing``:

    python bench/serve_load.py --workload shared-doc --concurrency 8 --num-requests 8 \
        --num-prompts 8 --prompt-len 3584 --own-len 256 --output-len 64 --json doc.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import numpy as np


def _beside(name: str) -> ModuleType:
    """``bench/<name>.py``, imported by its path: this script is also loaded by its own path
    (the tests do), where ``bench/`` is not on the import path."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


report = _beside("serve_load_report")  # Result, Summary, summarize, print_summary
Result = report.Result


def tokenizer_for(args: argparse.Namespace) -> Any:
    """The tokenizer that cuts the prompts (None with --tokenizer none)."""
    if args.tokenizer == "none":
        return None
    from specstream.llm import default_model_dir
    from specstream.tokenizer import Tokenizer

    return Tokenizer(args.tokenizer or default_model_dir("target"))


def build_prompts(args: argparse.Namespace) -> list[list[int]]:
    """``--num-prompts`` prompts of lengths prompt_len * U(1 - r, 1 + r), in token ids."""
    rng = random.Random(args.seed)
    r = args.range_ratio
    lengths = tuple(max(1, int(args.prompt_len * rng.uniform(1 - r, 1 + r)))
                    for _ in range(args.num_prompts))
    tok = tokenizer_for(args)
    if args.workload == "shared-doc":
        from specstream.bench.shared import SharedDocWorkload

        doc = SharedDocWorkload(args.num_prompts, args.prompt_len, args.own_len, args.output_len)
        return doc.prompts(tok, args.vocab_size, args.seed)
    try:
        from specstream.bench.workload import Workload
        from specstream.bench.workload import build_prompts as workload_prompts
    except ImportError:  # older checkout: random token ids
        g = random.Random(args.seed)
        return [[g.randrange(args.vocab_size) for _ in range(n)] for n in lengths]
    return workload_prompts(Workload(lengths, args.output_len), tok, args.vocab_size, args.seed)


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace,
                      prompt: list[int], i: int = 0) -> Result:
    payload = {"model": args.model, "prompt": prompt, "max_tokens": args.output_len,
               "temperature": args.temperature, "stream": True,
               "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    pick = random.Random(f"{args.seed}-{i}")
    if pick.random() < args.sampled_fraction:  # sampled, with a seed anywhere in 64 bits
        seed = pick.choice([0, (1 << 64) - 1, pick.getrandbits(64)])
        payload.update(temperature=args.sample_temperature, seed=seed)
    res = Result(ok=False, prompt_tokens=len(prompt))
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                try:
                    body = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                res.error = f"HTTP {r.status_code}: {body}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = f"stream error: {chunk['error'].get('message')}"
                    return res
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if res.ttft_s is None:
                        res.ttft_s = time.perf_counter() - t0
                    res.text += chunk["choices"][0]["text"]
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.latency_s = time.perf_counter() - t0
    res.ok = True
    return res


def client_for(args: argparse.Namespace) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    return httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits,
                             timeout=timeout)


# what a run returns: every request's result, the run's seconds, and the server's metrics
# before and after it
Load = tuple[list[Result], float, dict[str, float], dict[str, float]]


async def run(args: argparse.Namespace, prompts: list[list[int]]) -> Load:
    """Send requests until --num-requests are sent or --duration has passed; wait for all."""
    results: list[Result] = []
    rng = np.random.default_rng(args.seed)
    sem = asyncio.Semaphore(args.concurrency or 1 << 30)
    t_start = time.perf_counter()

    def more(i: int) -> bool:
        if args.num_requests is not None and i >= args.num_requests:
            return False
        return args.duration is None or time.perf_counter() - t_start < args.duration

    async with client_for(args) as client:
        before = await server_metrics(client)

        async def task(i: int) -> None:
            async with sem:
                results.append(await one_request(client, args, prompts[i % len(prompts)], i))

        tasks, i = [], 0
        if args.request_rate is None:  # closed loop: each worker starts its next on completion
            async def worker() -> None:
                nonlocal i
                while more(i):
                    i += 1
                    results.append(await one_request(client, args, prompts[i % len(prompts)],
                                                     i))

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        else:
            while more(i):
                tasks.append(asyncio.create_task(task(i)))
                i += 1
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
            await asyncio.gather(*tasks)
        server = await server_metrics(client)
    return results, time.perf_counter() - t_start, before, server


def build_conversations(args: argparse.Namespace, tok: Any) -> list[Any]:
    """--workload multiturn: the bench's conversations (specstream/bench/multiturn.py)."""
    from specstream.bench.multiturn import MultiTurnWorkload
    from specstream.bench.multiturn import build_conversations as conversations

    w = MultiTurnWorkload(args.num_conversations, args.turns, args.prompt_len,
                          args.message_len, args.output_len,
                          shared_context=args.workload == "shared-system")
    return conversations(w, tok, args.vocab_size, args.seed)


async def run_multiturn(args: argparse.Namespace, convs: list[Any], tok: Any) -> Load:
    """Every conversation to its end, --concurrency of them in flight, each sending its next
    turn when its previous one has finished (a failed turn ends its conversation). With
    --duration, no conversation starts after it has passed."""
    results: list[Result] = []
    todo = iter(range(len(convs)))  # shared by the workers: each conversation goes to one
    t_start = time.perf_counter()
    async with client_for(args) as client:
        before = await server_metrics(client)

        async def worker() -> None:
            for c in todo:
                if args.duration is not None and time.perf_counter() - t_start >= args.duration:
                    return
                conv = convs[c]
                while not conv.done:
                    turn = len(conv.outputs)
                    res = await one_request(client, args, conv.next_prompt(),
                                            c * args.turns + turn)
                    res.turn = turn
                    results.append(res)
                    if not res.ok:
                        break
                    conv.finish_turn(tok.encode(res.text, add_special_tokens=False)
                                     if tok is not None else [])

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        server = await server_metrics(client)
    return results, time.perf_counter() - t_start, before, server


async def server_metrics(client: httpx.AsyncClient) -> dict[str, float]:
    """A few gauges from the server's /metrics (empty if it has none), and the prefix cache's
    (by tier: ``prefix_cache_hits_total:device``)."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return {}
    keep = ("specstream:spec_mean_accepted_len", "specstream:spec_acceptance_rate",
            "vllm:generation_tokens_total", "specstream:kv_device_used_bytes",
            "specstream:kv_host_used_bytes", "specstream:engine_loop_errors_total",
            "vllm:prefix_cache_queries_total")
    out = {}
    for line in text.splitlines():  # `name{model_name="..."} value`; these have no other label
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if line.startswith("#"):
            continue
        if name in keep:
            out[name.split(":", 1)[1]] = float(line.rsplit(" ", 1)[1])  # keys as before
        elif name.startswith("specstream:prefix_cache_"):  # by tier
            tier = re.search(r'tier="([^"]*)"', line)
            key = name.split(":", 1)[1] + (f":{tier.group(1)}" if tier else "")
            out[key] = float(line.rsplit(" ", 1)[1])
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--workload", choices=["single", "multiturn", "shared-doc", "shared-system"],
                   default="single",
                   help="single: independent prompts; multiturn: conversations re-sending "
                        "their history every turn (closed loop per conversation); shared-doc: "
                        "one document then each prompt's own question; shared-system: "
                        "multiturn with one system prompt opening every conversation")
    p.add_argument("--own-len", type=int, default=256,
                   help="shared-doc: tokens of each prompt's own question")
    p.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    p.add_argument("--message-len", type=int, default=96,
                   help="multiturn: tokens of each turn's user message")
    p.add_argument("--num-conversations", type=int, default=None,
                   help="multiturn: conversations (default: --concurrency)")
    p.add_argument("--model", default="specstream-default", help="model id the server serves")
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-rate", type=float, default=None, help="Poisson requests/s")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight (closed loop; with --request-rate: a cap)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--duration", type=float, default=None, help="seconds to keep sending")
    p.add_argument("--prompt-len", type=int, default=256,
                   help="prompt tokens (multiturn: the context opening every conversation)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="prompt lengths drawn from prompt_len * U(1-r, 1+r)")
    p.add_argument("--num-prompts", type=int, default=64, help="distinct prompts to cycle")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--sampled-fraction", type=float, default=0.0,
                   help="share of requests sampled at --sample-temperature with a seed "
                        "(0, 2**64-1 or random 64-bit)")
    p.add_argument("--sample-temperature", type=float, default=0.8)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tokenizer", default=None,
                   help="model folder whose tokenizer cuts the prompts (default: embedded "
                        "target; 'none': random token ids)")
    p.add_argument("--vocab-size", type=int, default=4096, help="for random token ids")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the summary here ('-' for stdout)")
    args = p.parse_args(argv)
    if args.workload in ("multiturn", "shared-system"):
        if args.request_rate is not None or args.num_requests is not None:
            p.error("--workload multiturn is a closed loop of --num-conversations "
                    "conversations: use --concurrency, not --request-rate or --num-requests")
        args.concurrency = args.concurrency or 8
        args.num_conversations = args.num_conversations or args.concurrency
        return args
    if args.request_rate is None and args.concurrency is None:
        args.concurrency = 8
    if args.num_requests is None and args.duration is None:
        args.num_requests = 64
    if not 0 <= args.range_ratio < 1:
        p.error("--range-ratio must be in [0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workload in ("multiturn", "shared-system"):
        tok = tokenizer_for(args)
        load = asyncio.run(run_multiturn(args, build_conversations(args, tok), tok))
    else:
        load = asyncio.run(run(args, build_prompts(args)))
    results, duration, before, server = load
    summary = report.summarize(results, duration, server, before)
    report.print_summary(summary)
    if args.json:
        record: dict[str, Any] = {"args": vars(args), **asdict(summary)}
        text = json.dumps(record, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0 if summary.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
