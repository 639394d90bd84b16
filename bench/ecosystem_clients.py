"""Other projects' serving benchmarks against ``specstream serve``, next to its own /metrics.

SGLang's ``bench_serving.py`` is taken out of the ``sglang`` wheel (``pip download --no-deps``;
nothing of sglang is installed) and run in a client virtual environment of its own with the
packages it imports, against ``specstream serve`` on the embedded pair, on a free loopback port,
once with ``--backend vllm`` (``/v1/completions``) and once with ``--backend vllm-chat``
(``/v1/chat/completions``), both streamed, on ``--dataset-name random-ids`` (random token ids:
no download). Around each run ``/metrics`` is scraped, and the server's own TTFT, inter-token
latency, per-request latency and token counts for that run (the differences of its histograms
and counters) are printed beside bench_serving's.

    bash scripts/setup.sh serve && .venv/bin/python bench/ecosystem_clients.py

or ``bash bench/ecosystem_clients.sh``. Writes ``bench/results/ecosystem-clients.{json,md}``.
Downloads (the wheel, the client's packages) go under ``tmp/ecosystem/`` in the repository,
which git ignores, and are reused by the next run.

sglang 0.5.9 is the newest release whose ``bench_serving.py`` stands alone: from 0.5.10 on it is
a shim over ``sglang.benchmark.serving``, which imports the sglang runtime (torch, its kernels).
The request bodies of the newest release's completions and chat functions are the same (see
``tests/test_client_bodies.py``, which replays them without a download).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "specstream" / "assets" / "default-target"
SERVED = "specstream-default"
# What bench_serving.py imports at its top (0.5.9), and nothing else: no torch, no sglang.
CLIENT_PACKAGES = ["aiohttp", "numpy", "pybase64", "requests", "datasets", "pillow", "tqdm",
                   "transformers"]
BACKENDS = {"vllm": "/v1/completions", "vllm-chat": "/v1/chat/completions"}

# The server's series for each figure: vLLM's name first, this project's older name second.
HISTOGRAMS = {
    "ttft": ["vllm:time_to_first_token_seconds", "specstream_time_to_first_token_seconds"],
    "itl": ["vllm:inter_token_latency_seconds", "specstream_inter_token_latency_seconds"],
    "tpot": ["vllm:request_time_per_output_token_seconds",
             "specstream_time_per_output_token_seconds"],
    "e2e": ["vllm:e2e_request_latency_seconds", "specstream_e2e_request_latency_seconds"],
}
COUNTERS = {
    "requests": ["vllm:request_success", "specstream_requests_finished"],
    "prompt_tokens": ["vllm:prompt_tokens", "specstream_prompt_tokens"],
    "generation_tokens": ["vllm:generation_tokens", "specstream_generation_tokens"],
}


def log(msg: str) -> None:
    print(f"[ecosystem] {msg}", file=sys.stderr, flush=True)


def pip(py: Path | str, *args: str) -> None:
    """``py -m pip ARGS``, its output shown only when it fails."""
    cmd = [str(py), "-m", "pip", "-q", "--disable-pip-version-check", *args]
    log("$ " + shlex.join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pip failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")


def client_venv(work: Path) -> Path:
    """A virtual environment for the client with bench_serving's imports (no torch)."""
    venv = work / "clients-venv"
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = "import aiohttp, numpy, pybase64, requests, datasets, PIL, tqdm, transformers"
    if subprocess.run([str(py), "-c", probe], capture_output=True).returncode != 0:
        t0 = time.monotonic()
        pip(py, "install", *CLIENT_PACKAGES)
        log(f"client packages installed in {time.monotonic() - t0:.0f} s")
    return py


