"""Other projects' serving clients against ``specstream serve``, next to its own /metrics.

Three clients an engineer coming from vLLM or SGLang points at a new server, each installed in a
virtual environment of its own under the work folder, run against ``specstream serve`` on the
embedded pair, on a free loopback port, completions and chat, all requests streamed:

- SGLang's ``bench_serving.py``, taken out of the ``sglang`` wheel (``pip download --no-deps``;
  nothing of sglang is installed), with the packages it imports: ``--backend vllm``
  (``/v1/completions``) and ``--backend vllm-chat`` (``/v1/chat/completions``) on
  ``--dataset-name random-ids`` (random token ids: no download);
- guidellm (``guidellm run``, synthetic text, a concurrent profile; it needs torch, so torch
  2.13.0 goes in first: the CPU build here, never a CUDA one pulled by an unpinned requirement);
- lm-evaluation-harness (``local-completions``: loglikelihood with echo + logprobs and
  generate_until; ``local-chat-completions``) on two small local tasks written here.

Around each run ``/metrics`` is scraped, and the server's own TTFT, inter-token latency,
per-request latency and token counts for that run (the differences of its histograms and
counters, vLLM's ``vllm:`` names where they exist) are printed beside the client's figures.

    bash bench/ecosystem_clients.sh                 # = scripts/setup.sh serve, then this file

Writes ``bench/results/ecosystem-clients.{json,md}``; exits 1 unless every request of every
client succeeded. Downloads (the wheel, the clients' packages: about 3 minutes the first time)
go under ``tmp/ecosystem/`` in the repository, which git ignores, and are reused.

sglang 0.5.9 is the newest release whose ``bench_serving.py`` stands alone: from 0.5.10 on it is
a shim over ``sglang.benchmark.serving``, which imports the sglang runtime (torch, its kernels).
The newest release's completions and chat bodies are the same; ``tests/test_client_bodies.py``
replays every client's bodies without a download.
"""

from __future__ import annotations

import argparse
import json
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

# beside this script (its folder is the first entry of the import path when it runs)
from ecosystem_report import COUNTERS, HISTOGRAMS, counter_delta, histogram_delta, report

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "specstream" / "assets" / "default-target"
SERVED = "specstream-default"
# What bench_serving.py imports at its top (0.5.9), and nothing else: no torch, no sglang;
# lm-evaluation-harness (its api extra, no torch) goes in the same environment.
CLIENT_PACKAGES = ["aiohttp", "numpy", "pybase64", "requests", "datasets", "pillow", "tqdm",
                   "transformers"]
CLIENT_IMPORTS = ["aiohttp", "numpy", "pybase64", "requests", "datasets", "PIL", "tqdm",
                  "transformers"]
BACKENDS = {"vllm": "/v1/completions", "vllm-chat": "/v1/chat/completions"}

def log(msg: str) -> None:
    print(f"[ecosystem] {msg}", file=sys.stderr, flush=True)


def pip(py: Path | str, *args: str) -> None:
    """``py -m pip ARGS``, its output shown only when it fails."""
    cmd = [str(py), "-m", "pip", "-q", "--disable-pip-version-check", *args]
    log("$ " + shlex.join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pip failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")


def venv(work: Path, name: str, probe: str, *installs: list[str]) -> Path:
    """A client virtual environment under ``work`` with ``probe`` importable; each of
    ``installs`` is one ``pip install`` (in order: torch first where a client needs it)."""
    py = work / name / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(py.parents[1])], check=True)
    if subprocess.run([str(py), "-c", probe], capture_output=True).returncode != 0:
        t0 = time.monotonic()
        for packages in installs:
            pip(py, "install", *packages)
        log(f"{name}: installed in {time.monotonic() - t0:.0f} s")
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


OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}


def measured(server: Server, cmd: list[str], work: Path, name: str
             ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run a client; the server's histograms and counters gained meanwhile."""
    env = dict(os.environ, HF_HOME=str(work / "hf-home"), **OFFLINE)
    before = server.metrics()
    log("$ " + shlex.join(cmd))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work)
    after = server.metrics()
    (work / f"{name}.log").write_text(proc.stdout + proc.stderr)
    side: dict[str, Any] = {k: histogram_delta(before, after, v) for k, v in HISTOGRAMS.items()}
    side.update({k: counter_delta(before, after, v) for k, v in COUNTERS.items()})
    return proc, side


def record(client: str, endpoint: str, requests: int, succeeded: int,
           proc: subprocess.CompletedProcess[str], errors: list[str], figures: dict[str, Any],
           side: dict[str, Any]) -> dict[str, Any]:
    tail = [] if proc.returncode == 0 else [(proc.stdout + proc.stderr)[-1500:]]
    return {"client": client, "endpoint": endpoint, "exit_code": proc.returncode,
            "requests": requests, "succeeded": succeeded,
            "success_pct": 100.0 * succeeded / requests if requests else 0.0,
            "first_errors": sorted(set(errors))[:3] or tail,
            "client_figures": figures, "server_metrics": side}


