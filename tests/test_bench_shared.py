"""The shared-prefix workloads (specstream/bench/shared.py) on the tiny pair: shared-doc's
prompts are one document plus each request's own question, the bench runs every offloading
mode with prefix sharing off and on (the flag reaching each engine) and writes its fields;
shared-system is the multi-turn workload with one context for every conversation."""

from __future__ import annotations

import json
from typing import Any

from specstream import LLM
from specstream.bench import shared
from specstream.bench.multiturn import MultiTurnWorkload, build_conversations
from specstream.bench.shared import SharedDocWorkload
from specstream.cli import main

TINY = ["--context-len", "200", "--num-requests", "3", "--output-len", "8", "--block-size",
        "16", "--chunk-tokens", "64", "--resident-tail-tokens", "32", "--offload-after-tokens",
        "64", "--link-gbps", "2", "--device-kv-bytes", "1600000"]


def test_shared_doc_prompts_are_one_document_and_own_questions():
    w = SharedDocWorkload(num_requests=4, doc_len=100, own_len=12, output_len=6)
    prompts = w.prompts(None, 96, seed=0)
    assert [len(p) for p in prompts] == [112] * 4
    assert len({tuple(p[:100]) for p in prompts}) == 1  # one document
    assert len({tuple(p[100:]) for p in prompts}) == 4  # each its own question
    assert w.unique_tokens == 100 + 4 * (12 + 6)
    assert w.kv_workload().context_lengths == (112,) * 4


def test_shared_system_conversations_open_with_one_context():
    w = MultiTurnWorkload(3, 2, 50, 8, 4, shared_context=True)
    convs = build_conversations(w, None, 96, seed=0)
    assert len({tuple(c.context) for c in convs}) == 1
    assert len({tuple(c.messages[0]) for c in convs}) == 3
    assert w.unique_tokens == 3 * w.history_len - 2 * 50


def test_shared_doc_bench_runs_every_offloading_mode_with_sharing_off_and_on(
    tiny_target, tiny_draft, tmp_path, monkeypatch
):
    seen: list[tuple[str, bool]] = []
    real = shared.open_llm

    def recording(mode: str, s: Any, trace: bool = False) -> LLM:
        llm = real(mode, s, trace)
        seen.append((mode, llm.config.prefix_sharing))
        return llm

    monkeypatch.setattr(shared, "open_llm", recording)
    out = tmp_path / "shared.json"
    rc = main(["bench", "--workload", "shared-doc", "--own-len", "20", "--model",
               str(tiny_target), "--draft-model", str(tiny_draft), *TINY, "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    offloading = ("offload", "offload-spec", "specstream", "parallel-spec")
    assert sorted(seen) == sorted([("resident", False)]
                                  + [(m, on) for m in offloading for on in (False, True)])
    assert report["workload"]["workload"] == "shared-doc"
    assert report["workload"]["unique_tokens"] == 200 + 3 * (20 + 8)
    assert "--workload shared-doc" in report["command"] and "--own-len 20" in report["command"]
    assert set(report["modes"]) == set(offloading)
    for mode, runs in report["modes"].items():
        assert set(runs) == {"off", "on"}
        for sharing, r in runs.items():
            assert r["prefix_sharing"] == sharing and r["outputs_match_reference"] is True
            assert r["link_bytes_unique_per_round"] <= r["link_bytes_per_round"] + 1e-9
        assert runs["on"]["host_kv_peak_bytes"] < runs["off"]["host_kv_peak_bytes"]
        assert f"{mode}_sharing_on_over_off" in report["ratios"]
