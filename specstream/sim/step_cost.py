"""What one engine step costs: its compute, fitted on a bench run's measured steps, and its wait
on the link, from the step's bytes and the way the mode moves history.

Compute (``fit_modes``): non-negative least squares of each measured step's compute time
(wall minus time blocked on the link) on what the step held, the columns of ``FEATURES``, the
target's columns shared by every mode of the run:

- a constant (launches, the Python of a step, the sampler);
- query tokens (the target's linear layers over prefill chunks, last tokens and drafts);
- attention pairs (query x key positions: a prefill chunk's is quadratic) and context tokens
  (the KV every request's queries read);
- sequences in the target forward (per-request work: metadata, sampling, acceptance);
- draft tokens, drafting sequences and the tokens the draft caught up on before drafting (its
  forwards), kept apart as the ``draft part``.

The fit minimises relative, not absolute, errors (``weighted_nnls``: weights 1 / the fitted
step time, iterated to convergence; a Gamma quasi-likelihood, the right one when a step's noise
is a share of its time, as a loaded machine's is). A run's steps span two orders of magnitude: a
step carrying a 1024-token prefill chunk takes 0.3-0.6 s, a decode round 10-30 ms. An absolute
fit is set by the former: a few % of their time is the whole of a decode round, so the
constant, per-request and draft columns, which are what a decode round is made of, took up
the prefill steps' residuals (sim-calib-B's specstream: 11.6 ms per drafting request where its
decode rounds say ~0.9 ms per draft token) and mispredicted another run's decode rounds by up
to 50-70%. Throughput is set by the big steps, TPOT (after the first token) by the decode rounds,
so the relative fit is what both need (``bench/floors.py`` fits its compute model on relative
errors too). A parallel mode's draft columns, fitted on the draft thread's own time, stay an
absolute fit (relative weights change them by under 2% on the committed runs).

Link wait (``StepCost.wait_s``), not fitted: the engine moves a step's history in ``units``
pieces that compute can overlap one after another: ``restore`` modes one layer at a time with
the next layer prefetched (units = layers), ``stream`` modes one chunk wave at a time through a
staging ring (units = layers x waves per layer), restore-all-then-verify in one piece. The first
piece is never hidden; each later one hides behind the compute of the piece before it:
``wait = r + (units - 1) x max(0, r - c)`` with ``r = link / units`` and ``c`` the target
compute (the draft part excluded) over ``units``. On the bench runs behind docs/simulator.md
this puts the measured waits within ~20% without a fitted parameter.

Drafting on a second worker (``parallel``, parallel-spec): the draft job runs on its own thread
while the step verifies. On the CPU backend that thread is in the same process as the target's
forward, and a small model's forward is mostly Python dispatch under the interpreter lock, so
the draft does not overlap the target's compute: it overlaps the time the target thread sleeps
waiting for history on the link. The step then pays ``max(0, draft - wait)`` of the draft on top
of the target's compute and wait (``StepCost.concurrent_draft``), and the measured steps say so
(``RoundStats.draft_s`` is the thread's own duration): on sim-calib-A, where the link rarely
waits, the target thread's compute grows by ~0.8x the draft's time; on sim-calib-B, where it
waits 20-70 ms, drafts of ~10 ms add little. The draft coefficients of such a mode are fitted on
``draft_s``, the target's on ``compute_s`` less that exposed part. (A real second GPU would
give ``max(target + wait, draft)``; the datacenter pipeline models that, ``pipeline.py``.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from specstream.config import MODES
from specstream.engine.contract import StepOutput, StepPlan
from specstream.sim.calibrate import nnls

FEATURES = ("const_s", "per_query_token_s", "per_attention_pair_s", "per_context_token_s",
            "per_seq_s", "per_draft_token_s", "per_draft_seq_s", "per_draft_fed_token_s",
            "per_draft_level_s")
DRAFT_COLUMNS = (5, 6, 7, 8)  # the draft part of a step's compute
SHARED = (1, 2, 3, 4)  # the target's forward: the same in every mode (``fit_modes``)


@dataclass(frozen=True)
class StepFeatures:
    """What a step held (the fields of the engine's ``RoundStats`` the cost model reads)."""

    query_tokens: float
    attention_pairs: float
    context_tokens: float
    num_seqs: float
    draft_tokens: float
    draft_seqs: float
    history_bytes: float = 0.0  # host-to-device history the step needs
    units: int = 0  # pieces the history moves in (module docstring)
    writeback_bytes: float = 0.0  # device-to-host copies made right after the step (prefill)
    prefill_tokens: float = 0.0
    draft_fed_tokens: float = 0.0  # tokens the draft caught up on before drafting
    draft_levels: float = 0.0  # the draft's forwards in the step: its deepest draft's depth

    def row(self) -> list[float]:
        return [1.0, self.query_tokens, self.attention_pairs, self.context_tokens,
                self.num_seqs, self.draft_tokens, self.draft_seqs, self.draft_fed_tokens,
                self.draft_levels]

    @classmethod
    def of_record(cls, r: dict[str, Any]) -> StepFeatures:
        """A measured step of a bench JSON (``modes[*].rounds`` or ``prefill_steps``)."""
        q, ctx = float(r["query_tokens"]), float(r["context_tokens"])
        pairs = r.get("attention_pairs")
        if pairs is None:  # files from before the field: one query block over the context
            pairs = q * ctx / max(1.0, float(r["num_seqs"]))
        tokens, seqs = float(r.get("draft_tokens", 0)), float(r.get("draft_seqs", 0))
        # files from before the field: chains of one depth a step
        levels = r.get("draft_levels", math.ceil(tokens / seqs) if seqs else 0)
        return cls(q, float(pairs), ctx, float(r["num_seqs"]), tokens, seqs,
                   float(r.get("history_bytes", 0)),
                   prefill_tokens=float(r.get("prefill_tokens", 0)),
                   draft_fed_tokens=float(r.get("draft_fed_tokens", 0)),
                   draft_levels=float(levels))

    @classmethod
    def of_step(cls, plan: StepPlan, out: StepOutput, link_bytes: int, layers: int,
                history: str, wave_requests: int) -> StepFeatures:
        """A simulated step: the plan the scheduler made and the output the worker gave.
        ``link_bytes``: the history it moves over the link (a shared block once,
        ``EngineObjects.link_bytes``); ``history``: how the mode moves it ("restore",
        "stream", "restore-all" or "none")."""
        lens = [(s.start_pos, len(s.token_ids)) for s in plan.seqs]
        chunks = [s.restore_chunks for s in plan.seqs if s.restore_chunks]
        if not chunks or history == "none":
            units = 0
        elif history == "restore":
            units = layers
        elif history == "stream":
            # per layer, wave j holds the distinct j-th chunks of <= W requests (requests
            # whose j-th chunk is the same blocks, a shared prefix, share one copy of it)
            units = layers * sum(
                math.ceil(len({c[j] for c in chunks if len(c) > j}) / wave_requests)
                for j in range(max(map(len, chunks))))
        else:
            units = 1
        drafts = [d for d in out.drafts.values() if d]
        return cls(
            query_tokens=plan.num_tokens, attention_pairs=sum(n * (p + n) for p, n in lens),
            context_tokens=sum(p + n for p, n in lens), num_seqs=len(plan.seqs),
            draft_tokens=sum(len(d) for d in drafts), draft_seqs=len(drafts),
            history_bytes=float(link_bytes), units=units, draft_levels=out.draft_levels(),
            prefill_tokens=sum(n for s, (_, n) in zip(plan.seqs, lens) if s.prefill),
            draft_fed_tokens=sum(d.unseen for d in plan.drafts if out.drafts.get(d.request_id)))


@dataclass(frozen=True)
class StepCost:
    """Compute of one step of a mode, fitted on its measured steps; the link wait on top."""

    coef: tuple[float, ...]  # seconds per unit of each of FEATURES
    # True: the draft part runs on its own thread during the step and hides behind the link
    # wait only (``parallel`` drafting on the CPU backend; module docstring)
    concurrent_draft: bool = False

    def compute_s(self, f: StepFeatures) -> tuple[float, float]:
        """(compute, its draft part), the draft part as long as it runs (not what it adds to
        the step's wall when ``concurrent_draft``: ``seconds``)."""
        parts = [c * v for c, v in zip(self.coef, f.row(), strict=True)]
        return sum(parts), sum(parts[i] for i in DRAFT_COLUMNS)

    @staticmethod
    def wait_s(link_s: float, overlappable_s: float, units: int) -> float:
        """Time the step blocks on the link (module docstring)."""
        if units <= 0 or link_s <= 0:
            return 0.0
        r, c = link_s / units, overlappable_s / units
        return r + (units - 1) * max(0.0, r - c)

    def seconds(self, f: StepFeatures, link_bw: float) -> tuple[float, float, float]:
        """(wall, compute, link busy) of a step over a link of ``link_bw`` bytes/s."""
        compute, draft = self.compute_s(f)
        link = f.history_bytes / link_bw
        wait = self.wait_s(link, compute - draft, f.units)
        if self.concurrent_draft:  # only the part of the draft the wait does not cover
            compute = compute - draft + exposed_draft(draft, wait)
        wall = compute + wait + f.writeback_bytes / link_bw
        return wall, compute, link + f.writeback_bytes / link_bw

    def describe(self) -> str:
        units = {"const_s": ("ms", 1e3), "per_query_token_s": ("us/query token", 1e6),
                 "per_attention_pair_s": ("ns/attention pair", 1e9),
                 "per_context_token_s": ("ns/context token", 1e9),
                 "per_seq_s": ("ms/request", 1e3), "per_draft_token_s": ("ms/draft token", 1e3),
                 "per_draft_seq_s": ("ms/drafting request", 1e3),
                 "per_draft_fed_token_s": ("us/token the draft caught up on", 1e6),
                 "per_draft_level_s": ("ms/draft forward", 1e3)}
        return " + ".join(f"{c * units[n][1]:.3g} {units[n][0]}"
                          for n, c in zip(FEATURES, self.coef, strict=True) if c > 1e-15)


def compute_ratio(cost: StepCost, rows: list[dict[str, Any]], link_bw: float) -> float | None:
    """The measured steps' compute over what ``cost`` predicts for them (both summed, as the
    fit reads a step's compute: ``_target``; a second worker's draft only where the wait left
    it exposed). Above 1: these steps ran slower than the steps ``cost`` was fitted on, the
    machine's speed at the two times and whatever the fit's columns miss, together; None
    without steps."""
    measured = predicted = 0.0
    for r in rows:
        f = StepFeatures.of_record(r)
        y, (compute, draft) = _target(r, f, link_bw), cost.compute_s(f)
        if cost.concurrent_draft:
            wait = float(r.get("wait_s", 0.0))
            y -= exposed_draft(float(r.get("draft_s", 0.0)), wait)
            compute -= draft
        measured, predicted = measured + y, predicted + compute
    return measured / predicted if predicted > 0 else None


def scaled(cost: StepCost, factor: float) -> StepCost:
    """``cost`` with every step ``factor`` times as long (the link's time unchanged)."""
    return replace(cost, coef=tuple(c * factor for c in cost.coef))


def exposed_draft(draft_s: float, wait_s: float) -> float:
    """What a draft run on its own thread adds to a step that waits ``wait_s`` on the link
    (``StepCost.concurrent_draft``)."""
    return max(0.0, draft_s - wait_s)


def _target(r: dict[str, Any], f: StepFeatures, link_bw: float) -> float:
    """A measured step's compute. A step that carried a prefill chunk copied the chunk's KV to
    the host right after it, inside its compute time; that copy is costed on the link
    (``StepCost.seconds``), so its share (the step's device-to-host bytes at the link rate) is
    taken off (at the record's own ``link_bytes_per_s`` where it has one: steps of runs over
    different links fitted together)."""
    y = float(r["compute_s"])
    if f.prefill_tokens:
        d2h = max(0.0, float(r.get("link_bytes", 0)) - f.history_bytes)
        y = max(0.0, y - d2h / float(r.get("link_bytes_per_s", link_bw)))
    return y


def _concurrent(name: str, v: dict[str, Any]) -> bool:
    """Whether a mode of a bench JSON drafts on a second worker (``parallel``)."""
    drafting = v.get("drafting")
    if drafting is None:
        spec = MODES.get(name)
        drafting = spec.drafting if spec is not None else "sequential"
    return drafting == "parallel"


def pairs_per_query_token(num_layers: int, hidden: int, num_heads: int, num_kv_heads: int,
                          head_dim: int, intermediate: int) -> float:
    """Attention pairs (query x key positions) that cost what one query token's linear
    layers cost, by multiply-adds: the projections and the MLP over QK and PV a pair.
    On the embedded target, 2,048; a run whose pairs varied apart from its query tokens
    fitted 1,950 (``fit_modes``'s ``pair_prior``)."""
    linear = num_layers * (hidden * (num_heads + 2 * num_kv_heads) * head_dim
                           + num_heads * head_dim * hidden + 3 * hidden * intermediate)
    return linear / (num_layers * num_heads * head_dim * 2)


PAIR_SPREAD = 0.25  # pairs per query token varying by less (coefficient of variation): no spread


def pairs_without_spread(modes: dict[str, dict[str, Any]]) -> bool:
    """Whether the runs' attention pairs moved only with their query tokens: every request of
    one length, prefilled in chunks as long as the prompt and verified at about that context,
    so a pair's price and a query token's cannot be told apart (a fit gives either a share of
    the other's, and the split extrapolates to another context length at random)."""
    ratios = [float(f.attention_pairs) / f.query_tokens
              for v in modes.values() if v.get("rounds")
              for f in map(StepFeatures.of_record,
                           list(v["rounds"]) + list(v.get("prefill_steps") or []))
              if f.query_tokens > 0]
    if len(ratios) < 2:
        return True
    mean = float(np.mean(ratios))
    return bool(mean <= 0 or float(np.std(ratios)) / mean < PAIR_SPREAD)


def fit_modes(modes: dict[str, dict[str, Any]], link_bw: float,
              pair_prior: float | None = None) -> dict[str, StepCost]:
    """Step costs of every mode of a bench JSON (``modes``: name -> its ``rounds`` and
    ``prefill_steps``), fitted jointly: the target's forward (the ``SHARED`` columns) is the
    same code in every mode, so those coefficients are shared (five modes' steps pin them
    down: a prefill chunk costs the same whichever mode carries it); the constant and the
    draft columns are the mode's own (its drafting strategy, its per-step overheads). A mode
    that drafts on a second worker has its draft columns fitted on the measured draft time,
    and only the part of it the wait does not cover taken off its compute (module docstring).
    ``pair_prior`` (``pairs_per_query_token``): where the runs' pairs moved only with their
    query tokens (``pairs_without_spread``), a pair costs a query token's price over it, and
    the two columns are fitted as one."""
    if pair_prior is not None and pair_prior > 0 and pairs_without_spread(modes):
        tied = fit_modes(_pairs_as_tokens(modes, pair_prior), link_bw)
        return {m: replace(c, coef=_untie(c.coef, pair_prior)) for m, c in tied.items()}
    names = [m for m, v in modes.items() if v.get("rounds")]
    concurrent = {m for m in names if _concurrent(m, modes[m])}
    drafts = {m: _fit_draft(modes[m]) for m in concurrent}
    own = [i for i in range(len(FEATURES)) if i not in SHARED]
    width = len(SHARED) + len(own) * len(names)
    rows, ys = [], []
    for k, name in enumerate(names):
        v = modes[name]
        for r in list(v["rounds"]) + list(v.get("prefill_steps") or []):
            f = StepFeatures.of_record(r)
            full, row = f.row(), [0.0] * width
            y = _target(r, f, link_bw)
            if name in concurrent:  # the draft columns are fitted apart (_fit_draft)
                y -= exposed_draft(float(r.get("draft_s", 0.0)), float(r.get("wait_s", 0.0)))
                full = [0.0 if i in DRAFT_COLUMNS else x for i, x in enumerate(full)]
            for j, i in enumerate(SHARED):
                row[j] = full[i]
            for j, i in enumerate(own):
                row[len(SHARED) + k * len(own) + j] = full[i]
            rows.append(row)
            ys.append(y)
    if not rows:
        raise ValueError("no measured steps to fit")
    c = weighted_nnls(np.array(rows, dtype=float), np.array(ys, dtype=float))
    out = {}
    for k, name in enumerate(names):
        coef = [0.0] * len(FEATURES)
        for j, i in enumerate(SHARED):
            coef[i] = float(c[j])
        for j, i in enumerate(own):
            coef[i] = float(c[len(SHARED) + k * len(own) + j])
        if name in concurrent:
            for i, x in zip(DRAFT_COLUMNS, drafts[name], strict=True):
                coef[i] = x
        out[name] = StepCost(tuple(coef), concurrent_draft=name in concurrent)
    return _borrow_draft_costs(out, {m: _drafting_steps(modes[m]) for m in names}, concurrent)


MIN_DRAFTING_STEPS = 8  # a mode that drafted in fewer steps has no draft costs of its own


def _drafting_steps(v: dict[str, Any]) -> int:
    return sum(1 for r in list(v["rounds"]) + list(v.get("prefill_steps") or [])
               if float(r.get("draft_tokens", 0)) > 0)


def _borrow_draft_costs(costs: dict[str, StepCost], drafting: dict[str, int],
                        concurrent: set[str]) -> dict[str, StepCost]:
    """A mode whose run hardly drafted (the round-shape policy chose no drafts: random
    prompts) has nothing to fit its draft columns on, and they come out 0, which a replay of
    that mode on a workload where drafting pays reads as free drafts. It takes the draft
    columns of the mode of the same runs that drafted most (the same draft model's forwards;
    a second worker's are timed apart, so it lends to and borrows from its own kind only)."""
    out = dict(costs)
    for name, cost in costs.items():
        if drafting[name] >= MIN_DRAFTING_STEPS:
            continue
        kind = name in concurrent
        lenders = [m for m in costs if (m in concurrent) == kind
                   and drafting[m] >= MIN_DRAFTING_STEPS]
        if not lenders:
            continue
        lender = costs[max(lenders, key=lambda m: drafting[m])]
        coef = list(cost.coef)
        for i in DRAFT_COLUMNS:
            coef[i] = lender.coef[i]
        out[name] = replace(cost, coef=tuple(coef))
    return out


def _pairs_as_tokens(modes: dict[str, dict[str, Any]],
                     ratio: float) -> dict[str, dict[str, Any]]:
    """The runs with each step's pairs folded into its query tokens at ``ratio`` pairs a
    token (and no pairs left): the fit's query-token column is then the two together."""
    def fold(r: dict[str, Any]) -> dict[str, Any]:
        f = StepFeatures.of_record(r)
        return {**r, "query_tokens": f.query_tokens + f.attention_pairs / ratio,
                "attention_pairs": 0.0}

    return {m: {**v, "rounds": [fold(r) for r in v.get("rounds") or []],
                "prefill_steps": [fold(r) for r in v.get("prefill_steps") or []]}
            for m, v in modes.items()}


def _untie(coef: tuple[float, ...], ratio: float) -> tuple[float, ...]:
    """A tied fit's coefficients with the pair's price set from the query token's."""
    out = list(coef)
    out[2] = out[1] / ratio
    return tuple(out)


MIN_STEP_S = 1e-3  # a step's time below which its weight stops growing (no forward is faster)


def weighted_nnls(x: np.ndarray, y: np.ndarray, iterations: int = 50) -> np.ndarray:
    """Non-negative coefficients minimising the steps' relative errors (module docstring):
    least squares weighted by 1 / the fitted time, refitted until the weights settle (the
    weights come from the fit, not from ``y``: 1 / y would pull every prediction low)."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    c = nnls(xs, y)  # the absolute fit, to start from
    for _ in range(iterations):
        w = 1.0 / np.maximum(xs @ c, MIN_STEP_S)
        c, last = nnls(xs * w[:, None], y * w), c
        if np.allclose(c, last, rtol=1e-9, atol=0.0):
            break
    return c / scale


def _fit_draft(v: dict[str, Any]) -> tuple[float, ...]:
    """The draft columns of a mode, fitted on its steps' measured draft time (``draft_s``)."""
    rows, ys = [], []
    for r in list(v["rounds"]) + list(v.get("prefill_steps") or []):
        full = StepFeatures.of_record(r).row()
        rows.append([full[i] for i in DRAFT_COLUMNS])
        ys.append(float(r.get("draft_s", 0.0)))
    x, y = np.array(rows, dtype=float), np.array(ys, dtype=float)
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    return tuple(float(c) for c in nnls(x / scale, y) / scale)
