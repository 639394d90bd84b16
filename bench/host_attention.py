"""Host attention against streaming alone, side by side in one process (issue 22).

    python bench/host_attention.py

The link-bound preset (`specstream bench --preset link-bound`: the bench workload, 8 x 4K
prompts, 64 greedy tokens, residency tail over a 0.1 GB/s link, four staging slots), for
`specstream` and `offload-spec`, host_attention off and auto (at this machine's host rate and
at an emulated one, ``--host-gbps``: by default 0.8 GB/s, eight times the link, about a real
server's ratio), and `resident` (the whole workload on the device) as the outputs' reference.
Prints output tokens/s end to end and over decode-only steps, and for the auto runs, over the
decode-only rounds that verify, the mean round time against the issue's aim: the round's cold
bytes (streamed + attended on the host) / (link rate + the host attention rate measured over
the same rounds); and where the rest of the round goes: the link's busy time, the host's
(its busy time plus the device time it had no job, ``serial``, the queries of a layer coming
only after its projection), and what the device computed (wall less its waits for link and
host). The best this round schedule can do is max(link, host + serial) + the compute after
the last layer; on this machine's host rate the round is compute-bound instead.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from specstream import LLM, SamplingParams
from specstream.bench.cli import PRESETS, WORKLOAD
from specstream.bench.runner import BenchSettings, resident_fit_bytes, timed_generate
from specstream.bench.workload import Workload, build_prompts


def run(mode: str, host: str, w: Workload, s: BenchSettings,
        host_gbps: float | None = None) -> dict[str, Any]:
    kw = s.engine_kwargs(mode)
    if mode == "resident":
        kw["device_kv_bytes"] = resident_fit_bytes(w, s)
    else:
        kw.update(host_attention=host, host_attention_gbps=host_gbps)
    llm = LLM(None, **kw)
    prompts = build_prompts(w, llm.tokenizer, llm.engine.model_config.vocab_size, seed=s.seed)
    params = SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True)
    outs, wall, base, m = timed_generate(llm, prompts, params)
    rounds = [asdict(r) for r in llm.engine.rounds]
    llm.close()
    pure = [r for r in rounds if not r["prefill_tokens"]]
    decode_s = sum(r["wall_s"] for r in pure)
    return {"mode": mode, "host_attention": host if mode != "resident" else "off",
            "host_attention_gbps": host_gbps,
            "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
            "decode_only_tokens_per_s": sum(r["new_tokens"] for r in pure) / max(1e-9, decode_s),
            "mean_round_s": decode_s / max(1, len(pure)),
            "mean_accepted_len": m["mean_accepted_len"],
            "host_attention_share": m["host_attention_share"],
            "outputs": [o.outputs[0].token_ids for o in outs], "rounds": rounds}


def aims(row: dict[str, Any], link_bps: float) -> None:
    """The auto run's decode-only rounds that verify: mean round time, the aim cold bytes /
    (link + host rate), and the round's parts."""
    pure = [r for r in row["rounds"] if not r["prefill_tokens"] and r["num_seqs"]]
    n = max(1, len(pure))
    busy = sum(r["host_busy_s"] for r in pure)
    host_bps = sum(r["host_bytes"] for r in pure) / busy if busy else 0.0
    wall = sum(r["wall_s"] for r in pure)
    cold = sum(r["history_bytes"] + r["host_bytes"] for r in pure)
    aim = cold / (link_bps + host_bps)

    def mean(key: str) -> float:
        return sum(r[key] for r in pure) / n

    row.update(link_bytes_per_s=link_bps, host_attention_bytes_per_s=host_bps,
               verify_rounds=len(pure), cold_bytes_per_round=cold / n, round_s=wall / n,
               round_aim_s=aim / n, round_over_aim=wall / aim if aim else 0.0,
               link_busy_s=mean("link_s"), host_busy_s=mean("host_busy_s"),
               host_serial_s=mean("host_serial_s"),
               device_s=mean("wall_s") - mean("wait_s") - mean("host_wait_s"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--link-gbps", type=float, default=PRESETS["link-bound"]["link_gbps"])
    ap.add_argument("--modes", default="specstream,offload-spec")
    ap.add_argument("--context-len", type=int, default=WORKLOAD[0])
    ap.add_argument("--num-requests", type=int, default=WORKLOAD[1])
    ap.add_argument("--output-len", type=int, default=PRESETS["link-bound"]["output_len"])
    ap.add_argument("--host-gbps", default="none,0.8",
                    help="host attention rates of the auto runs: none (this machine's) and/or "
                         "emulated GB/s (0.8: eight times the link, as ~400 GB/s of host "
                         "attention against PCIe 5's ~50)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    preset = {k: v for k, v in PRESETS["link-bound"].items() if k != "output_len"}
    s = BenchSettings(**{**preset, "link_gbps": args.link_gbps})
    w = Workload((args.context_len,) * args.num_requests, args.output_len)
    reference = run("resident", "off", w, s)
    print(f"resident                {reference['output_tokens_per_s']:6.1f} tok/s end to end, "
          f"{reference['decode_only_tokens_per_s']:6.1f} decode-only", flush=True)
    rows: list[dict[str, Any]] = []
    rates = [None if g == "none" else float(g) for g in args.host_gbps.split(",")]
    for mode in args.modes.split(","):
        for host, gbps in [("off", None)] + [("auto", g) for g in rates]:
            row = run(mode, host, w, s, gbps)
            name = host if gbps is None else f"{host} at {gbps:g} GB/s"
            line = (f"{mode:13s} host {name:16s} {row['output_tokens_per_s']:6.1f} tok/s end "
                    f"to end, {row['decode_only_tokens_per_s']:6.1f} decode-only, round "
                    f"{row['mean_round_s'] * 1e3:6.1f} ms")
            if host == "auto":
                aims(row, s.link_gbps * 1e9)
                line += (f"\n    {row['verify_rounds']} rounds: {row['round_s'] * 1e3:.1f} ms "
                         f"against the aim {row['round_aim_s'] * 1e3:.1f} "
                         f"(x{row['round_over_aim']:.2f}; {row['cold_bytes_per_round'] / 1e6:.1f}"
                         f" MB of cold history, host {row['host_attention_bytes_per_s'] / 1e9:.2f}"
                         f" GB/s, share {row['host_attention_share']:.2f}); link busy "
                         f"{row['link_busy_s'] * 1e3:.1f} ms, host busy "
                         f"{row['host_busy_s'] * 1e3:.1f} + serial "
                         f"{row['host_serial_s'] * 1e3:.1f} ms, device "
                         f"{row['device_s'] * 1e3:.1f} ms")
            print(line, flush=True)
            rows.append(row)
    for mode in args.modes.split(","):
        off, *ons = (r for r in rows if r["mode"] == mode)
        for on in ons:
            g = on["host_attention_gbps"]
            print(f"{mode}: auto{'' if g is None else f' at {g:g} GB/s'} / off "
                  f"{on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f} end to end, "
                  f"{on['decode_only_tokens_per_s'] / off['decode_only_tokens_per_s']:.2f} "
                  f"decode-only; outputs equal to resident: off "
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
