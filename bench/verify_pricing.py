"""`resident` with speculative_policy auto against a fixed q = 4 chain, on two checkouts side by
side (issue 30, item 4: verification priced per request and per query position).

    python bench/verify_pricing.py NEW_CHECKOUT OLD_CHECKOUT [--repeats 2] [--out FILE.jsonl]

Workloads: 8 x 4K prompts (long context: a round's cost is its requests' history reads, so a
line over query positions alone turned speculation off) and 4 x 1K (short: no speculation is
about best on one CPU thread, so a policy that drafts too eagerly loses). Per repeat and
workload, interleaved: each checkout with fixed q = 4 and with auto over chains up to 4, and
the new checkout's defaults. 128 greedy tokens a request, `resident` on a 300 MB budget (the
whole workload on the device), no link. One JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

RUN = """
import json, sys
from specstream.bench.runner import BenchSettings, run_mode
from specstream.bench.workload import Workload
label, policy, wl, extra = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
n, ctx = map(int, wl.split("x"))
s = BenchSettings(device_kv_bytes=int(3e8), link_gbps=None, speculative_policy=policy, **extra)
res = run_mode("resident", Workload((ctx,) * n, 128), s)[0]
print(json.dumps({"label": label, "policy": policy, "workload": wl, **extra,
                  "tok_s": res["output_tokens_per_s"],
                  "decode_only": res.get("decode_only_tokens_per_s"),
                  "accepted": res["mean_accepted_len"],
                  "chosen": res.get("speculative_depth_chosen")}))
"""
CHAIN4 = {"num_speculative_tokens": 4, "speculative_topk": 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("new")
    ap.add_argument("old")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = [(args.new, "new", "fixed", CHAIN4), (args.old, "old", "fixed", CHAIN4),
            (args.new, "new", "auto", CHAIN4), (args.old, "old", "auto", CHAIN4),
            (args.new, "new-default", "auto", {})]
    out = open(args.out, "w") if args.out else sys.stdout
    for _ in range(args.repeats):
        for wl in ("8x4096", "4x1024"):
            for checkout, label, policy, extra in runs:
                env = {**os.environ, "PYTHONPATH": checkout}
                line = subprocess.run(
                    [sys.executable, "-c", RUN, label, policy, wl, json.dumps(extra)], env=env,
                    check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
                print(line, file=out, flush=True)


if __name__ == "__main__":
    main()
