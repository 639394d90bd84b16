"""bench/ladder_rounds.py's per-run summary: decode rounds only, means per round and per
request, shapes counted."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "ladder_rounds.py"
spec = importlib.util.spec_from_file_location("ladder_rounds", SCRIPT)
assert spec is not None and spec.loader is not None
ladder_rounds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ladder_rounds)


def _round(seqs: int, nodes: int, new: int, wall: float, prefill: int = 0) -> dict:
    return {"num_seqs": seqs, "tree_nodes": nodes, "new_tokens": new, "wall_s": wall,
            "compute_s": wall / 2, "draft_s": 0.001, "wait_s": 0.002, "prefill_tokens": prefill,
            "host_bytes": 3_000_000, "link_bytes": 1_000_000}


def test_summary_counts_decode_rounds_only():
    res = {"output_tokens_per_s": 20.0, "decode_only_tokens_per_s": 90.0,
           "mean_accepted_len": 3.0,
           "rounds": [_round(2, 12, 6, 0.060), _round(4, 24, 8, 0.080),
                      _round(1, 0, 1, 5.0, prefill=4096)]}
    text = ladder_rounds.summary(res)
    # two decode rounds of 3 requests on average; 36 nodes and 14 tokens over 6 requests
    assert "2 decode rounds of 3.00 requests" in text
    assert "6.0 nodes and 2.33 tokens a request" in text
    assert "wall 70.0 ms" in text and "host 3.0 MB and link 1.0 MB" in text
    assert "((2, 12), 1), ((4, 24), 1)" in text and "(1, 0)" not in text


def test_variant_step_changes_the_default_only_where_asked():
    step = ladder_rounds.variant_step("tree16", {"speculative_policy": "fixed",
                                                 "speculative_topk": 4,
                                                 "resident_tail_tokens": 128})
    default = ladder_rounds.LADDER[ladder_rounds.DEFAULT]
    assert step.name == "tree16" and step.mode == default.mode == "specstream"
    assert step.speculative_policy == "fixed" and step.speculative_topk == 4
    # a field the step does not carry goes to the engine's config
    assert step.extra == {"resident_tail_tokens": 128}
    assert step.host_attention == default.host_attention
    assert step.num_speculative_tokens == default.num_speculative_tokens
