"""speculative_policy auto against fixed chains (and no speculation), one mode, side by side.

    python bench/auto_vs_fixed.py resident
    python bench/auto_vs_fixed.py specstream --link-gbps 0.25 --residency tail

The embedded pair, 4 requests x 1024-token prompts, 96 greedy tokens each. Prints, per
configuration, output tokens/s end to end and over decode-only rounds, the mean accepted
length and the depths the policy chose. The auto policy must come within a few percent of
the best fixed choice wherever that is (no speculation in `resident` on one CPU thread, long
chains where the link dominates).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from specstream import LLM, SamplingParams
from specstream.bench.runner import timed_generate
from specstream.bench.workload import Workload, build_prompts
from specstream.llm import default_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode")
    ap.add_argument("--link-gbps", type=float, default=None)
    ap.add_argument("--residency", default="fill")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the configurations this many times, one round after another")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    w = Workload((1024,) * 4, 96)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    if args.mode == "resident":
        kv: dict[str, Any] = dict(device_kv_bytes=64 << 20)
        configs: list[tuple[str, dict[str, Any]]] = [("no speculation", {})]
    else:
        kv = dict(device_kv_bytes=24 << 20, link_gbps=args.link_gbps, residency=args.residency,
                  resident_tail_tokens=256, offload_after_tokens=512, staging_buffers=2,
                  wave_requests=2)
        configs = []
    draft = dict(proposer="draft", draft_model=str(default_model_dir("draft")))
    configs += [(f"fixed q={q}", dict(draft, num_speculative_tokens=q, speculative_policy="fixed"))
                for q in (2, 4, 8)]
    configs.append(("auto, q <= 8", dict(draft, num_speculative_tokens=8,
                                         speculative_policy="auto")))
    rows = []
    for name, extra in configs * args.repeat:
        llm = LLM(None, mode=args.mode, block_size=128, **kv, **extra)
        prompts = build_prompts(w, llm.tokenizer, llm.engine.model_config.vocab_size, seed=0)
        outs, wall, _, m = timed_generate(llm, prompts, params)
        pure = [r for r in llm.engine.rounds if not r.prefill_tokens]
        row = {"config": name,
               "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
               "decode_only_tokens_per_s": sum(r.new_tokens for r in pure)
               / max(1e-9, sum(r.wall_s for r in pure)),
               "mean_accepted_len": m["mean_accepted_len"],
               "depth_chosen": m["speculative_depth_chosen"]}
        rows.append(row)
        print(f"{args.mode} {name:15s} {row['output_tokens_per_s']:6.1f} tok/s end to end, "
              f"{row['decode_only_tokens_per_s']:6.1f} decode-only, mean accepted "
              f"{row['mean_accepted_len']:.2f}, depths chosen {row['depth_chosen']}",
              flush=True)
        llm.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": args.mode, "link_gbps": args.link_gbps, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
