"""What the engine measures: typed counters, and one record per decode step.

A step that verifies or drafts anything is a decode step (a step that only drafts, while its
group has no drafts to verify, included); a step that only prefills is not. A decode step's
link floor is the least time its bytes take at the link's rate; its compute floor (the same
work with the history already on the device) is not the engine's to know: the bench fits it
from the `resident` rounds of the same run (``specstream/bench/floors.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
    kv_history_block_s: float = 0.0
    step_wall_s: float = 0.0

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
        d["device_kv_utilization"] = (self.kv_history_block_s / self.step_wall_s
                                      if self.step_wall_s else 0.0)
        return d