def run_sglang(py: Path, script: Path, server: Server, backend: str,
               args: argparse.Namespace) -> dict[str, Any]:
    out = args.work / f"bench_serving-{backend}.jsonl"
    out.unlink(missing_ok=True)
    proc, side = measured(server, [
        str(py), str(script), "--backend", backend, "--base-url", server.url,
        "--model", str(TARGET), "--served-model-name", SERVED,
        "--dataset-name", "random-ids", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "1",
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--request-rate", "inf", "--warmup-requests", "0", "--seed", "1",
        "--disable-tqdm", "--output-file", str(out), "--output-details"],
        args.work, f"bench_serving-{backend}")
    r = json.loads(out.read_text().splitlines()[-1]) if out.exists() else {}
    figures = {"mean_ttft_ms": r.get("mean_ttft_ms"), "median_ttft_ms": r.get("median_ttft_ms"),
               "mean_itl_ms": r.get("mean_itl_ms"), "median_itl_ms": r.get("median_itl_ms"),
               "mean_tpot_ms": r.get("mean_tpot_ms"),
               "mean_e2e_ms": r.get("mean_e2e_latency_ms"),
               "output_tokens": r.get("total_output_tokens"),
               "output_throughput": r.get("output_throughput"), "duration_s": r.get("duration")}
    return record(f"sglang {args.sglang_version} bench_serving.py --backend {backend}",
                  BACKENDS[backend], args.num_prompts, int(r.get("completed", 0)), proc,
                  [e for e in r.get("errors", []) if e], figures, side)


def run_guidellm(py: Path, server: Server, endpoint: str, args: argparse.Namespace
                 ) -> dict[str, Any]:
    name = "guidellm-" + ("chat" if "chat" in endpoint else "completions")
    out = args.work / f"{name}.json"
    out.unlink(missing_ok=True)
    proc, side = measured(server, [
        str(py.parent / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={server.url},model={SERVED},"
                     f"request_format={endpoint}",
        "--profile", f"kind=concurrent,streams={args.concurrency}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},"
                  f"output_tokens={args.output_len}",
        "--constraint", f"kind=max_requests,count={args.num_prompts}",
        "--tokenizer", f"kind=huggingface_auto,model={TARGET}",
        "--output", f"kind=json,path={out}", "--disable-console"], args.work, name)
    figures: dict[str, Any] = {}
    totals = {"successful": 0, "errored": 0}
    if out.exists():
        bench = json.loads(out.read_text())["benchmarks"][0]
        m = bench["metrics"]
        totals = m["request_totals"]

        def ok(key: str, stat: str) -> Any:
            return m[key]["successful"][stat]

        figures = {"mean_ttft_ms": ok("time_to_first_token_ms", "mean"),
                   "median_ttft_ms": ok("time_to_first_token_ms", "median"),
                   "mean_itl_ms": ok("inter_token_latency_ms", "mean"),
                   "median_itl_ms": ok("inter_token_latency_ms", "median"),
                   "mean_tpot_ms": ok("time_per_output_token_ms", "mean"),
                   "mean_e2e_ms": 1000 * ok("request_latency", "mean"),
                   "output_tokens": ok("output_token_count", "total_sum"),
                   "output_throughput": m["output_tokens_per_second"]["total"]["mean"],
                   "duration_s": bench["duration"]}
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "ERROR" in ln]
    return record(f"guidellm {args.guidellm_version} run (concurrent)", endpoint,
                  args.num_prompts, int(totals["successful"]), proc, errors, figures, side)


# lm-evaluation-harness on two local tasks (no download): a multiple-choice one (loglikelihood:
# echo + logprobs) and a generate_until one, 5 documents each.
LM_EVAL_DOCS = [
    ("def add(a, b):\n    return a", [" + b", " - b", " * b"], 0),
    ("for i in range(10):\n    print(", ["i)", "10)", "range)"], 0),
    ("import torch\nx = torch.", ["zeros(3)", "banana", "import"], 0),
    ("class Scheduler:\n    def", [" schedule(self):", " 3", " class"], 0),
    ("with open(path) as f:\n    text = f.", ["read()", "write", "open"], 0),
]
LM_EVAL_TASKS = {
    "specstream_mc": "output_type: multiple_choice\ndoc_to_text: question\n"
                     "doc_to_choice: choices\ndoc_to_target: answer\ntarget_delimiter: ''\n"
                     "metric_list:\n  - metric: acc\n",
    "specstream_gen": "output_type: generate_until\ndoc_to_text: question\n"
                      "doc_to_target: target\ngeneration_kwargs:\n  until: ['\\n']\n"
                      "  max_gen_toks: 8\n  do_sample: false\n"
                      "metric_list:\n  - metric: exact_match\n",
}


