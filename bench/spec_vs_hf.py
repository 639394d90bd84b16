"""SpecStream speculative decoding vs transformers' assisted generation, same pair, same prompts.

Both systems decode greedily with the same target and draft (fp32 on CPU by default), q draft
tokens per round, ``--new-tokens`` tokens per request with EOS ignored, from the same token-id
prompts cut from the held-out standard library modules
(``specstream.bench.workload.build_prompts``; random ids when the pair has no tokenizer).

* **ours, batch 1**: the engine (``mode="resident"``) generates the prompts one at a time.
* **ours, batch 8**: the engine generates all prompts in one ``generate`` call (one batch).
* **transformers**: ``generate(assistant_model=draft)`` supports batch size 1 only, so it runs
  the prompts one at a time; that one measurement is its batch-1 number and also its batch-8
  number (its batch-8 path *is* its batch-1 path run eight times).

The assistant is configured to draft exactly q tokens every round
(``num_assistant_tokens=q``, schedule ``constant``, confidence early stop off), as ours does.

Tokens/s = generated tokens / wall time of the ``generate`` calls (prefill included; model
loading and one short warm-up excluded). Mean accepted length: for ours, tokens produced by
verification rounds / rounds (accepted drafts + 1; the prefill's first token is not a round);
for transformers, generated tokens / target forward passes (counted with a forward hook; its
first forward is prefill and verification together). ``identical`` compares every request's
tokens with transformers' assisted output.

Both run on ``--threads`` intra-op torch threads (default 1, the engine's default on CPU).
Our draft keeps its full KV cache by default (``--draft-cache full``), as transformers'
assistant does. ``--baseline`` adds target-only greedy rows for both systems; ``--repeats N``
keeps each row's best of N timed runs.

    python bench/spec_vs_hf.py [--target DIR --draft DIR] [--q 4] [--prompt-lens 512,1024]
        [--new-tokens 128] [--num-prompts 8] [--baseline] [--repeats 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specstream import LLM, SamplingParams
from specstream.bench.workload import Workload, build_prompts
from specstream.llm import default_model_dir
from specstream.tokenizer import Tokenizer


@dataclass
class Row:
    """One measured configuration."""

    prompt_len: int
    batch: int
    system: str  # "specstream" or "transformers"
    requests: int
    generated_tokens: int
    seconds: float
    tokens_per_s: float
    mean_accepted_len: float
    identical: str  # "k/n" requests whose tokens equal transformers' assisted output
    note: str = ""


@dataclass
class Result:
    config: dict[str, Any]
    rows: list[Row] = field(default_factory=list)


def _load_hf(folder: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    # EOS ignored, as ignore_eos=True for ours. No pad token either: with a pad token that
    # differs from EOS, the assistant's inner generate() infers an attention mask that hides
    # every pad-id token of the context (outputs stay lossless, acceptance drops).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def _constant_assistant(model: Any, q: int) -> None:
    """Make a transformers assistant draft exactly q tokens every round."""
    gc = model.generation_config
    gc.num_assistant_tokens = q
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0


class HFAssisted:
    """transformers' assisted generation, batch 1, with a target-forward counter."""

    def __init__(self, target: Path, draft: Path, q: int, dtype: torch.dtype) -> None:
        self.target = _load_hf(target, dtype)
        self.draft = _load_hf(draft, dtype)
        _constant_assistant(self.draft, q)
        self.forwards = 0
        self.target.register_forward_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.forwards += 1

    def generate(self, prompt: list[int], new_tokens: int, assisted: bool = True) -> list[int]:
        """Greedy continuation of one prompt (target-only when ``assisted`` is False)."""
        ids = torch.tensor([prompt])
        extra = {"assistant_model": self.draft} if assisted else {}
        out = self.target.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, **extra,
        )
        return out[0, len(prompt):].tolist()


def _ours_accepted_len(outs: list[Any]) -> float:
    accepted = sum(o.outputs[0].num_accepted_tokens for o in outs)
    rounds = sum(o.outputs[0].num_rounds for o in outs)
    return (accepted + rounds) / rounds if rounds else 0.0


def _identical(ours: list[list[int]], ref: list[list[int]]) -> str:
    return f"{sum(a == b for a, b in zip(ours, ref))}/{len(ref)}"


def _time_hf(hf: HFAssisted, prompts: list[list[int]], new_tokens: int, threads: int,
             repeats: int, assisted: bool = True) -> tuple[list[list[int]], float, float]:
    """transformers, one prompt after another: (tokens, best seconds, tokens per forward)."""
    best, tokens, per_forward = float("inf"), [], 0.0
    for _ in range(repeats):
        torch.set_num_threads(threads)
        hf.forwards = 0
        t0 = time.perf_counter()
        tokens = [hf.generate(p, new_tokens, assisted) for p in prompts]
        best = min(best, time.perf_counter() - t0)
        per_forward = sum(len(t) for t in tokens) / hf.forwards
    return tokens, best, per_forward