def bench_serving(work: Path, version: str) -> Path:
    """``sglang/bench_serving.py`` out of the sglang wheel (downloaded once, no deps)."""
    out = work / f"sglang-{version}" / "bench_serving.py"
    if out.exists():
        return out
    wheels = work / "wheels"
    pip(sys.executable, "download", "--no-deps", "-d", str(wheels), f"sglang=={version}")
    wheel = next(wheels.glob(f"sglang-{version}-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        text = z.read("sglang/bench_serving.py")
    if b"from sglang.benchmark" in text:
        raise SystemExit(f"sglang {version}'s bench_serving.py is a shim over the sglang package; "
                         "take --sglang-version 0.5.9 or older")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(text)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``specstream serve`` in a child process on a loopback port."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "specstream", "serve", "--host", "127.0.0.1",
                    "--port", str(self.port), "--log-level", "warning", *args]
        log("$ " + shlex.join(self.cmd))
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=ROOT)
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"the server did not start: see {log_path}")
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                               if k != "model_name") + "}")
                out[key] = out.get(key, 0.0) + s.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def series(samples: dict[str, float], name: str) -> dict[str, float]:
    """Samples whose metric name is exactly ``name``, keyed by their labels."""
    return {k[len(name):]: v for k, v in samples.items() if k.split("{", 1)[0] == name}


def histogram_delta(before: dict[str, float], after: dict[str, float],
                    names: list[str]) -> dict[str, Any] | None:
    """Mean and interpolated median (seconds) of what one histogram gained between scrapes."""
    for name in names:
        if not series(after, name + "_count"):
            continue
        count = sum(series(after, name + "_count").values()) - sum(
            series(before, name + "_count").values())
        total = sum(series(after, name + "_sum").values()) - sum(
            series(before, name + "_sum").values())
        buckets: dict[float, float] = {}
        for labels, v in series(after, name + "_bucket").items():
            le = float(labels.split("le=", 1)[1].split(",", 1)[0].rstrip("}"))
            buckets[le] = buckets.get(le, 0.0) + v - series(before, name + "_bucket").get(
                labels, 0.0)
        return {"series": name, "count": count,
                "mean_s": total / count if count else None,
                "median_s": bucket_quantile(buckets, 0.5)}
    return None


