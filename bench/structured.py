"""What a grammar costs under speculation: constrained against unconstrained decoding, side by
side on one engine per preset and mode.

    python bench/structured.py                                   # balanced and link-bound
    python bench/structured.py --presets balanced --context-len 3072 --requests 4 \\
        --random-prompts                                          # off the presets

Three variants of the same requests (greedy, the same prompts, the prefix cache off so every
run prefills): ``free`` (no constraint), ``json`` (a JSON schema: an object holding a long
array of strings of at most 80 characters, so the grammar is still open at max_tokens) and
``regex`` (lines of at most 80 characters). Reports, per variant, output tokens/s, tokens/s
over decode-only rounds and the mean accepted length, and each constrained variant's ratio to
``free`` measured in the same pass, and the share of the wall time spent computing grammar
masks; every constrained output is checked against its grammar.
The variants run in a rotating order, ``--repeats`` times; the table shows the medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from specstream import SamplingParams
from specstream.bench.runner import BenchSettings, open_llm, timed_generate
from specstream.bench.workload import Workload, build_prompts
from specstream.structured import Constraint, compile_constraint, grammar_tokenizer
from specstream.structured.matcher import Matcher

PRESETS: dict[str, tuple[dict[str, Any], int | None]] = {  # settings, output_len (None: ours)
    "balanced": ({}, None),
    "link-bound": ({"link_gbps": 0.1, "residency": "tail", "staging_buffers": 4}, 64),
}
LINES = {"type": "object", "required": ["lines"], "additionalProperties": False,
         "properties": {"lines": {"type": "array", "minItems": 1000,
                                  "items": {"type": "string", "maxLength": 80}}}}
VARIANTS: dict[str, Constraint | None] = {
    "free": None,
    "json": Constraint.json_schema(LINES),
    "regex": Constraint("regex", r"([^\n]{0,80}\n){1000}"),
}


def run_variant(llm: Any, prompts: list[list[int]], output_len: int,
                constraint: Constraint | None) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            structured=constraint)
    outs, wall, base, m = timed_generate(llm, prompts, params)
    tokens = [o.outputs[0].token_ids for o in outs]
    pure = [r for r in llm.engine.rounds if not r.prefill_tokens]
    rounds = m["rounds"] - base["rounds"]
    accepted = m["accepted_tokens"] - base["accepted_tokens"]
    return {"output_tokens": sum(map(len, tokens)),
            "output_tokens_per_s": sum(map(len, tokens)) / wall,
            "decode_only_tokens_per_s": sum(r.new_tokens for r in pure)
            / max(1e-9, sum(r.wall_s for r in pure)),
            "mean_accepted_len": (accepted + rounds) / rounds if rounds else 1.0,
            # the share of the run's wall time spent computing grammar masks (host CPU)
            "mask_share_of_wall": (m["structured_mask_s"] - base["structured_mask_s"]) / wall,
            "grammar_ok": constraint is None or all(_follows(llm, constraint, t) for t in tokens)}


def _follows(llm: Any, constraint: Constraint, tokens: list[int]) -> bool:
    """Every generated token is one the grammar allows (the output is cut at max_tokens)."""
    tok = llm.tokenizer
    lltok = grammar_tokenizer(tok.to_json(), (tok.eos_token_id,), None)
    matcher = Matcher(lltok, compile_constraint(constraint, lltok), 1 << 20)
    return matcher.advance(tokens) == len(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="balanced,link-bound")
    ap.add_argument("--modes", default="offload-spec,specstream")
    ap.add_argument("--context-len", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--output-len", type=int, default=96,
                    help="tokens per request (link-bound: its own 64)")
    ap.add_argument("--random-prompts", action="store_true",
                    help="prompts of random token ids instead of held-out text")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    args = ap.parse_args()
    results: list[dict[str, Any]] = []
    for preset in args.presets.split(","):
        fields, preset_len = PRESETS[preset]
        settings = dataclasses.replace(BenchSettings(enable_prefix_caching=False), **fields)
        output_len = preset_len or args.output_len
        workload = Workload((args.context_len,) * args.requests, output_len)
        for mode in args.modes.split(","):
            llm = open_llm(mode, settings)
            try:
                vocab = llm.engine.model_config.vocab_size
                prompts = build_prompts(workload, None if args.random_prompts else llm.tokenizer,
                                        vocab, seed=settings.seed)
                runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
                names = list(VARIANTS)
                for rep in range(args.repeats):
                    passes = names[rep % len(names):] + names[: rep % len(names)]
                    one = {v: run_variant(llm, prompts, output_len, VARIANTS[v]) for v in passes}
                    for v in names:
                        if v != "free":
                            for key in ("output_tokens_per_s", "mean_accepted_len"):
                                one[v][f"{key}_over_free"] = one[v][key] / one["free"][key]
                        runs[v].append(one[v])
                        print(json.dumps({"preset": preset, "mode": mode, "variant": v,
                                          "repeat": rep, **one[v]}), flush=True)
            finally:
                llm.close()
            for v in names:
                row = {"preset": preset, "mode": mode, "variant": v, "runs": runs[v]}
                for key in runs[v][0]:
                    if isinstance(runs[v][0][key], float):
                        row[key] = statistics.median(r[key] for r in runs[v])
                row["grammar_ok"] = all(r["grammar_ok"] for r in runs[v])
                results.append(row)
    _table(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results},
                                              indent=1) + "\n")


def _table(results: list[dict[str, Any]]) -> None:
    cols = ["preset", "mode", "variant", "output_tokens_per_s", "decode_only_tokens_per_s",
            "mean_accepted_len", "output_tokens_per_s_over_free", "mean_accepted_len_over_free",
            "mask_share_of_wall", "grammar_ok"]
    rows = [[_fmt(r.get(c, "")) for c in cols] for r in results]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    print(" | ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in rows:
        print(" | ".join(v.ljust(w) for v, w in zip(row, widths)))


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
