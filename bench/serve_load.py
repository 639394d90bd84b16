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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np


@dataclass
class Result:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class Summary:
    sent: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests/s
    output_throughput: float  # generated tokens/s
    total_token_throughput: float  # (prompt + generated) tokens/s
    ttft_ms: dict[str, float] = field(default_factory=dict)
    tpot_ms: dict[str, float] = field(default_factory=dict)
    latency_ms: dict[str, float] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    server: dict[str, float] = field(default_factory=dict)


def build_prompts(args: argparse.Namespace) -> list[list[int]]:
    """``--num-prompts`` prompts of lengths prompt_len * U(1 - r, 1 + r), in token ids."""
    rng = random.Random(args.seed)
    r = args.range_ratio
    lengths = tuple(max(1, int(args.prompt_len * rng.uniform(1 - r, 1 + r)))
                    for _ in range(args.num_prompts))
    tok = None
    if args.tokenizer != "none":
        from specstream.llm import default_model_dir
        from specstream.tokenizer import Tokenizer

        tok = Tokenizer(args.tokenizer or default_model_dir("target"))
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
                if chunk["choices"] and chunk["choices"][0]["text"] and res.ttft_s is None:
                    res.ttft_s = time.perf_counter() - t0
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.latency_s = time.perf_counter() - t0
    res.ok = True
    return res


async def run(args: argparse.Namespace,
              prompts: list[list[int]]) -> tuple[list[Result], float, dict[str, float]]:
    """Send requests until --num-requests are sent or --duration has passed; wait for all."""
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    results: list[Result] = []
    rng = np.random.default_rng(args.seed)
    sem = asyncio.Semaphore(args.concurrency or 1 << 30)
    t_start = time.perf_counter()

    def more(i: int) -> bool:
        if args.num_requests is not None and i >= args.num_requests:
            return False
        return args.duration is None or time.perf_counter() - t_start < args.duration

    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits,
                                 timeout=timeout) as client:
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
    return results, time.perf_counter() - t_start, server


async def server_metrics(client: httpx.AsyncClient) -> dict[str, float]:
    """A few gauges from the server's /metrics (empty if it has none)."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return {}
    keep = ("specstream_spec_mean_accepted_len", "specstream_spec_acceptance_rate",
            "specstream_generation_tokens_total", "specstream_kv_device_used_bytes",
            "specstream_kv_host_used_bytes", "specstream_engine_loop_errors_total")
    out = {}
    for line in text.splitlines():  # `name{model_name="..."} value`; these have no other label
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in keep and not line.startswith("#"):
            out[name.removeprefix("specstream_")] = float(line.rsplit(" ", 1)[1])
    return out


def summarize(results: list[Result], duration: float, server: dict[str, float]) -> Summary:
    ok = [r for r in results if r.ok]

    def pct(values: list[float]) -> dict[str, float]:
        if not values:
            return {}
        a = np.array(values) * 1000
        return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
                "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}

    out_tokens = sum(r.output_tokens for r in ok)
    return Summary(
        sent=len(results), completed=len(ok), failed=len(results) - len(ok),
        duration_s=duration, request_throughput=len(ok) / duration,
        output_throughput=out_tokens / duration,
        total_token_throughput=(out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        ttft_ms=pct([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=pct([r.tpot_s for r in ok if r.tpot_s is not None]),
        latency_ms=pct([r.latency_s for r in ok]),
        errors=dict(Counter(r.error for r in results if not r.ok and r.error)),
        server=server,
    )


def print_summary(s: Summary) -> None:
    print(f"requests: {s.sent} sent, {s.completed} completed, {s.failed} failed "
          f"in {s.duration_s:.1f} s")
    print(f"throughput: {s.request_throughput:.2f} req/s, {s.output_throughput:.1f} output "
          f"tok/s, {s.total_token_throughput:.1f} total tok/s")
    for name, d in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("E2E", s.latency_ms)):
        if d:
            print(f"{name:5s} ms: " + "  ".join(f"{k} {v:.1f}" for k, v in d.items()))
    for msg, n in s.errors.items():
        print(f"error x{n}: {msg}")
    if s.server:
        print("server: " + "  ".join(f"{k} {v:.6g}" if v < 1e6 else f"{k} {v:.0f}"
                                     for k, v in s.server.items()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="specstream-default", help="model id the server serves")
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-rate", type=float, default=None, help="Poisson requests/s")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight (closed loop; with --request-rate: a cap)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--duration", type=float, default=None, help="seconds to keep sending")
    p.add_argument("--prompt-len", type=int, default=256)
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
    if args.request_rate is None and args.concurrency is None:
        args.concurrency = 8
    if args.num_requests is None and args.duration is None:
        args.num_requests = 64
    if not 0 <= args.range_ratio < 1:
        p.error("--range-ratio must be in [0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = build_prompts(args)
    results, duration, server = asyncio.run(run(args, prompts))
    summary = summarize(results, duration, server)
    print_summary(summary)
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
