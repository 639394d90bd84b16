"""The README's ablation ladder, predicted by the roofline round pipeline (``--ladder``).

Each step adds one mechanism to the one before, as the engine runs it:

1. ``offload-spec``, a q = 4 chain: restore layer by layer (the next layer prefetched), verify,
   then draft on the same stream;
2. + streaming: verification attends chunks as they land (``specstream`` with drafting
   ``sequential``: one group, drafts after verification);
3. + gap drafting: ``specstream`` (two groups; one's drafts fill the other's link gaps);
4. + adaptive chain: the depth chosen per round (``speculative_policy auto``, q <= 16);
5. + trees: auto over chains and top-4 token trees of <= 32 nodes, depth <= 8.

The adaptive steps choose a shape as the engine does: the engine's ``RoundShaper`` gives the
candidate shapes and the acceptance by rank (its prior a, a/4, a/16, a/64 for the model card's
a), and ``engine/policy/round_shape.choose`` picks one from a ``RoundCosts`` the pipeline's
roofline fills in (what the engine's running fits would converge to: verification as a line in query
positions, a draft forward as a line in tokens). The chosen shape is then run through the
round pipeline (``rounds.simulate_round``), whose tokens per round are the engine's
``expected_tokens``. Nothing here is measured on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from specstream.engine.policy.round_shape import RoundCosts, Shape, choose, expected_tokens
from specstream.engine.policy.shaping import RoundShaper
from specstream.sim.api import Scenario
from specstream.sim.memory import max_concurrency
from specstream.sim.pipeline import Batch
from specstream.sim.policy import STREAM_MODES
from specstream.sim.rounds import RoundResult, simulate_round


@dataclass(frozen=True)
class LadderStep:
    label: str
    mode: str  # the round pipeline's mode (or ablation)
    drafting: str  # how the engine runs its drafts: "sequential" or "gaps"
    max_depth: int  # the chain's q (fixed), or the deepest shape auto may choose
    topk: int = 1  # trees of this branching allowed when > 1
    max_nodes: int = 0  # a tree's node budget
    adaptive: bool = False  # speculative_policy auto: the shape chosen per round


LADDER = (
    LadderStep("offload-spec, q = 4 chain", "offload-spec", "sequential", 4),
    LadderStep("+ streaming", "specstream-sequential", "sequential", 4),
    LadderStep("+ drafting in the gaps", "specstream", "gaps", 4),
    LadderStep("+ adaptive chain (auto, q <= 16)", "specstream", "gaps", 16, adaptive=True),
    LadderStep("+ trees (auto, top-4, <= 32 nodes, depth <= 8)", "specstream", "gaps", 8,
               topk=4, max_nodes=32, adaptive=True),
)


@dataclass(frozen=True)
class LadderRow:
    step: LadderStep
    shape: Shape
    result: RoundResult

    @property
    def tokens_per_s(self) -> float:
        return self.result.tokens_per_s


def round_costs(sc: Scenario, mode: str, contexts: Sequence[float], groups: int) -> RoundCosts:
    """What the engine's running fits would read for one group's round of this batch: the
    group's link time, verification as a + b x query positions and a draft forward as
    c + d x tokens (secants of the roofline at 1 and 33 positions, 1 and 4 tokens)."""
    b = Batch(sc.costs, sc.policy, tuple(float(c) for c in contexts), 0, mode)
    group = b.groups(groups)[0]
    n = len(group)
    v1, v33 = b.verify_s(group), replace(b, q=32).verify_s(group)
    per_position = (v33 - v1) / (32 * n)
    d1 = replace(b, q=1).draft_step_s(group)
    d4 = replace(b, q=4, shape=Shape(1, topk=4, nodes=4)).draft_step_s(group)
    per_node = (d4 - d1) / (3 * n)
    return RoundCosts(link_s=b.link_s(group), verify_base_s=max(0.0, v1 - per_position * n),
                      verify_per_position_s=per_position,
                      draft_level_s=max(0.0, d1 - per_node * n), draft_per_node_s=per_node)


def run_step(sc: Scenario, step: LadderStep, contexts: Sequence[float], alpha: float) -> LadderRow:
    """One step of the ladder on a batch: its shape (fixed, or chosen by the engine's cost
    model) and the round the pipeline simulates with it."""
    shaper = RoundShaper(step.max_depth, step.drafting, max_topk=step.topk,
                         max_nodes=step.max_nodes, prior_acceptance=alpha)
    groups = sc.policy.groups if step.drafting == "gaps" else 1
    if step.adaptive:
        costs = round_costs(sc, step.mode, contexts, groups)
        n = len(Batch(sc.costs, sc.policy, tuple(contexts), 0, step.mode).groups(groups)[0])
        if sc.policy.host_attention == "auto" and step.mode in STREAM_MODES:
            shape = _choose_with_host(sc, step, contexts, groups, shaper, costs)
        else:
            shape = choose(shaper.candidates, n, costs, shaper.acceptance, step.drafting)
    else:
        shape = Shape(step.max_depth)
    result = simulate_round(step.mode, sc.costs, sc.policy, contexts, shape.num_nodes,
                            sc.acceptance, shape=shape, estimate=shaper.acceptance)
    return LadderRow(step, shape, result)


def _choose_with_host(sc: Scenario, step: LadderStep, contexts: Sequence[float], groups: int,
                      shaper: RoundShaper, costs: RoundCosts) -> Shape:
    """The shape and the split chosen together: every candidate's link time is the one its
    split leaves (more query positions per KV row lower the host's rate), or all on the link
    where that is faster (auto)."""
    b = Batch(sc.costs, sc.policy, tuple(float(c) for c in contexts), 0, step.mode, host=True)
    group = b.groups(groups)[0]
    n = len(group)

    def rate(s: Shape) -> tuple[float, int]:
        link = min(costs.link_s, replace(b, q=s.num_nodes, shape=s).link_s(group))
        t = replace(costs, link_s=link).round_s(s, n, step.drafting)
        tokens = n * expected_tokens(s, shaper.acceptance)
        return (tokens / t if t > 0 else float("inf"), -s.num_nodes)

    return max(shaper.candidates, key=rate)


def ladder_concurrency(sc: Scenario, limit: int = 32) -> int:
    """At most ``limit`` requests, as many as every step's memory plan admits."""
    ctx = float(max(sc.workload.context_lengths))
    fits = [max_concurrency(s.mode, sc.costs, sc.policy, ctx) for s in LADDER]
    return max(1, min([limit, *fits]))


def ladder(sc: Scenario, alpha: float, concurrency: int | None = None) -> list[LadderRow]:
    """Every step on ``concurrency`` requests of the scenario's (longest) context."""
    n = concurrency or ladder_concurrency(sc, sc.workload.concurrency or 32)
    contexts = [float(max(sc.workload.context_lengths))] * n
    return [run_step(sc, s, contexts, alpha) for s in LADDER]


def shape_label(s: Shape) -> str:
    if s.topk == 1:
        return f"chain {s.depth}"
    return f"tree {s.nodes} nodes, depth {s.depth}, top-{s.topk}"


def ladder_table(rows: Sequence[LadderRow]) -> str:
    head = ("| step | shape | tokens/round/request | round ms | link ms | verify + draft ms "
            "| link GB/round | tok/s | over first |\n|---|---|---|---|---|---|---|---|---|")
    first = rows[0].tokens_per_s if rows else 0.0
    lines = [head]
    for r in rows:
        x = r.result
        lines.append(
            f"| {r.step.label} | {shape_label(r.shape)} | {x.tokens_per_round:.2f} "
            f"| {x.period_s * 1e3:.1f} | {x.link_s * 1e3:.1f} "
            f"| {(x.verify_s + x.draft_s) * 1e3:.1f} | {x.link_bytes / 1e9:.1f} "
            f"| {x.tokens_per_s:.1f} | {x.tokens_per_s / first if first else 0:.2f}x |")
    return "\n".join(lines)


# The grid of docs/simulator.md: (hardware, PCIe generation, target, draft, assumed alpha)
GRID = (
    ("H200", 5, "Qwen3-8B", "Qwen3-0.6B", 0.75),
    ("H200", 5, "Qwen3-32B", "Qwen3-1.7B", 0.75),
    ("H200", 5, "InternLM2.5-7B", "InternLM2.5-1.8B", 0.70),
    ("A100-80GB", 4, "Qwen3-8B", "Qwen3-0.6B", 0.75),
    ("A100-80GB", 4, "Qwen3-32B", "Qwen3-1.7B", 0.75),
    ("A100-80GB", 4, "InternLM2.5-7B", "InternLM2.5-1.8B", 0.70),
)


def ladder_grid(context: int = 32768, limit: int = 32) -> str:
    """The ladder for every setting of ``GRID`` at ``context`` tokens."""
    out = []
    for hw, pcie, target, draft, alpha in GRID:
        sc = Scenario.from_names(hw, target, draft, (context,), limit, alpha, pcie_gen=pcie)
        n = ladder_concurrency(sc, limit)
        out.append(f"**{sc.label}**, {n} x {context} tokens, alpha {alpha}, "
                   f"residency {sc.policy.residency}\n")
        out.append(ladder_table(ladder(sc, alpha, n)) + "\n")
    return "\n".join(out)
