"""Host attention against streaming alone, side by side in one process (issue 22).

    python bench/host_attention.py

The link-bound preset (`specstream bench --preset link-bound`: the bench workload, 8 x 4K
prompts, 64 greedy tokens, residency tail over a 0.1 GB/s link, four staging slots), for
`specstream` and `offload-spec`, host_attention off and auto, and `resident` (the whole
workload on the device) for the compute floor. Prints output tokens/s end to end and over
decode-only rounds, and for the auto runs the round time against two aims over the same
decode-only rounds:

- ``aim``: the round's cold bytes (streamed + attended on the host) / (link rate + the host
  attention rate measured in the same run), the issue's target (within 1.2x);
- ``floor``: max(aim, the same round's compute with its history on the device), compute
  fitted on the resident run's rounds (specstream.bench.floors): a round cannot beat its
  compute, and once the host takes most of the history the round is compute-bound here.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from specstream import LLM, SamplingParams
from specstream.bench.cli import PRESETS, WORKLOAD
from specstream.bench.floors import ComputeModel
from specstream.bench.runner import BenchSettings, resident_fit_bytes, timed_generate
from specstream.bench.workload import Workload, build_prompts


def run(mode: str, host: str, w: Workload, s: BenchSettings) -> dict[str, Any]:
    kw = s.engine_kwargs(mode)
    if mode == "resident":
        kw["device_kv_bytes"] = resident_fit_bytes(w, s)
    else:
        kw["host_attention"] = host
    llm = LLM(None, **kw)
    prompts = build_prompts(w, llm.tokenizer, llm.engine.model_config.vocab_size, seed=s.seed)
    params = SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True)
    outs, wall, base, m = timed_generate(llm, prompts, params)
    rounds = [asdict(r) for r in llm.engine.rounds]
    llm.close()
    pure = [r for r in rounds if not r["prefill_tokens"]]
    decode_s = sum(r["wall_s"] for r in pure)
    return {"mode": mode, "host_attention": host if mode != "resident" else "off",
            "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
            "decode_only_tokens_per_s": sum(r["new_tokens"] for r in pure) / max(1e-9, decode_s),
            "mean_round_s": decode_s / max(1, len(pure)),
            "mean_accepted_len": m["mean_accepted_len"],
            "host_attention_share": m["host_attention_share"],
            "outputs": [o.outputs[0].token_ids for o in outs], "rounds": rounds}


def aims(row: dict[str, Any], link_bps: float, model: ComputeModel) -> None:
    """The auto run's decode-only rounds against cold bytes / (link + host rate) and against
    max(that, their compute)."""
    pure = [r for r in row["rounds"] if not r["prefill_tokens"] and r["num_seqs"]]
    busy = sum(r["host_busy_s"] for r in pure)
    host_bps = sum(r["host_bytes"] for r in pure) / busy if busy else 0.0
    wall = aim = floor = cold = 0.0
    for r in pure:
        c = r["history_bytes"] + r["host_bytes"]
        a = c / (link_bps + host_bps)
        wall, aim, cold = wall + r["wall_s"], aim + a, cold + c
        floor += max(a, sum(model.parts(r)))
    row.update(link_bytes_per_s=link_bps, host_attention_bytes_per_s=host_bps,
               cold_bytes_per_round=cold / max(1, len(pure)),
               round_aim_s=aim / max(1, len(pure)), round_floor_s=floor / max(1, len(pure)),
               round_over_aim=wall / aim if aim else 0.0,
               round_over_floor=wall / floor if floor else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--link-gbps", type=float, default=PRESETS["link-bound"]["link_gbps"])
    ap.add_argument("--modes", default="specstream,offload-spec")
    ap.add_argument("--context-len", type=int, default=WORKLOAD[0])
    ap.add_argument("--num-requests", type=int, default=WORKLOAD[1])
    ap.add_argument("--output-len", type=int, default=PRESETS["link-bound"]["output_len"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    preset = {k: v for k, v in PRESETS["link-bound"].items() if k != "output_len"}
    s = BenchSettings(**{**preset, "link_gbps": args.link_gbps})
    w = Workload((args.context_len,) * args.num_requests, args.output_len)
    reference = run("resident", "off", w, s)
    model = ComputeModel.fit([r for r in reference["rounds"]])
    print(f"resident                {reference['output_tokens_per_s']:6.1f} tok/s end to end, "
          f"{reference['decode_only_tokens_per_s']:6.1f} decode-only; compute model fit error "
          f"{model.fit_error:.2f}", flush=True)
    rows: list[dict[str, Any]] = []
    for mode in args.modes.split(","):
        for host in ("off", "auto"):
            row = run(mode, host, w, s)
            line = (f"{mode:13s} host {host:4s} {row['output_tokens_per_s']:6.1f} tok/s end to "
                    f"end, {row['decode_only_tokens_per_s']:6.1f} decode-only, round "
                    f"{row['mean_round_s'] * 1e3:6.1f} ms")
            if host == "auto":
                aims(row, s.link_gbps * 1e9, model)
                line += (f" (aim {row['round_aim_s'] * 1e3:.1f}: x{row['round_over_aim']:.2f};"
                         f" floor {row['round_floor_s'] * 1e3:.1f}: "
                         f"x{row['round_over_floor']:.2f}), host "
                         f"{row['host_attention_bytes_per_s'] / 1e9:.2f} GB/s, share "
                         f"{row['host_attention_share']:.2f}")
            print(line, flush=True)
            rows.append(row)
    for mode in args.modes.split(","):
        off, on = (r for r in rows if r["mode"] == mode)
        print(f"{mode}: auto / off {on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f} "
              f"end to end, {on['decode_only_tokens_per_s'] / off['decode_only_tokens_per_s']:.2f}"
              f" decode-only; outputs equal to resident: off "
              f"{off['outputs'] == reference['outputs']}, auto "
              f"{on['outputs'] == reference['outputs']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"link_gbps": args.link_gbps, "workload": [args.context_len,
                       args.num_requests, args.output_len], "settings": preset,
                       "reference": {k: v for k, v in reference.items() if k != "rounds"},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
