"""What the engine measures: typed counters, and one record per decode step.

A step that verifies or drafts anything is a decode step (a step that only drafts, while its
group has no drafts to verify, included); a step that only prefills is not. A decode step's
link floor is the least time its bytes take at the link's rate; its compute floor (the same
work with the history already on the device) is not the engine's to know: the bench fits it
from the `resident` rounds of the same run (``specstream/bench/floors.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from specstream.engine.contract import StepMeasures, StepOutput, StepPlan


@dataclass(frozen=True)
class RoundStats:
    """One decode step."""

    start: float  # perf_counter seconds
    wall_s: float
    link_s: float  # time the link was busy (both directions, overlaps merged)
    link_bytes: int  # bytes it moved
    compute_s: float  # wall minus time blocked on the link
    draft_s: float  # drafting inside the step (gaps, after verification, second device)
    wait_s: float  # time blocked on the link
    query_tokens: int  # tokens the target processed (all requests, prefill chunks included)
    context_tokens: int  # tokens attended (all requests)
    attention_pairs: int  # query x key pairs of the step's attention (all requests)
    num_seqs: int  # requests in the target forward
    prefill_tokens: int  # prompt tokens prefilled in the same step (mixed steps)
    new_tokens: int  # tokens the step's verifications emitted (accepted + bonus)
    draft_tokens: int  # draft tokens proposed in the step
    draft_seqs: int  # requests that drafted in the step
    link_floor_s: float  # link_bytes at the link's rate
    tree_nodes: int = 0  # draft tokens verified as token trees (all requests)
    history_bytes: int = 0  # host-to-device bytes of history (restored or streamed)
    history_floor_bytes: int = 0  # the step's history that cannot be resident (see engine)
    draft_fed_tokens: int = 0  # tokens the draft caught up on before drafting (unseen ones)
    host_bytes: int = 0  # cold history attended on the host (host_attention), all layers
    host_busy_s: float = 0.0  # the host workers' time on it
    host_wait_s: float = 0.0  # time the round waited for the host's partials
    host_serial_s: float = 0.0  # device time of the round while the host had no job
    halves: int = 1  # the round ran in this many halves a layer apart (host attention)
    draft_levels: int = 0  # the draft's forwards: its deepest chain's length or tree's depth


@dataclass
class EngineStats:
    """Cumulative counters since the engine started."""

    steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    # Speculation, vLLM's way: rounds that verified drafts (per request), draft tokens
    # verified, accepted, and accepted per draft position (a tree's: per depth).
    rounds: int = 0
    num_drafts: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # Token trees: rounds (per request) that verified a tree, and the nodes they verified.
    tree_rounds: int = 0
    tree_nodes: int = 0
    # The link and the device.
    link_bytes_h2d: int = 0
    link_bytes_d2h: int = 0
    link_busy_s: float = 0.0
    compute_s: float = 0.0
    draft_s: float = 0.0
    # Decode steps (see the module docstring) and prefill-only steps.
    decode_time_s: float = 0.0
    decode_link_busy_s: float = 0.0
    decode_link_floor_s: float = 0.0
    prefill_only_time_s: float = 0.0
    # Residency, over the decode steps that ran the target (verification rounds; a step that
    # only drafts moves no history): their count, the history bytes they moved to the device,
    # and the least they could have moved (the history that cannot be resident given the
    # device budget); device KV blocks holding history x step seconds, and step seconds (for
    # the time average).
    verify_steps: int = 0
    decode_history_bytes: int = 0
    decode_history_floor_bytes: int = 0
    # ... and the distinct blocks of it (a block several requests of a round read: once)
    decode_history_unique_bytes: int = 0
    kv_history_block_s: float = 0.0
    step_wall_s: float = 0.0
    # Host attention: rounds run as two halves a layer apart (exec/round.py).
    halved_rounds: int = 0

    def record(self, plan: StepPlan, out: StepOutput, m: StepMeasures, link_bps: float,
               history_floor: int, kv_held: float, history_unique: int = 0
               ) -> RoundStats | None:
        """Fold one step into the counters; returns its round record (None for a step that did
        nothing). ``history_floor``: the step's history that cannot be resident given the
        device budget, ``kv_held``: the fraction of device KV blocks holding history (both
        taken before the step ran); ``history_unique``: the distinct blocks' bytes of the
        history the step moves over the link."""
        for s in plan.seqs:
            new = out.new_tokens.get(s.request_id)
            if s.sample and not s.prefill and new is not None:
                self.count_accepted(s.num_drafts, len(new) - 1, s.tree.depth,
                                    tree=bool(s.parents))
        self.step_wall_s += m.wall_s
        self.kv_history_block_s += kv_held * m.wall_s
        self.steps += 1
        self.link_busy_s += m.link_busy_s
        self.compute_s += m.compute_s
        self.draft_s += m.draft_s
        self.prefill_tokens += m.prefill_tokens
        self.halved_rounds += m.halves > 1
        if not (m.decode or m.prefill_tokens):
            return None  # nothing was done
        link_floor = m.link_bytes / link_bps if link_bps else 0.0
        if m.decode and plan.seqs:  # a verification round: the history it moved
            self.verify_steps += 1
            self.decode_history_bytes += m.history_bytes
            self.decode_history_floor_bytes += history_floor
            self.decode_history_unique_bytes += history_unique
        if m.decode:
            self.decode_steps += 1
            self.decode_time_s += m.wall_s
            self.decode_link_busy_s += m.link_busy_s
            self.decode_link_floor_s += link_floor
        else:
            self.prefill_only_time_s += m.wall_s
        return RoundStats(
            start=out.start, wall_s=m.wall_s, link_s=m.link_busy_s, link_bytes=m.link_bytes,
            compute_s=m.compute_s, draft_s=m.draft_s, wait_s=m.wait_s,
            query_tokens=plan.num_tokens,
            context_tokens=sum(s.start_pos + len(s.token_ids) for s in plan.seqs),
            attention_pairs=sum(len(s.token_ids) * (s.start_pos + len(s.token_ids))
                                for s in plan.seqs),
            num_seqs=len(plan.seqs), prefill_tokens=m.prefill_tokens,
            new_tokens=sum(len(out.new_tokens.get(s.request_id, ())) for s in plan.seqs
                           if s.sample and not s.prefill),
            draft_tokens=sum(len(d) for d in out.drafts.values()),
            draft_seqs=len(out.drafts), link_floor_s=link_floor, history_bytes=m.history_bytes,
            history_floor_bytes=history_floor,
            tree_nodes=sum(s.num_drafts for s in plan.seqs if s.parents),
            draft_fed_tokens=sum(d.unseen for d in plan.drafts if out.drafts.get(d.request_id)),
            host_bytes=m.host_bytes, host_busy_s=m.host_busy_s, host_wait_s=m.host_wait_s,
            host_serial_s=m.host_serial_s, halves=m.halves, draft_levels=out.draft_levels())

    def count_accepted(self, num_drafts: int, num_accepted: int, depth: int | None = None,
                       tree: bool = False) -> None:
        """One request's verification round: ``num_drafts`` drafts (a tree's nodes) of which
        ``num_accepted`` were accepted (a path of a tree, at most ``depth`` deep; a chain's
        depth is ``num_drafts``)."""
        self.rounds += 1
        self.proposed_tokens += num_drafts
        self.accepted_tokens += num_accepted
        if tree:
            self.tree_rounds += 1
            self.tree_nodes += num_drafts
        depth = num_drafts if depth is None else depth
        if num_drafts:
            self.num_drafts += 1
            if depth > len(self.accepted_per_pos):
                self.accepted_per_pos += [0] * (depth - len(self.accepted_per_pos))
            for i in range(num_accepted):
                self.accepted_per_pos[i] += 1

    def as_dict(self) -> dict[str, Any]:
        """The counters and the ratios derived from them."""
        d = asdict(self)
        rounds, proposed, dt = self.rounds, self.proposed_tokens, self.decode_time_s
        d["acceptance_rate"] = self.accepted_tokens / proposed if proposed else 0.0
        d["mean_accepted_len"] = (self.accepted_tokens + rounds) / rounds if rounds else 0.0
        d["mean_tree_nodes_per_round"] = (self.tree_nodes / self.tree_rounds
                                          if self.tree_rounds else 0.0)
        # time-weighted over decode steps
        d["link_utilization"] = self.decode_link_busy_s / dt if dt else 0.0
        floor = self.decode_link_floor_s
        d["decode_time_over_link_floor"] = dt / floor if floor else 0.0
        steps = self.verify_steps
        d["link_bytes_per_round"] = self.decode_history_bytes / steps if steps else 0.0
        d["link_bytes_floor_per_round"] = (self.decode_history_floor_bytes / steps
                                           if steps else 0.0)
        d["link_bytes_unique_per_round"] = (self.decode_history_unique_bytes / steps
                                            if steps else 0.0)
        d["device_kv_utilization"] = (self.kv_history_block_s / self.step_wall_s
                                      if self.step_wall_s else 0.0)
        return d


@dataclass(frozen=True)
class EngineMetrics:
    """``LLMEngine.get_metrics()`` as a typed record: the counters (``EngineStats``, with
    their ratios) and the engine's state now. ``as_dict`` is its serialisation (the keys
    ``get_metrics`` has always had)."""

    stats: EngineStats
    mode: str
    # speculative_policy auto: steps by the chain depth chosen (0 = no drafts), and by the
    # draft nodes per request chosen (a chain: its depth)
    speculative_depth_chosen: dict[int, int]
    speculative_nodes_chosen: dict[int, int]
    device_kv_blocks_used: int
    device_kv_blocks_total: int
    host_kv_blocks_used: int
    host_kv_blocks_total: int
    # automatic prefix caching (named as vLLM names them; tokens)
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    prefix_cache_hits_by_tier: dict[str, int]
    prefix_cache_blocks: dict[str, int]
    # host attention: KV bytes attended on the host CPU, its measured rate, the last share
    host_attention_bytes: int
    host_attention_bytes_per_s: float
    host_attention_share: float
    device_kv_budget_bytes: int
    device_kv_peak_bytes: int
    host_kv_peak_bytes: int
    device_kv_used_bytes: int
    host_kv_used_bytes: int
    running: int
    waiting: int
    max_concurrency: int
    # token trees: KV slots of accepted paths moved into place
    tree_kv_moves: int = 0
    # `fill`: blocks promoted into device windows as they passed (no link bytes)
    promoted_blocks: int = 0
    # `specstream`: steps whose groups merged into one (decode rounds not link-bound)
    merged_group_steps: int = 0
    # prefix sharing: references to host blocks two or more running requests share, those
    # blocks, and the running requests' KV bytes with every shared block counted once
    shared_block_refs: int = 0
    shared_blocks: int = 0
    unique_kv_bytes: int = 0
    # structured outputs: seconds spent computing grammar masks (verification rows and draft
    # steps; inside the step times the round-shape policy measures) and the rows masked
    structured_mask_s: float = 0.0
    structured_mask_rows: int = 0

    @property
    def device_kv_usage(self) -> float:
        used, total = self.device_kv_blocks_used, self.device_kv_blocks_total
        return used / total if total else 0.0

    @property
    def host_kv_usage(self) -> float:
        used, total = self.host_kv_blocks_used, self.host_kv_blocks_total
        return used / total if total else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = self.stats.as_dict()
        d.update({f.name: getattr(self, f.name) for f in fields(self) if f.name != "stats"})
        d["device_kv_usage"], d["host_kv_usage"] = self.device_kv_usage, self.host_kv_usage
        return d
