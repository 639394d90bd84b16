"""Who drafts in a step, and how many drafts: the scheduler's side of speculation.

Each step the round-shape policy (``speculative_policy="auto"``, ``policy/shaping.py``) picks
the drafts' shape for the requests it verifies; this planner turns it into ``DraftWork``: the
requests not verified in the step and still without drafts draft while it runs (the other
group, in the two-group modes), the ones it verifies draft right after, from the tokens their
verification emits.
"""

from __future__ import annotations

from specstream.config import EngineConfig
from specstream.engine.contract import DraftWork, SeqWork
from specstream.engine.policy.round_shape import Shape
from specstream.engine.policy.shaping import RoundShaper
from specstream.engine.request import Request
from specstream.options import DraftCache, Proposer


class DraftPlanner:
    def __init__(self, config: EngineConfig, shaper: RoundShaper | None,
                 max_model_len: int) -> None:
        self.config, self.shaper, self.max_model_len = config, shaper, max_model_len
        # the shape this step's drafts are asked for (the policy's last choice)
        self.shape = Shape(config.q, config.topk,
                           config.num_draft_tokens if config.tree else 0)

    def choose_shape(self, running: list[Request], two_groups: bool) -> None:
        """The policy's shape for this step's round (requests verified per round: a group, or
        all of them); requests waiting for drafts the new shape does not make verify without
        drafts instead of stalling."""
        if self.shaper is None:
            return
        decoding = sum(not r.in_prefill for r in running)
        # the decoding requests' catching up, and that of the prompts whose last chunk this
        # step is likely to take: they draft right after it, in this step's shape (a prompt
        # with chunks to go is decided at the step of its last)
        joining = self.last_chunks(running)
        share = sum(self.unseen(r) / max(1, self.room(r))
                    for r in running if not r.in_prefill or r.request_id in joining)
        groups = 2 if two_groups else 1
        history = sum(r.num_tokens for r in running if not r.in_prefill)
        self.shape = self.shaper.shape(-(-decoding // groups), catch_up=share / groups,
                                       history_tokens=history // groups)
        for req in running:
            if req.needs_draft and self.draft(req, after_verify=False).count(0) == 0:
                req.needs_draft = False

    def last_chunks(self, running: list[Request]) -> set[str]:
        """Prompts whose prefill this step's budget finishes: the oldest first, as the
        scheduler hands out prefill slots (its device room aside)."""
        budget, done = self.config.max_prefill_tokens, set()
        for req in running:
            if budget <= 0:
                break
            if req.in_prefill:
                todo = req.num_tokens - req.num_computed_tokens
                if todo <= budget:
                    done.add(req.request_id)
                budget -= todo
        return done

    def work(self, running: list[Request], requests: dict[str, Request],
             seqs: list[SeqWork], after_all: bool) -> tuple[DraftWork, ...]:
        """Who drafts in this step: requests not verified in it and still without drafts
        draft while it runs; those it verifies draft right after (every one where
        ``after_all``: the one-group modes, and a two-group step that carries a prefill
        chunk, whose compute hides the link anyway)."""
        if not self.config.speculative:
            return ()
        verified = {s.request_id for s in seqs if s.sample}
        in_step = {s.request_id for s in seqs}
        work = []
        for req in running:
            rid = req.request_id
            if rid in verified and after_all:
                work.append(self.draft(req, after_verify=True))
            elif rid not in in_step and req.needs_draft and not req.in_prefill:
                work.append(self.draft(req, after_verify=False))
        work = [w for w in work if w.count(0) > 0]
        shaped = [w for w in work if self.shaped(requests[w.request_id])]
        if self.shaper is not None and self.shaper.probing and shaped:
            # a probe drafts for one request, the one the draft has seen most of (the others'
            # first drafts would make the draft prefill their windows before the policy knows
            # whether drafting pays), and an exploration not at all where that costs too much
            shaped.sort(key=lambda w: w.unseen)
            keep = 1 if self.shaper.explore_now(shaped[0].unseen, len(shaped),
                                                self.rounds_left(running, requests)) else 0
            dropped = {w.request_id for w in shaped[keep:]}
            for rid in dropped:
                requests[rid].needs_draft = False
            work = [w for w in work if w.request_id not in dropped]
        return tuple(work)

    def rounds_left(self, running: list[Request], requests: dict[str, Request]) -> float:
        """Rounds of the known work (running and waiting requests) at a token a request a
        round, as many requests a round as decode now."""
        decoding = max(1, sum(not r.in_prefill for r in running))
        return sum(max(0, self.room(r)) for r in requests.values() if not r.finished) / decoding

    def shaped(self, req: Request) -> bool:
        """Whether the round-shape policy shapes the request's drafts. Not a seeded sampled
        request's: which tokens it draws depends on how many drafts each round verifies, and
        the policy's choices depend on measured times, while a seed must give the same
        output every time; it drafts its chain of the configured depth."""
        return self.shaper is not None and (req.params.greedy or req.params.seed is None)

    def draft(self, req: Request, after_verify: bool) -> DraftWork:
        cfg, q = self.config, req.params.num_speculative_tokens
        depth = cfg.fixed_depth if q is None else q
        topk, nodes = cfg.topk, cfg.num_draft_tokens
        if self.shaped(req):  # the policy's shape, within the request's own depth
            shape = self.shape
            depth = min(cfg.q if q is None else q, shape.depth)
            topk, nodes = shape.topk, shape.num_nodes
            if not req.params.greedy:  # a sampled request verifies a tree's children as
                topk = 1  # point masses, which accept far less than a sampled chain
        elif self.shaper is not None:  # seeded sampling: its chain, whatever was measured
            topk = 1
        tree = topk > 1
        return DraftWork(
            request_id=req.request_id, token_ids=tuple(req.all_token_ids),
            num_tokens=depth, room=self.room(req), params=req.params,
            after_verify=after_verify, topk=topk,
            # a request's own depth may exceed the engine's node budget: a chain that deep
            max_nodes=max(nodes, depth) if tree else None, unseen=self.unseen(req),
            prompt_len=len(req.prompt_token_ids))

    def wants_drafts(self, req: Request) -> bool:
        """Whether the request would draft for its next round at all."""
        return self.draft(req, after_verify=False).count(0) > 0

    def unseen(self, req: Request) -> int:
        """Tokens a draft model would feed before drafting for ``req``: what it has not seen
        (a request that never drafted: its sinks and window at most)."""
        cfg = self.config
        if cfg.proposer is not Proposer.DRAFT:
            return 0
        window = (cfg.draft_sink_tokens + cfg.draft_window_tokens
                  if cfg.draft_cache is DraftCache.WINDOW else 1 << 62)
        return min(req.num_tokens - req.draft_seen if req.draft_seen else req.num_tokens,
                   window)

    def room(self, req: Request) -> int:
        """Tokens the request may still generate (its max_tokens and the model's context)."""
        return min(req.params.max_tokens - len(req.output_token_ids),
                   self.max_model_len - req.num_tokens)
