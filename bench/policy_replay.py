"""How much of the default's gap to the best fixed chain is its acceptance estimate, and how
much its cost model: a cell's rounds replayed offline under true costs.

    PYTHONPATH=. python bench/policy_replay.py [--cell c11] [--output-len 128] \
        [--out bench/results/explore-up/policy-replay.json]

Two runs of the cell's default configuration, the policy's choice overridden: (1) every round
a chain of 8, recording per request which of the draft's tokens matched the target's (a
round that accepted a < 8 drafts says tokens i .. i+a-1 matched and i+a did not; the token
after 8 accepted is not seen, and is filled at random with the rate seen after a run of 8);
(2) the depths cycled round by round, recording the median verification and draft time of a
one-request round at each depth (the true costs). Then each request's tokens are replayed:
every fixed depth, and the policy's acceptance estimate (``AcceptanceEstimate``, the engine's
settings) choosing each round's depth by expected tokens over the true cost. The policy's
replay against the best fixed depth is what its acceptance estimate loses; the measured
default against the best fixed point, beyond that, is what its cost estimates lose."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import random
import statistics
import sys
from pathlib import Path

from specstream.engine.policy import shaping
from specstream.engine.policy.round_shape import AcceptanceEstimate, Shape, expected_tokens

HERE = Path(__file__).resolve().parent
DEPTHS = (0, 1, 2, 3, 4, 6, 8)


def _run_cell(cell_name: str, out_len: int, depths: itertools.cycle) -> dict:
    spec = importlib.util.spec_from_file_location("matrix", HERE / "matrix.py")
    assert spec is not None and spec.loader is not None
    m = importlib.util.module_from_spec(spec)
    sys.modules["matrix"] = m
    spec.loader.exec_module(m)
    from specstream.bench.runner import BenchSettings, workload_kv_bytes
    from specstream.llm import LLM

    rounds: dict[str, list[tuple[int, int]]] = {}
    verify: dict[int, list[float]] = {}
    draft: dict[int, list[float]] = {}
    choose, observe_step = shaping.choose, shaping.RoundShaper.observe_step

    def record(self, plan, out, link_s, verify_s, draft_s, prefill):  # type: ignore[no-untyped-def]
        done = [s for s in plan.seqs if s.sample and s.request_id in out.new_tokens]
        for s in done:
            rounds.setdefault(s.request_id, []).append(
                (s.num_drafts, len(out.new_tokens[s.request_id]) - 1))
        if len(plan.seqs) == 1 and done and not prefill:  # verified this round's drafts,
            rid = done[0].request_id  # drafted the next round's
            verify.setdefault(done[0].num_drafts, []).append(verify_s)
            draft.setdefault(len(out.drafts.get(rid) or ()), []).append(draft_s)
        return observe_step(self, plan, out, link_s, verify_s, draft_s, prefill)

    shaping.choose = lambda *a, **k: Shape(next(depths))
    shaping.RoundShaper.observe_step = record  # type: ignore[method-assign]
    try:
        cell = {c.name: c for c in m.DESIGN}[cell_name]
        work = m.workload_of(cell, out_len)
        budget = int(cell.budget * workload_kv_bytes(work, BenchSettings()))
        probe = LLM(mode="resident", device="cpu")
        prompts = m.make_prompts(cell, work, probe.tokenizer,
                                 probe.engine.model_config.vocab_size)
        probe.close()
        kw = m.configs(budget, cell.link_gbps, tuple(m.GRID))["default"]
        m.run_one(kw, work, prompts, cell.link_gbps)
    finally:
        shaping.choose, shaping.RoundShaper.observe_step = choose, observe_step
    return {"rounds": rounds, "verify": verify, "draft": draft}


def matches(rounds: dict[str, list[tuple[int, int]]]) -> list[list[bool | None]]:
    """Per request, per generated token: whether the draft's token matched (None: not seen)."""
    seqs = []
    for _, rs in sorted(rounds.items()):
        seq: list[bool | None] = []
        for d, a in rs:
            seq += [True] * a
            seq.append(False if a < d else None)
        seqs.append(seq)
    return seqs


def replay(seqs: list[list[bool]], cost: dict[int, float], pick) -> float:  # type: ignore[no-untyped-def]
    """Tokens per second of ``pick`` (a function of the estimate) over the requests in turn."""
    acc = AcceptanceEstimate(prior=(0.6, 0.15, 0.0375, 0.009375), prior_weight=20.0,
                             decay=0.995)
    t = tokens = 0.0
    for seq in seqs:
        i = 0
        while i < len(seq):
            q = pick(acc)
            a = 0
            while a < q and i + a < len(seq) - 1 and seq[i + a]:
                a += 1
            t, tokens, i = t + cost[q], tokens + a + 1, i + a + 1
            if q:
                acc.observe_chain(q, a)
    return tokens / t


def _best(acc: AcceptanceEstimate, cost: dict[int, float]) -> int:
    return max(cost, key=lambda q: expected_tokens(Shape(q), acc) / cost[q])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cell", default="c11")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    chains = _run_cell(args.cell, args.output_len, itertools.cycle([8]))
    cycled = _run_cell(args.cell, args.output_len, itertools.cycle(DEPTHS))
    verify, draft = cycled["verify"], cycled["draft"]
    cost = {q: statistics.median(verify[q]) + (statistics.median(draft[q]) if q else 0.0)
            for q in DEPTHS
            if len(verify.get(q, ())) >= 3 and (not q or len(draft.get(q, ())) >= 3)}
    print(f"[replay] true round ms by depth: { {q: round(c * 1e3, 2) for q, c in cost.items()} }")
    seqs = matches(chains["rounds"])
    after_8 = [s[i + 8] for s in seqs for i in range(len(s) - 8)
               if all(s[i:i + 8]) and s[i + 8] is not None]
    p = sum(map(bool, after_8)) / len(after_8) if after_8 else 0.8
    known = [x for s in seqs for x in s if x is not None]
    print(f"[replay] {sum(map(len, seqs))} tokens, draft matched {sum(known) / len(known):.3f}"
          f", after 8 matched {p:.2f}")
    result: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        r = random.Random(seed)
        filled = [[(r.random() < p) if x is None else x for x in s] for s in seqs]
        for q in cost:
            result.setdefault(f"fixed q={q}", []).append(replay(filled, cost, lambda _, q=q: q))
        result.setdefault("policy's estimate, true costs", []).append(
            replay(filled, cost, lambda acc: _best(acc, cost)))
    summary = {k: statistics.mean(v) for k, v in result.items()}
    top = max(v for k, v in summary.items() if k.startswith("fixed"))
    for k, v in summary.items():
        print(f"[replay] {k:32s} {v:7.1f} tok/s  {v / top:.3f} of the best fixed")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cell": args.cell, "output_len": args.output_len,
                                        "cost_s": cost, "after_8_rate": p, "runs": result,
                                        "mean_tok_s": summary}, indent=1))
        print(f"[replay] wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
