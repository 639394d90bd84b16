"""How much of the default's gap to the best fixed chain is its acceptance estimate, and how
much its cost model: a cell's rounds replayed offline, one request at a time.

    PYTHONPATH=. python bench/policy_replay.py [--cell c11] [--output-len 128] \
        [--out FILE.json] [--load FILE.json] [--seeds 20]

Two runs of the cell's default configuration, the policy's choice overridden: (1) every round
a chain of 8, recording per request which of the draft's tokens matched the target's (a
round that accepted a < 8 drafts says tokens i .. i+a-1 matched and i+a did not; the token
after 8 accepted is not seen, and is filled at random with the rate seen after a run of 8);
(2) the depths cycled round by round, recording every one-request round's verification time
and draft time at each depth (draft time only where the draft was not catching up). Then each
request's tokens are replayed, each round's times drawn from those measured at its depth:
every fixed depth; the policy's acceptance estimate choosing on the true (median) costs; and
the engine's ``RoundShaper`` fed the drawn times (its own acceptance and cost estimates, its
probes and explorations; chains, at the depths the cycled run measured). ``--out`` keeps the
two runs, ``--load`` replays them again, e.g. with another checkout's package on PYTHONPATH:
a change to the policy compared offline on the same rounds and times, where end-to-end runs
of one cell vary by 10-20%."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from specstream.engine.policy import shaping
from specstream.engine.policy.round_shape import Shape, expected_tokens
from specstream.engine.policy.shaping import RoundShaper

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
    prefill: list[float] = []
    choose, observe_step = shaping.choose, shaping.RoundShaper.observe_step
    prior_position = shaping.RoundShaper.prior_position

    def record_prefill(self, token_s, tokens=0):  # type: ignore[no-untyped-def]
        prefill.append(token_s)
        return prior_position(self, token_s, tokens)

    def record(self, plan, out, link_s, verify_s, draft_s, prefill):  # type: ignore[no-untyped-def]
        done = [s for s in plan.seqs if s.sample and s.request_id in out.new_tokens]
        for s in done:
            rounds.setdefault(s.request_id, []).append(
                (s.num_drafts, len(out.new_tokens[s.request_id]) - 1))
        if len(plan.seqs) == 1 and done and not prefill:  # verified this round's drafts,
            rid = done[0].request_id  # drafted the next round's
            verify.setdefault(done[0].num_drafts, []).append(verify_s)
            drafted = len(out.drafts.get(rid) or ())
            if sum(w.unseen for w in plan.drafts) <= drafted + 2:  # not catching up
                draft.setdefault(drafted, []).append(draft_s)
        return observe_step(self, plan, out, link_s, verify_s, draft_s, prefill)

    shaping.choose = lambda *a, **k: Shape(next(depths))
    shaping.RoundShaper.observe_step = record  # type: ignore[method-assign]
    shaping.RoundShaper.prior_position = record_prefill  # type: ignore[method-assign]
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
        shaping.RoundShaper.prior_position = prior_position  # type: ignore[method-assign]
    return {"rounds": rounds, "verify": verify, "draft": draft, "prefill_token_s": prefill,
            "prompt_len": work.context_lengths[0]}


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


class Fixed:
    """A fixed chain of ``q``."""

    def __init__(self, q: int) -> None:
        self.q = q

    def pick(self, context: int) -> int:
        return self.q

    def seen(self, q: int, accepted: int, verify_s: float, draft_s: float,
             context: int) -> None:
        pass


class Estimate(Fixed):
    """The policy's acceptance estimate choosing on the true (median) costs."""

    def __init__(self, cost: dict[int, float]) -> None:
        super().__init__(0)
        self.cost, self.decisions = cost, 0
        engine = RoundShaper(max_depth=max(cost), drafting="gaps")
        self.acc, self.explore_every = engine.acceptance, engine.explore_every

    def pick(self, context: int) -> int:
        self.decisions += 1
        q = max(self.cost, key=lambda q: expected_tokens(Shape(q), self.acc) / self.cost[q])
        return 1 if q == 0 and self.decisions % self.explore_every == 0 else q  # exploring

    def seen(self, q: int, accepted: int, verify_s: float, draft_s: float,
             context: int) -> None:
        if q:
            self.acc.observe_chain(q, accepted)


