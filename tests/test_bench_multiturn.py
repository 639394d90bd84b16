"""The multi-turn workload (specstream/bench/multiturn.py) on the tiny pair: every turn's prompt
is the previous prompt + output + a new message, the bench runs every mode with the prefix cache
on and off and writes its fields, --no-prefix-caching reaches the engine's config, and
bench/serve_load.py drives conversations through the server."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from specstream import LLM
from specstream.bench import multiturn
from specstream.bench.cli import settings_from
from specstream.bench.multiturn import MultiTurnWorkload, build_conversations, converse
from specstream.cli import build_parser, main
from specstream.sampling_params import SamplingParams
from specstream.tokenizer import Tokenizer

TINY = ["--context-len", "200", "--num-requests", "3", "--turns", "3", "--message-len", "16",
        "--output-len", "8", "--block-size", "16", "--chunk-tokens", "64",
        "--resident-tail-tokens", "64", "--offload-after-tokens", "64", "--link-gbps", "2",
        "--device-kv-bytes", "1600000"]
FIELDS = ("output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "ttft_ms_p50_by_turn",
          "mean_accepted_len", "prompt_tokens", "prefill_tokens", "prefix_cache_queries",
          "prefix_cache_hits", "prefix_cache_hit_rate", "prefix_cache_hits_by_tier",
          "prefix_cache_blocks", "outputs_match_reference", "outputs_match_cache_off")


def check_history(w: MultiTurnWorkload, conv: multiturn.Conversation) -> None:
    """Turn k+1's prompt is turn k's prompt + output + that turn's message, at the lengths the
    workload promises."""
    assert conv.done and len(conv.prompts) == w.turns
    assert conv.prompts[0] == conv.context + conv.messages[0]
    for k, prompt in enumerate(conv.prompts):
        assert len(prompt) == w.prompt_len(k) and len(conv.outputs[k]) == w.output_len
        if k:
            assert prompt == conv.prompts[k - 1] + conv.outputs[k - 1] + conv.messages[k]


def test_every_turn_resends_the_history_as_token_ids(tiny_target):
    w = MultiTurnWorkload(num_conversations=3, turns=3, context_len=100, message_len=12,
                          output_len=6)
    assert w.prompt_len(0) == 112 and w.prompt_len(2) == 100 + 3 * 12 + 2 * 6
    assert w.history_len == w.prompt_len(2) + 6
    assert w.kv_workload().context_lengths == (w.prompt_len(2),) * 3
    llm = LLM(str(tiny_target), mode="resident", device_kv_bytes=4_000_000, block_size=16)
    try:
        convs = build_conversations(w, None, llm.engine.model_config.vocab_size, seed=0)
        turns = converse(llm, convs, SamplingParams(temperature=0, max_tokens=6,
                                                    ignore_eos=True))
    finally:
        llm.close()
    assert len({tuple(c.context) for c in convs}) == 3  # each conversation its own context
    for conv in convs:
        check_history(w, conv)
    # one result per turn, each conversation's in order, with the prompt the engine was given
    assert len(turns) == 9
    for c in range(3):
        mine = [t for t in turns if t.conversation == c]
        assert [t.turn for t in mine] == [0, 1, 2]
        assert [t.prompt_tokens for t in mine] == [w.prompt_len(k) for k in range(3)]


def test_messages_are_held_out_text():
    from specstream.llm import default_model_dir

    tok = Tokenizer(default_model_dir("target"))
    w = MultiTurnWorkload(num_conversations=2, turns=4, context_len=300, message_len=64,
                          output_len=8)
    convs = build_conversations(w, tok, 4096, seed=0)
    assert [len(c.context) for c in convs] == [300, 300]
    assert all(len(m) == 64 for c in convs for m in c.messages)
    assert len({tuple(m) for c in convs for m in c.messages}) == 8  # all different
    assert convs[0].messages == build_conversations(w, tok, 4096, seed=0)[0].messages


def test_multiturn_bench_runs_every_mode_with_and_without_the_cache(
    tiny_target, tiny_draft, tmp_path, monkeypatch
):
    seen: list[tuple[str, bool]] = []
    real = multiturn.open_llm

    def recording(mode: str, s: Any, trace: bool = False) -> LLM:
        llm = real(mode, s, trace)
        seen.append((mode, llm.config.enable_prefix_caching))
        return llm

    monkeypatch.setattr(multiturn, "open_llm", recording)
    out = tmp_path / "multiturn.json"
    rc = main(["bench", "--workload", "multiturn", "--model", str(tiny_target),
               "--draft-model", str(tiny_draft), *TINY, "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    modes = ("resident", "offload", "offload-spec", "specstream", "parallel-spec")
    # the flag reached every engine: each mode ran once with the cache and once without (the
    # resident run without it is the reference)
    assert sorted(seen) == sorted((m, on) for m in modes for on in (False, True))
    assert report["workload"] == {"workload": "multiturn", "num_conversations": 3, "turns": 3,
                                  "context_len": 200, "message_len": 16, "output_len": 8,
                                  "first_prompt_len": 216, "last_prompt_len": 264,
                                  "history_len": 272, "unique_tokens": 3 * 272}
    assert report["settings"]["enable_prefix_caching"] is True
    assert report["settings"]["prefix_caching_runs"] == ["off", "on"]
    assert "--workload multiturn" in report["command"]
    assert set(report["modes"]) == set(modes)
    for name, runs in report["modes"].items():
        assert set(runs) == {"off", "on"}, name
        for cache, r in runs.items():
            for f in FIELDS:
                assert f in r, (name, cache, f)
            assert r["prefix_caching"] == cache and r["enable_prefix_caching"] == (cache == "on")
            assert r["requests"] == 9 and r["output_tokens"] == 72
            assert r["prompt_tokens"] == 3 * (216 + 240 + 264)
            assert len(r["ttft_ms_p50_by_turn"]) == 3
            assert r["outputs_match_reference"] is True, (name, cache)
        assert runs["on"]["outputs_match_cache_off"] is True, name
        assert runs["off"]["outputs_match_cache_off"] is None
        # every later turn starts with the previous one's blocks: found with the cache only
        assert runs["off"]["prefix_cache_hits"] == 0
        assert runs["on"]["prefix_cache_hits"] > 0, name
        assert runs["on"]["prefill_tokens"] < runs["off"]["prefill_tokens"], name
        assert runs["off"]["prefill_tokens"] >= runs["off"]["prompt_tokens"]
        for k in ("ttft_p50_off_over_on", "throughput_on_over_off", "accepted_len_on_over_off"):
            assert f"{name}_{k}" in report["ratios"]


def test_no_prefix_caching_runs_only_without_the_cache(tiny_target, tiny_draft, tmp_path,
                                                       monkeypatch):
    parse = build_parser().parse_args
    assert settings_from(parse(["bench"])).engine_kwargs("specstream")[
        "enable_prefix_caching"] is True
    s = settings_from(parse(["bench", "--no-prefix-caching"]))
    assert all(s.engine_kwargs(m)["enable_prefix_caching"] is False
               for m in ("resident", "offload", "specstream"))
    seen: list[bool] = []
    real = multiturn.open_llm
    monkeypatch.setattr(multiturn, "open_llm", lambda mode, s, trace=False: (
        seen.append((llm := real(mode, s, trace)).config.enable_prefix_caching) or llm))
    out = tmp_path / "off.json"
    rc = main(["bench", "--workload", "multiturn", "--model", str(tiny_target),
               "--draft-model", str(tiny_draft), *TINY, "--modes", "resident,specstream",
               "--no-prefix-caching", "--json", str(out)])
    assert rc == 0
    assert seen == [False, False]  # resident (the reference) and specstream, no cache
    report = json.loads(out.read_text())
    assert report["settings"]["enable_prefix_caching"] is False
    assert report["settings"]["prefix_caching_runs"] == ["off"]
    assert "--no-prefix-caching" in report["command"]
    for runs in report["modes"].values():
        assert set(runs) == {"off"} and runs["off"]["prefix_cache_hits"] == 0
        assert runs["off"]["outputs_match_reference"] is True
    assert report["ratios"] == {}


def test_multiturn_refuses_the_single_workloads_sweeps(tiny_target, capsys):
    rc = main(["bench", "--workload", "multiturn", "--model", str(tiny_target), "--ladder"])
    assert rc == 2 and "--workload multiturn runs on its own" in capsys.readouterr().err


def _serve_load() -> Any:
    path = Path(__file__).resolve().parents[1] / "bench" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["serve_load"] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    return bench


def test_serve_load_multiturn_sends_each_turn_after_the_last(tmp_path):
    server = pytest.importorskip("test_server")  # skips without fastapi, uvicorn, openai
    model = server.build_chat_model(tmp_path / "chat")
    live = server.LiveServer(LLM(model, **server.ENGINE))
    bench = _serve_load()
    try:
        argv = ["--base-url", live.url, "--model", server.MODEL, "--tokenizer", str(model),
                "--workload", "multiturn", "--concurrency", "2", "--num-conversations", "3",
                "--turns", "3", "--prompt-len", "64", "--message-len", "16",
                "--output-len", "6"]
        args = bench.parse_args(argv)
        tok = bench.tokenizer_for(args)
        convs = bench.build_conversations(args, tok)
        results, duration, before, after = asyncio.run(bench.run_multiturn(args, convs, tok))
        out = tmp_path / "load.json"
        rc = bench.main([*argv, "--json", str(out)])
    finally:
        live.close()
    assert all(r.ok for r in results) and len(results) == 9
    # every turn answered; each later one re-sent the history: the previous prompt, the
    # previous output's text re-encoded (not empty) and its own message
    assert [r.turn for r in results].count(2) == 3
    for conv in convs:
        assert conv.done and all(conv.outputs)
        for k in (1, 2):
            assert conv.prompts[k] == (conv.prompts[k - 1] + conv.outputs[k - 1]
                                       + conv.messages[k])
    record = json.loads(out.read_text())
    assert rc == 0 and (record["sent"], record["completed"], record["failed"]) == (9, 9, 0)
    assert set(record["ttft_ms_by_turn"]) == {"1", "2", "3"}
    assert all(d["p50"] > 0 for d in record["ttft_ms_by_turn"].values())
    assert record["prefix_cache"]["queries"] > 0 and record["prefix_cache"]["hits"] > 0
    assert record["args"]["workload"] == "multiturn"
