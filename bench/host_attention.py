"""Host attention against streaming alone, side by side in one process (issue 22).

    python bench/host_attention.py --link-gbps 0.1

The embedded pair, 4 requests x 2K prompts, 48 greedy tokens, residency tail (so nearly all
history is cold), for `specstream` and `offload-spec`: host_attention off and auto. Prints
output tokens/s end to end and over decode-only rounds, the link rate and the host attention
rate measured in the run, the share the host took, and cold bytes per round over (link rate +
host rate), the round time the split aims at.
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
    ap.add_argument("--link-gbps", type=float, default=0.1)
    ap.add_argument("--modes", default="specstream,offload-spec")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    w = Workload((2048,) * 4, 48)
    params = SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    for mode in args.modes.split(","):
        for host in ("off", "auto"):
            llm = LLM(None, mode=mode, block_size=128, device_kv_bytes=24 << 20,
                      link_gbps=args.link_gbps, residency="tail", resident_tail_tokens=256,
                      offload_after_tokens=512, staging_buffers=2, wave_requests=2,
                      proposer="draft", draft_model=str(default_model_dir("draft")),
                      host_attention=host)
            prompts = build_prompts(w, llm.tokenizer, llm.engine.model_config.vocab_size,
                                    seed=0)
            outs, wall, base, m = timed_generate(llm, prompts, params)
            pure = [r for r in llm.engine.rounds if not r.prefill_tokens]
            decode_s = sum(r.wall_s for r in pure)
            link_bps = args.link_gbps * 1e9
            host_bps = m["host_attention_bytes_per_s"]
            # cold bytes per verification round of the measured run: streamed + host-attended
            rounds = max(1, m["verify_steps"] - base["verify_steps"])
            cold = (m["decode_history_bytes"] - base["decode_history_bytes"]
                    + m["host_attention_bytes"] - base["host_attention_bytes"]) / rounds
            row = {"mode": mode, "host_attention": host,
                   "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
                   "decode_only_tokens_per_s": sum(r.new_tokens for r in pure)
                   / max(1e-9, decode_s),
                   "mean_round_s": decode_s / max(1, len(pure)),
                   "link_bytes_per_s": link_bps, "host_attention_bytes_per_s": host_bps,
                   "host_attention_share": m["host_attention_share"],
                   "cold_bytes_per_round": cold,
                   "round_aim_s": cold / (link_bps + host_bps),
                   "mean_accepted_len": m["mean_accepted_len"],
                   "outputs": [o.outputs[0].token_ids for o in outs]}
            rows.append(row)
            print(f"{mode:13s} host {host:4s} {row['output_tokens_per_s']:6.1f} tok/s end to end, "
                  f"{row['decode_only_tokens_per_s']:6.1f} decode-only, round "
                  f"{row['mean_round_s'] * 1e3:6.1f} ms (aim {row['round_aim_s'] * 1e3:6.1f}), "
                  f"host {host_bps / 1e9:5.2f} GB/s, share {row['host_attention_share']:.2f}",
                  flush=True)
            llm.close()
    for mode in args.modes.split(","):
        off, on = (r for r in rows if r["mode"] == mode)
        print(f"{mode}: auto / off {on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f} "
              f"end to end, {on['decode_only_tokens_per_s'] / off['decode_only_tokens_per_s']:.2f}"
              f" decode-only; outputs equal: {on['outputs'] == off['outputs']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"link_gbps": args.link_gbps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