class Shaper(Fixed):
    """The engine's ``RoundShaper`` (chains only) fed the sampled times: its own estimates of
    acceptance and of the costs, probes and explorations included."""

    def __init__(self, depths: Sequence[int], prefill_token_s: float | None) -> None:
        super().__init__(0)
        self.shaper = RoundShaper(max_depth=max(depths), drafting="gaps")
        # depths the cycled run did not measure are not offered
        self.shaper.candidates = [c for c in self.shaper.candidates if c.depth in depths]
        if prefill_token_s:
            self.shaper.prior_position(prefill_token_s)

    def pick(self, context: int) -> int:
        return self.shaper.shape(1, history_tokens=context).depth

    def seen(self, q: int, accepted: int, verify_s: float, draft_s: float,
             context: int) -> None:
        self.shaper.observe(0.0, verify_s, q + 1, [1] * q, draft_s, [(q, accepted)],
                            num_requests=1, history_tokens=context)


def replay(seqs: list[list[bool]], times: dict[int, tuple[list[float], list[float]]],
           policy: Fixed, rng: random.Random, prompt_len: int) -> float:
    """Tokens per second of ``policy`` over the requests in turn, each round's verification
    and draft time drawn from those measured at its depth."""
    t = tokens = 0.0
    for seq in seqs:
        i = 0
        while i < len(seq):
            q = policy.pick(prompt_len + i)
            a = 0
            while a < q and i + a < len(seq) - 1 and seq[i + a]:
                a += 1
            verify_s = rng.choice(times[q][0])
            draft_s = rng.choice(times[q][1]) if q else 0.0
            policy.seen(q, a, verify_s, draft_s, prompt_len + i)
            t, tokens, i = t + verify_s + draft_s, tokens + a + 1, i + a + 1
    return tokens / t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cell", default="c11")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--load", type=Path, default=None,
                    help="replay the two runs saved in this file (--out's) instead of running")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.load:
        saved = json.loads(args.load.read_text())
        chains, cycled = saved["chains"], saved["cycled"]
    else:
        chains = _run_cell(args.cell, args.output_len, itertools.cycle([8]))
        cycled = _run_cell(args.cell, args.output_len, itertools.cycle(DEPTHS))
    verify = {int(q): v for q, v in cycled["verify"].items()}
    draft = {int(q): v for q, v in cycled["draft"].items()}
    times = {q: (verify[q], draft.get(q, [])) for q in DEPTHS
             if len(verify.get(q, ())) >= 3 and (not q or len(draft.get(q, ())) >= 3)}
    cost = {q: statistics.median(v) + (statistics.median(d) if q else 0.0)
            for q, (v, d) in times.items()}
    print(f"[replay] round ms by depth (medians): "
          f"{ {q: round(c * 1e3, 2) for q, c in cost.items()} }")
    seqs = matches(chains["rounds"])
    after_8 = [s[i + 8] for s in seqs for i in range(len(s) - 8)
               if all(s[i:i + 8]) and s[i + 8] is not None]
    p = sum(map(bool, after_8)) / len(after_8) if after_8 else 0.8
    known = [x for s in seqs for x in s if x is not None]
    print(f"[replay] {sum(map(len, seqs))} tokens, draft matched {sum(known) / len(known):.3f}"
          f", after 8 matched {p:.2f}")
    prefill = statistics.median(cycled["prefill_token_s"]) if cycled["prefill_token_s"] else None
    policies = {f"fixed q={q}": (lambda q=q: Fixed(q)) for q in times}
    policies["policy's acceptance, true costs"] = lambda: Estimate(cost)
    policies["the engine's RoundShaper"] = lambda: Shaper(tuple(times), prefill)
    result: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        r = random.Random(seed)
        filled = [[(r.random() < p) if x is None else x for x in s] for s in seqs]
        for name, make in policies.items():
            result.setdefault(name, []).append(
                replay(filled, times, make(), random.Random(seed), cycled["prompt_len"]))
    summary = {k: statistics.mean(v) for k, v in result.items()}
    top = max(v for k, v in summary.items() if k.startswith("fixed"))
    for k, v in summary.items():
        spread = f"{min(result[k]):.1f}-{max(result[k]):.1f}"
        print(f"[replay] {k:32s} {v:7.1f} tok/s [{spread}]  {v / top:.3f} of the best fixed")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cell": args.cell, "output_len": args.output_len,
                                        "cost_s": cost, "after_8_rate": p, "runs": result,
                                        "mean_tok_s": summary, "chains": chains,
                                        "cycled": cycled}, indent=1))
        print(f"[replay] wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
