"""What one generation did, in a few lines a newcomer can read (``specstream generate``)."""

from __future__ import annotations

from typing import Any


def generation_summary(llm: Any, out: Any, m: dict[str, Any], wall: float) -> str:
    """What the engine did for one generation, in a few lines a newcomer can read."""
    comp, cfg, policy = out.outputs[0], llm.config, llm.engine.kv.policy
    n = len(comp.token_ids)
    lines = [f"[{n} tokens from a {len(out.prompt_token_ids)}-token prompt in {wall:.2f} s, "
             f"finish_reason={comp.finish_reason}]"]
    if comp.error:
        lines.append(f"  error         {comp.error}")
    how = {"none": "all KV on the device", "restore": "offloaded history restored layer by layer",
           "stream": f"offloaded history streamed in {policy.chunk_tokens}-token chunks"}
    auto = cfg.policy == "auto"
    spec = (f"{cfg.proposer} proposer, {'up to ' if auto else ''}{cfg.q} draft tokens per round"
            if cfg.speculative else "no speculation")
    if cfg.tree:
        spec = (f"{cfg.proposer} proposer, token trees {'up to ' if auto else ''}{cfg.q} deep "
                f"of up to {cfg.num_draft_tokens} nodes (top-{cfg.topk} children)")
    if auto:
        spec += " (speculative_policy auto: each round's shape chosen from measurements)"
    lines.append(f"  mode          {cfg.mode}: {how[cfg.mode_spec.history]}; {spec}")
    if cfg.speculative:
        chosen = ", ".join(f"{d}: {n}" for d, n in sorted(m["speculative_depth_chosen"].items()))
        lines.append(f"  speculation   {m['rounds']:.0f} rounds, mean accepted length "
                     f"{m['mean_accepted_len']:.2f} tokens per round, acceptance rate "
                     f"{m['acceptance_rate']:.2f}" + (f"; steps by depth chosen {{{chosen}}}"
                                                      if chosen else ""))
    if cfg.host_attends:
        # the run's share (the metric host_attention_share is the last step's)
        host = m.get("host_attention_bytes", 0)
        share = host / (host + m["link_bytes_h2d"]) if host else 0.0
        lines.append(f"  host          {share:.1%} of the cold history attended on the host "
                     f"CPU, {host / 1e6:.1f} MB (host_attention {cfg.host_attention})")
    if cfg.tree:
        lines.append(f"  trees         {m['mean_tree_nodes_per_round']:.1f} nodes verified per "
                     f"round; accepted by depth {m['accepted_per_pos']}")
    lines.append(f"  link          {_mb(m['link_bytes_h2d'])} host->device (restores), "
                 f"{_mb(m['link_bytes_d2h'])} device->host (write-backs)")
    if policy.fill:
        offload = (f"; residency fill: every full block written through to the host, the "
                   f"device keeps what fits (at least the newest {policy.resident_tail_tokens} "
                   f"tokens); {_mb(m['link_bytes_per_round'])} of history per round (floor "
                   f"{_mb(m['link_bytes_floor_per_round'])})")
    elif policy.offload:
        offload = (f"; history past {policy.offload_after_tokens} tokens offloaded, newest "
                   f"{policy.resident_tail_tokens} kept on the device")
    else:
        offload = ""
    lines.append(f"  KV peaks      device {_mb(m['device_kv_peak_bytes'])} of a "
                 f"{_mb(m['device_kv_budget_bytes'])} budget, host "
                 f"{_mb(m['host_kv_peak_bytes'])}{offload}")
    return "\n".join(lines)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 1e6:.1f} MB"
