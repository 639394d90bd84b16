"""``specstream bench --ladder``: the ablation ladder, one step at a time, side by side.

From the offloading baseline to the full engine, each step adds one thing:

1. ``offload-spec`` with a q = 4 chain: whole-layer restore, the next layer prefetched, drafting
   after verification;
2. + streaming: the same rounds with history in chunk waves (``specstream`` drafting
   sequentially, one group);
3. + drafting in the gaps: two groups, one drafting while the other's history streams
   (``specstream``, q = 4);
4. + adaptive chain: ``speculative_policy="auto"`` picks each round's depth, up to 16;
5. + trees: the policy may also verify token trees (top-4 children, up to 32 nodes, 8 deep).

Every step decodes the same workload with the same seeds and must give the resident
reference's greedy outputs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from specstream.bench.runner import BenchSettings, run_compared, run_reference
from specstream.bench.workload import Workload


@dataclass(frozen=True)
class Step:
    name: str
    mode: str
    num_speculative_tokens: int = 4
    speculative_policy: str = "fixed"
    speculative_topk: int = 1
    speculative_num_draft_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def settings(self, base: BenchSettings) -> BenchSettings:
        s = copy.copy(base)
        s.num_speculative_tokens = self.num_speculative_tokens
        s.speculative_policy = self.speculative_policy
        s.speculative_topk = self.speculative_topk
        s.speculative_num_draft_tokens = self.speculative_num_draft_tokens
        s.extra = {**base.extra, **self.extra}
        return s


LADDER = (
    Step("offload-spec, q = 4 chain", "offload-spec"),
    Step("+ streaming", "specstream", extra={"drafting": "sequential"}),
    Step("+ drafting in the gaps", "specstream"),
    Step("+ adaptive chain (auto, q <= 16)", "specstream", num_speculative_tokens=16,
         speculative_policy="auto"),
    Step("+ trees (auto, top-4, <= 32 nodes, depth <= 8)", "specstream",
         num_speculative_tokens=8, speculative_policy="auto", speculative_topk=4,
         speculative_num_draft_tokens=32),
)

COLUMNS = ("step", "output_tokens_per_s", "decode_only_tokens_per_s", "mean_accepted_len",
           "mean_tree_nodes_per_round", "link_bytes_per_round", "link_utilization",
           "over_first", "outputs_match_reference")


def run_ladder(s: BenchSettings, workload: Workload,
               steps: tuple[Step, ...] = LADDER) -> dict[str, Any]:
    """Every step on the workload (resident first: the exactness reference and the floors'
    compute model); prints a table as it goes."""
    print("[ladder] resident (reference) ...", flush=True)
    _, ref = run_reference(workload, s)
    rows: list[dict[str, Any]] = []
    for step in steps:
        print(f"[ladder] {step.name} ...", flush=True)
        res = run_compared(step.mode, workload, step.settings(s), ref)
        row = {"step": step.name, **{k: v for k, v in res.items()
                                     if k not in ("rounds", "prefill_steps")}}
        row["over_first"] = row["output_tokens_per_s"] / (rows[0]["output_tokens_per_s"]
                                                          if rows else row["output_tokens_per_s"])
        rows.append(row)
        print(f"[ladder]   {row['output_tokens_per_s']:.1f} tok/s ({row['over_first']:.2f}x "
              f"the first step), mean accepted {row['mean_accepted_len']:.2f}, outputs match: "
              f"{row['outputs_match_reference']}", flush=True)
    print(format_ladder(rows))
    first = rows[0]
    return {"ladder": rows, "ratios": {
        "last_over_first": rows[-1]["output_tokens_per_s"] / first["output_tokens_per_s"],
        "accepted_last_over_first": rows[-1]["mean_accepted_len"] / first["mean_accepted_len"],
    }}


def format_ladder(rows: list[dict[str, Any]]) -> str:
    def cell(k: str, v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if k == "link_bytes_per_round" else f"{v:.2f}"
        return str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(k, r.get(k, "")) for k in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)