def bucket_quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket the rank falls in."""
    edges = sorted(buckets)
    if not edges or buckets[edges[-1]] <= 0:
        return None
    rank = q * buckets[edges[-1]]
    lo, below = 0.0, 0.0
    for le in edges:
        if buckets[le] >= rank:
            if math.isinf(le):
                return lo
            return lo + (le - lo) * (rank - below) / max(buckets[le] - below, 1e-12)
        lo, below = le, buckets[le]
    return None


def counter_delta(before: dict[str, float], after: dict[str, float],
                  names: list[str]) -> dict[str, Any] | None:
    for name in names:
        for sample in (name + "_total", name):
            now = series(after, sample)
            if now:
                return {"series": name,
                        "value": sum(now.values()) - sum(series(before, sample).values())}
    return None


def run_bench_serving(py: Path, script: Path, server: Server, backend: str,
                      args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / f"bench_serving-{backend}.jsonl"
    out.unlink(missing_ok=True)
    cmd = [str(py), str(script), "--backend", backend, "--base-url", server.url,
           "--model", str(TARGET), "--served-model-name", SERVED,
           "--dataset-name", "random-ids", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "1",
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
           "--request-rate", "inf", "--warmup-requests", "0", "--seed", "1",
           "--disable-tqdm", "--output-file", str(out), "--output-details"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    before = server.metrics()
    log("$ " + shlex.join(cmd))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work)
    after = server.metrics()
    (work / f"bench_serving-{backend}.log").write_text(proc.stdout + proc.stderr)
    result: dict[str, Any] = {}
    if out.exists() and out.read_text().strip():
        result = json.loads(out.read_text().splitlines()[-1])
    errors = [e for e in result.pop("errors", []) if e]
    for key in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "server_info"):
        result.pop(key, None)
    completed = int(result.get("completed", 0))
    server_side: dict[str, Any] = {k: histogram_delta(before, after, v)
                                   for k, v in HISTOGRAMS.items()}
    server_side.update({k: counter_delta(before, after, v) for k, v in COUNTERS.items()})
    return {
        "client": f"sglang {args.sglang_version} bench_serving.py --backend {backend}",
        "endpoint": BACKENDS[backend],
        "exit_code": proc.returncode,
        "requests": args.num_prompts,
        "succeeded": completed,
        "success_pct": 100.0 * completed / args.num_prompts,
        "first_errors": sorted(set(errors))[:3] or (
            [] if proc.returncode == 0 else [(proc.stdout + proc.stderr)[-1500:]]),
        "bench_serving": result,
        "server_metrics": server_side,
    }


def fmt(v: Any, scale: float = 1.0, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v * scale:.{digits}f}"


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| client | endpoint | success | figure | bench_serving | server /metrics |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        b, m = r["bench_serving"], r["server_metrics"]
        dur = b.get("duration")

        def hist(key: str, stat: str, m: dict[str, Any] = m) -> str:
            h = m.get(key)
            return fmt(h and h[f"{stat}_s"], 1000) + (f" (`{h['series']}`)" if h else "")

        gen = m.get("generation_tokens")
        rows = [
            ("mean TTFT (ms)", fmt(b.get("mean_ttft_ms")), hist("ttft", "mean")),
            ("median TTFT (ms)", fmt(b.get("median_ttft_ms")), hist("ttft", "median")),
            ("mean ITL (ms)", fmt(b.get("mean_itl_ms")), hist("itl", "mean")),
            ("median ITL (ms)", fmt(b.get("median_itl_ms")), hist("itl", "median")),
            ("mean TPOT (ms)", fmt(b.get("mean_tpot_ms")), hist("tpot", "mean")),
            ("mean e2e latency (ms)", fmt(b.get("mean_e2e_latency_ms")), hist("e2e", "mean")),
            ("output tokens", fmt(b.get("total_output_tokens"), digits=0),
             fmt(gen and gen["value"], digits=0)),
            ("output throughput (tok/s)", fmt(b.get("output_throughput")),
             fmt(gen and dur and gen["value"] / dur) + " (tokens / bench duration)"),
            ("requests finished", str(r["succeeded"]),
             fmt(m.get("requests") and m["requests"]["value"], digits=0)),
        ]
        first = f"| {r['client']} | `{r['endpoint']}` | {r['success_pct']:.0f}% |"
        for i, (name, ours, theirs) in enumerate(rows):
            lead = first if i == 0 else "| | | |"
            lines.append(f"{lead} {name} | {ours} | {theirs} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sglang-version", default="0.5.9")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256, help="random prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="tokens per request")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--backends", default="vllm,vllm-chat")
    p.add_argument("--server-args", default="--mode specstream",
                   help="extra flags for specstream serve (default: %(default)s)")
    p.add_argument("--work", type=Path, default=ROOT / "tmp" / "ecosystem")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ecosystem-clients")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    script = bench_serving(args.work, args.sglang_version)
    py = client_venv(args.work)
    server = Server(shlex.split(args.server_args), args.work / "server.log")
    try:
        runs = [run_bench_serving(py, script, server, b, args, args.work)
                for b in args.backends.split(",")]
    finally:
        server.stop()
    record = {
        "command": "bash bench/ecosystem_clients.sh " + shlex.join(argv or sys.argv[1:]),
        "server": "specstream serve " + args.server_args + " (embedded pair, loopback)",
        "workload": {"dataset": "random-ids", "input_len": args.input_len,
                     "output_len": args.output_len, "num_prompts": args.num_prompts,
                     "max_concurrency": args.concurrency, "ignore_eos": True,
                     "stream": True, "temperature": 0.0},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                   f"{platform.python_version()}",
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    md = (f"# Ecosystem clients against specstream serve\n\n`{record['command']}`\n\n"
          f"Server: {record['server']}. Workload: {json.dumps(record['workload'])}. "
          f"Machine: {record['machine']}.\n\n{table(runs)}\n")
    for r in runs:
        if r["first_errors"]:
            md += f"\n{r['client']}: first errors:\n\n```\n" + "\n".join(
                e[:400] for e in r["first_errors"]) + "\n```\n"
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0 if all(r["success_pct"] == 100 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
