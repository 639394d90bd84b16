"""The command line: the README's main job shows the system at work; errors and help are clear."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from specstream.cli import build_parser, main

# The README's main job prompts with this file: ~6.3K tokens, past the embedded model's
# offload threshold (a quarter of its 8K context), so history really streams.
MAIN_JOB_PROMPT = Path(__file__).resolve().parents[1] / "examples" / "long_prompt.txt"


def test_main_job_offloads_streams_and_speculates(capsys):
    rc = main(["generate", "--mode", "specstream", "--prompt-file", str(MAIN_JOB_PROMPT),
               "--max-tokens", "24"])
    assert rc == 0
    err = capsys.readouterr().err
    summary = err[err.index("[24 tokens from a"):]
    assert "mode          specstream" in summary and "draft proposer" in summary
    for line in ("speculation", "link", "KV peaks"):
        assert f"  {line}" in summary


def test_main_job_json_figures(capsys):
    rc = main(["generate", "--mode", "specstream", "--prompt-file", str(MAIN_JOB_PROMPT),
               "--max-tokens", "64", "--device-kv-bytes", "2.5e7", "--json"])
    assert rc == 0
    record = json.loads(capsys.readouterr().out)
    m = record["metrics"]
    assert len(record["token_ids"]) == 64
    # about half of the prompt's KV fits: all of it written through, the rest streamed
    assert m["link_bytes_h2d"] > 0 and m["link_bytes_d2h"] > 0
    assert 0 < m["link_bytes_per_round"] <= 1.1 * m["link_bytes_floor_per_round"]
    assert m["host_kv_peak_bytes"] > 0
    # drafts were verified (auto always probes; how deep it then drafts depends on timing)
    assert m["proposed_tokens"] > 0 and m["mean_accepted_len"] >= 1.0


@pytest.mark.parametrize("argv, message", [
    (["--mode", "offload", "--proposer", "ngram", "-q", "4"], "does not speculate"),
    (["--mode", "specstream", "--proposer", "draft", "--device-kv-bytes", "1e5"],
     "device_kv_bytes"),
    (["--device", "cuda"], "CUDA"),
])
def test_bad_options_exit_2_with_a_message(argv, message, capsys):
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("checks the no-GPU message")
    assert main(["generate", "--prompt", "x", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specstream: error:") and message in err


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_every_flag_says_what_it_does_and_its_default(command):
    p = _subparsers()[command]
    fmt = p._get_formatter()
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{command} {action.option_strings[0]} has no help"
        assert "default" in fmt._expand_help(action), (
            f"{command} {action.option_strings[0]}: --help shows no default")
