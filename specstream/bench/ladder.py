"""``specstream bench --ladder``: the ablation ladder, one step at a time, side by side.

From the offloading baseline to the full engine, each step adds one thing:

1. ``offload-spec`` with a q = 4 chain: whole-layer restore, the next layer prefetched, drafting
   after verification;
2. + streaming: the same rounds with history in chunk waves (``specstream`` drafting
   sequentially, one group);
3. + drafting in the gaps: two groups, one drafting while the other's history streams
   (``specstream``, q = 4);
4. + adaptive chain: ``speculative_policy="auto"`` picks each round's depth, up to 16;
5. + trees: the policy may also verify token trees (top-4 children, up to 32 nodes, 8 deep);
6. the default: ``specstream`` with no option given (the policy's limits, host attention where
   the host has cores to spare, groups that merge where the link hides nothing);

and a control: ``offload-spec`` given the same defaults (policy, trees, host attention), so
what streaming and the gaps add on their own shows beside what the policy adds. Steps 1-5 keep
host attention off. Every step decodes the same workload with the same seeds and must give the
resident reference's greedy outputs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from specstream.bench.runner import BenchSettings, run_compared, run_reference
from specstream.bench.workload import Workload


@dataclass(frozen=True)
class Step:
    """One rung; None: the engine's default for that option (EngineConfig)."""

    name: str
    mode: str
    num_speculative_tokens: int | None = 4
    speculative_policy: str | None = "fixed"
    speculative_topk: int | None = 1
    speculative_num_draft_tokens: int | None = None
    host_attention: str | None = "off"
    extra: dict[str, Any] = field(default_factory=dict)

    def settings(self, base: BenchSettings) -> BenchSettings:
        s = copy.copy(base)
        s.num_speculative_tokens = self.num_speculative_tokens
        s.speculative_policy = self.speculative_policy
        s.speculative_topk = self.speculative_topk
        s.speculative_num_draft_tokens = self.speculative_num_draft_tokens
        s.host_attention = self.host_attention
        s.extra = {**base.extra, **self.extra}
        return s


DEFAULTS: dict[str, Any] = dict(num_speculative_tokens=None, speculative_policy=None,
                                speculative_topk=None, host_attention=None)
LADDER = (
    Step("offload-spec, q = 4 chain", "offload-spec"),
    Step("+ streaming", "specstream", extra={"drafting": "sequential"}),
    Step("+ drafting in the gaps", "specstream"),
    Step("+ adaptive chain (auto, q <= 16)", "specstream", num_speculative_tokens=16,
         speculative_policy="auto"),
    Step("+ trees (auto, top-4, <= 32 nodes, depth <= 8)", "specstream",
         num_speculative_tokens=8, speculative_policy="auto", speculative_topk=4,
         speculative_num_draft_tokens=32),
    Step("the default (specstream, no options)", "specstream", **DEFAULTS),
    Step("control: offload-spec, the default's options", "offload-spec", **DEFAULTS),
)
# the rows the ratios compare: the first step, the default, the control
FIRST, DEFAULT, CONTROL = 0, 5, 6

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
    return {"ladder": rows, "ratios": ladder_ratios(rows, steps)}


def ladder_ratios(rows: list[dict[str, Any]], steps: tuple[Step, ...]) -> dict[str, float]:
    """Throughput and accepted tokens per round: the default over the first step (offload-spec
    with a q = 4 chain) and over the control (offload-spec with the default's options); the
    last step over the first where the ladder is another one."""
    def over(a: int, b: int, key: str) -> float:
        return float(rows[a][key] / rows[b][key]) if rows[b][key] else float("nan")

    if steps is not LADDER:
        return {"last_over_first": over(-1, 0, "output_tokens_per_s"),
                "accepted_last_over_first": over(-1, 0, "mean_accepted_len")}
    return {"default_over_first": over(DEFAULT, FIRST, "output_tokens_per_s"),
            "accepted_default_over_first": over(DEFAULT, FIRST, "mean_accepted_len"),
            "default_over_control": over(DEFAULT, CONTROL, "output_tokens_per_s"),
            "accepted_default_over_control": over(DEFAULT, CONTROL, "mean_accepted_len"),
            "decode_only_default_over_first": over(DEFAULT, FIRST, "decode_only_tokens_per_s")}


def format_ladder(rows: list[dict[str, Any]]) -> str:
    def cell(k: str, v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if k == "link_bytes_per_round" else f"{v:.2f}"
        return str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(k, r.get(k, "")) for k in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)