def lm_eval_tasks(work: Path) -> Path:
    folder = work / "lm-eval-tasks"
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a,
                                        "target": c[a]}) + "\n" for q, c, a in LM_EVAL_DOCS))
    for task, body in LM_EVAL_TASKS.items():
        (folder / f"{task}.yaml").write_text(
            f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n{body}")
    return folder


def run_lm_eval(py: Path, server: Server, model: str, args: argparse.Namespace
                ) -> dict[str, Any]:
    chat = model == "local-chat-completions"
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    tasks = ["specstream_gen"] if chat else ["specstream_mc", "specstream_gen"]
    n = len(LM_EVAL_DOCS)
    expected = n if chat else n * len(LM_EVAL_DOCS[0][1]) + n  # one request per choice
    out = args.work / f"lm-eval-{model}"
    proc, side = measured(server, [
        str(py.parent / "lm_eval"), "run", "--model", model,
        "--model_args", f"model={SERVED},base_url={server.url}{endpoint},num_concurrent=1,"
                        "max_retries=1",
        "--tasks", ",".join(tasks), "--include_path", str(lm_eval_tasks(args.work)),
        "--limit", str(n), "--output_path", str(out), "--seed", "1234",
        *(["--apply_chat_template"] if chat else [])], args.work, f"lm-eval-{model}")
    figures: dict[str, Any] = {}
    for f in sorted(out.rglob("results_*.json")):
        for task, res in json.loads(f.read_text())["results"].items():
            figures.update({f"{task} {k.split(',')[0]}": v for k, v in res.items()
                            if k.split(",")[0] in ("acc", "exact_match")})
    log_text = proc.stdout + proc.stderr
    figures["tokenizer"] = ("none: messages sent as text" if chat else
                            "remote (/tokenizer_info, /tokenize)"
                            if "remote tokenizer" in log_text.lower() else "local")
    errors = [ln for ln in log_text.splitlines() if "API request failed" in ln]
    done = side["requests"]["value"] if side.get("requests") else 0
    succeeded = int(min(done, expected)) if proc.returncode == 0 and figures else 0
    return record(f"lm-evaluation-harness {args.lm_eval_version} {model}", endpoint, expected,
                  succeeded, proc, errors, figures, side)


def local_flags_dropped(argv: list[str]) -> list[str]:
    """The command line without --work / --out (this machine's folders)."""
    out, skip = [], False
    for a in argv:
        if skip or a.startswith(("--work=", "--out=")):
            skip = False
            continue
        skip = a in ("--work", "--out")
        if not skip:
            out.append(a)
    return out


def revision() -> str:
    """The commit measured, and whether the package had uncommitted changes."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = git("status", "--porcelain", "--", "specstream").strip()
    return git("rev-parse", "--short", "HEAD").strip() + (
        " + uncommitted changes under specstream/" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="sglang,guidellm,lm-eval")
    p.add_argument("--sglang-version", default="0.5.9")
    p.add_argument("--guidellm-version", default="0.8.1")
    p.add_argument("--lm-eval-version", default="0.4.13")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256, help="random prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="tokens per request")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--server-args", default="--mode specstream",
                   help="extra flags for specstream serve (default: %(default)s)")
    p.add_argument("--work", type=Path, default=ROOT / "tmp" / "ecosystem")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ecosystem-clients")
    args = p.parse_args(argv)
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    clients = args.clients.split(",")
    # the client environments first (minutes, once), then one server for every run
    script = bench_serving(args.work, args.sglang_version) if "sglang" in clients else None
    py = venv(args.work, "clients-venv", "import " + ", ".join(CLIENT_IMPORTS + ["lm_eval"]),
              [*CLIENT_PACKAGES, f"lm-eval[api]=={args.lm_eval_version}"])
    gpy = venv(args.work, "guidellm-venv", "import guidellm", ["torch==2.13.0"],
               [f"guidellm=={args.guidellm_version}"]) if "guidellm" in clients else None
    server = Server(shlex.split(args.server_args), args.work / "server.log")
    runs = []
    try:
        if script:
            runs += [run_sglang(py, script, server, b, args) for b in BACKENDS]
        if gpy:
            runs += [run_guidellm(gpy, server, e, args) for e in BACKENDS.values()]
        if "lm-eval" in clients:
            runs += [run_lm_eval(py, server, m, args)
                     for m in ("local-completions", "local-chat-completions")]
    finally:
        server.stop()
    rec = {
        "command": "bash bench/ecosystem_clients.sh " + shlex.join(local_flags_dropped(
            sys.argv[1:] if argv is None else argv)),
        "server": "specstream serve " + args.server_args + " (embedded pair, loopback)",
        "workload": {"dataset": "random token ids (sglang random-ids, guidellm synthetic_text)",
                     "input_len": args.input_len, "output_len": args.output_len,
                     "num_prompts": args.num_prompts, "max_concurrency": args.concurrency,
                     "ignore_eos": True, "stream": True, "temperature": 0.0},
        "revision": revision(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                   f"{platform.python_version()}",
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rec, indent=1) + "\n")
    md = report(rec, len(LM_EVAL_DOCS))
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0 if runs and all(r["success_pct"] == 100 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