def _time_ours(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int,
               threads: int, repeats: int) -> tuple[list[list[int]], float, float]:
    """The engine, ``batch`` prompts per generate call: (tokens, best seconds, accepted len)."""
    best, outs = float("inf"), []
    for _ in range(repeats):
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        outs = []
        for i in range(0, len(prompts), batch):
            outs += llm.generate(prompts[i:i + batch], params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    return [o.outputs[0].token_ids for o in outs], best, _ours_accepted_len(outs)


def _engine(target: Path, draft: Path | None, args: argparse.Namespace, kv_bytes: int) -> LLM:
    spec: dict[str, Any] = {}
    if draft is not None:
        spec = dict(draft_model=draft, num_speculative_tokens=args.q,
                    draft_cache=args.draft_cache)
    return LLM(target, mode="resident", device_kv_bytes=kv_bytes, block_size=16,
               dtype=args.dtype, compute_threads=args.threads,
               max_prefill_tokens=max(1024, max(args.prompt_lens)), **spec)


def run(args: argparse.Namespace) -> Result:
    """Measure every prompt length for both systems; returns all rows."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    target, draft = Path(args.target), Path(args.draft)
    tok = Tokenizer(target) if (target / "tokenizer.json").is_file() else None
    hf = HFAssisted(target, draft, args.q, dtype)
    cfg = hf.target.config.get_text_config()
    vocab = cfg.vocab_size
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    token_bytes = cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * 4
    longest = max(args.prompt_lens) + args.new_tokens + args.q + 1
    kv_bytes = 4 * args.num_prompts * longest * token_bytes + (64 << 20)  # ample: all resident
    engines = {"specstream": _engine(target, draft, args, kv_bytes)}
    if args.baseline:
        engines["specstream target-only"] = _engine(target, None, args, kv_bytes)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    result = Result(config={
        **vars(args), "tokenized": tok is not None, "vocab_size": vocab,
        "torch": torch.__version__, "transformers": _hf_version(),
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    })
    n_req = args.num_prompts
    try:
        warm = build_prompts(Workload((32,), 8), tok, vocab, seed=99)[:1]
        for llm in engines.values():
            _time_ours(llm, warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       1, args.threads, 1)
        _time_hf(hf, warm, 8, args.threads, 1)
        for plen in args.prompt_lens:
            prompts = build_prompts(Workload((plen,) * n_req, args.new_tokens), tok, vocab,
                                    seed=args.seed)
            ref, secs, per_fwd = _time_hf(hf, prompts, args.new_tokens, args.threads,
                                          args.repeats)
            n = sum(len(t) for t in ref)
            for batch in (1, n_req):
                note = "" if batch == 1 else f"batch-1 path x{n_req}, same run"
                result.rows.append(Row(plen, batch, "transformers", n_req, n, secs, n / secs,
                                       per_fwd, "reference", note))
            if args.baseline:
                toks, secs, _ = _time_hf(hf, prompts, args.new_tokens, args.threads,
                                         args.repeats, assisted=False)
                result.rows.append(Row(plen, 1, "transformers target-only", n_req, n, secs,
                                       n / secs, 1.0, _identical(toks, ref)))
            for name, llm in engines.items():
                for batch in (1, n_req):
                    toks, secs, acc = _time_ours(llm, prompts, params, batch, args.threads,
                                                 args.repeats)
                    n = sum(len(t) for t in toks)
                    result.rows.append(Row(plen, batch, name, n_req, n, secs, n / secs,
                                           acc if name == "specstream" else 1.0,
                                           _identical(toks, ref)))
    finally:
        for llm in engines.values():
            llm.close()
    result.rows.sort(key=lambda r: (r.prompt_len, r.batch, r.system))
    return result


def _hf_version() -> str:
    import transformers

    return transformers.__version__


def table(result: Result) -> str:
    """A Markdown table of the rows."""
    lines = [
        "| prompt tokens | batch | system | tokens/s | mean accepted len | identical to HF |",
        "|---:|---:|---|---:|---:|---|",
    ]
    for r in result.rows:
        system = r.system + (f" ({r.note})" if r.note else "")
        lines.append(f"| {r.prompt_len} | {r.batch} | {system} | {r.tokens_per_s:.1f} | "
                     f"{r.mean_accepted_len:.2f} | {r.identical} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target folder (default: embedded target)")
    p.add_argument("--draft", default=None, help="draft folder (default: embedded draft)")
    p.add_argument("--q", type=int, default=4, help="draft tokens per round")
    p.add_argument("--prompt-lens", default="512,1024",
                   help="comma-separated prompt lengths in tokens")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=8, help="requests per length = batch")
    p.add_argument("--threads", type=int, default=1, help="intra-op torch threads, both systems")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--draft-cache", default="full", choices=["full", "window"],
                   help="our draft's KV policy; 'full' matches transformers' assistant")
    p.add_argument("--seed", type=int, default=0, help="prompt offsets in the held-out text")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per row; best is kept")
    p.add_argument("--baseline", action="store_true",
                   help="also time target-only greedy decoding (batch 1 for transformers)")
    p.add_argument("--json", default=None, help="write config and rows to this file")
    args = p.parse_args(argv)
    args.prompt_lens = [int(x) for x in str(args.prompt_lens).split(",")]
    args.target = args.target or str(default_model_dir("target"))
    args.draft = args.draft or str(default_model_dir("draft"))
    result = run(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"config": result.config, "rows": [asdict(r) for r in result.rows]}, indent=2))


if __name__ == "__main__":
    main()
