"""vLLM's spellings on the command line and in ``LLM(...)``: the flags map onto the engine's
settings (sizes in vLLM's units), ``speculative_config`` and prompt dicts work, and what cannot
be honoured is refused with a message that says why."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from typing import Any

import pytest

from specstream import LLM, SamplingParams
from specstream.cli import build_parser, engine_kwargs, human_readable_int, main
from specstream.config import EngineConfig, GiB, detect_device
from specstream.llm import _apply_speculative_config, default_model_dir
from specstream.speculative_config import engine_fields

PROMPT = "def step(self):"


def engine_options(*argv: str) -> dict[str, Any]:
    return engine_kwargs(build_parser().parse_args(["generate", "--prompt", "x", *argv]))


@pytest.mark.parametrize("argv, enabled", [
    ([], None), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False),
    (["--no-prefix-caching"], False),
])
def test_prefix_caching_flags(argv: list[str], enabled: bool | None) -> None:
    assert engine_options(*argv).get("enable_prefix_caching") == enabled


def test_sizes_take_vllms_units_and_bytes_stay_bytes() -> None:
    assert engine_options("--kv-offloading-size", "0.5")["host_kv_bytes"] == GiB // 2
    assert engine_options("--host-kv-bytes", "1e7")["host_kv_bytes"] == 10_000_000
    assert engine_options("--device-kv-bytes", "5e7")["device_kv_bytes"] == 50_000_000
    # both given: they must say the same
    same = engine_options("--kv-offloading-size", "2", "--host-kv-bytes", str(2 * GiB))
    assert same["host_kv_bytes"] == 2 * GiB
    with pytest.raises(ValueError, match="--kv-offloading-size 2 .* --host-kv-bytes"):
        engine_options("--kv-offloading-size", "2", "--host-kv-bytes", "1e9")


@pytest.mark.parametrize("text, tokens", [
    ("32768", 32768), ("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("2m", 2_000_000),
    ("4M", 4 * 2**20),
])
def test_token_counts_read_as_vllm_reads_them(text: str, tokens: int) -> None:
    assert human_readable_int(text) == tokens
    assert engine_options("--max-model-len", text)["max_model_len"] == tokens


@pytest.mark.parametrize("text", ["1.5K", "12q", "", "k"])
def test_a_bad_token_count_is_an_argparse_error(text: str, capsys: Any) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)
    with pytest.raises(SystemExit):
        engine_options("--max-model-len", text)
    assert "--max-model-len" in capsys.readouterr().err


def test_max_num_batched_tokens_is_the_prefill_budget() -> None:
    assert engine_options("--max-num-batched-tokens", "2k")["max_prefill_tokens"] == 2000
    both = engine_options("--max-num-batched-tokens", "512", "--max-prefill-tokens", "512")
    assert both["max_prefill_tokens"] == 512
    with pytest.raises(ValueError, match="--max-prefill-tokens"):
        engine_options("--max-num-batched-tokens", "512", "--max-prefill-tokens", "256")
    assert main(["generate", "--prompt", "x", "--max-num-batched-tokens", "512",
                 "--max-prefill-tokens", "256"]) == 2  # a clear error, exit 2


def test_seed_and_device_reach_the_engine() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "x", "--seed", "3"])
    assert args.seed == 3 and engine_options("--seed", "3")["seed"] == 3
    assert "seed" not in engine_options()  # EngineConfig's default stays
    # --device defaults to auto, which the config resolves as torch sees the machine
    assert engine_options()["device"] == "auto"
    assert EngineConfig(device="auto").device == detect_device()
    serve = build_parser().parse_args(["serve", "--seed", "9", "--max-model-len", "4k"])
    assert (serve.seed, serve.max_model_len, serve.device) == (9, 4000, "auto")


def test_bench_resolves_auto_before_it_looks_at_the_device() -> None:
    from specstream.bench.cli import settings_from

    args = build_parser().parse_args(["bench"])
    assert args.device == "auto"
    s = settings_from(args)
    assert s.device == detect_device()
    assert s.link_gbps == (None if s.device.startswith("cuda") else args.link_gbps)
    assert settings_from(build_parser().parse_args(["bench", "--device", "cpu"])).link_gbps \
        == args.link_gbps


# ---- speculative_config ---------------------------------------------------------------------
def test_speculative_config_maps_vllms_keys() -> None:
    assert engine_fields({"method": "ngram", "num_speculative_tokens": 3,
                          "prompt_lookup_min": 1, "prompt_lookup_max": 4}) == {
        "proposer": "ngram", "draft_model": None, "num_speculative_tokens": 3}
    assert engine_fields({"model": "d", "draft_tensor_parallel_size": 1}) == {
        "proposer": "draft", "draft_model": "d", "num_speculative_tokens": None}
    kwargs: dict[str, Any] = {}
    assert _apply_speculative_config({"method": "draft_model", "model": "d",
                                      "num_speculative_tokens": 2}, None, kwargs) == "d"
    assert kwargs == {"proposer": "draft", "num_speculative_tokens": 2}


@pytest.mark.parametrize("cfg, message", [
    ({"method": "eagle", "model": "d"}, "'eagle' is not built here"),
    ({"method": "ngram", "prompt_lookup_max": 7}, "prompt_lookup_max 7 cannot be honoured"),
    ({"method": "ngram", "model": "d"}, "takes no"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "integer >= 1"),
    ({"method": "ngram", "tensor_parallel_size": 2}, "tensor_parallel_size 2 cannot be"),
    ({"method": "ngram", "speculative_token_tree": "[]"}, "unknown speculative_config key"),
    ({}, 'give "method"'),
])
def test_speculative_config_refuses_what_it_cannot_honour(cfg: dict[str, Any],
                                                          message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(speculative_config=cfg)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_speculative_tokens": 2}, "num_speculative_tokens=3 but num_speculative_tokens=2"),
    ({"proposer": "draft"}, "proposer='ngram' but proposer='draft'"),
    ({"draft_model": "elsewhere"}, "method ngram but draft_model"),
])
def test_speculative_config_must_agree_with_the_keywords(kwargs: dict[str, Any],
                                                         message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **kwargs)


@pytest.mark.parametrize("size, message", [(8, "do not split over 8 ranks"),
                                           (True, "must be an integer"), (0, "must be > 0")])
def test_tensor_parallel_sizes_the_model_cannot_take(size: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(tensor_parallel_size=size)  # TP 2 itself: tests/test_tensor_parallel_engine.py


# ---- LLM(...) with vLLM's keywords ----------------------------------------------------------
@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    out = LLM(model=default_model_dir(), seed=3, max_model_len=512, enable_prefix_caching=False,
              tensor_parallel_size=1, device_kv_bytes=50_000_000, speculative_policy="fixed",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    yield out
    out.close()


def test_vllm_keywords_reach_the_config(llm: LLM) -> None:
    cfg = llm.config
    assert (cfg.seed, cfg.max_model_len, cfg.enable_prefix_caching) == (3, 512, False)
    assert (cfg.proposer, cfg.num_speculative_tokens) == ("ngram", 3)
    assert llm.engine.max_model_len == 512


def test_prompt_dicts_as_vllms(llm: LLM) -> None:
    ids = llm.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=8)
    plain = llm.generate([PROMPT, ids], params, use_tqdm=False)
    dicts = llm.generate([{"prompt": PROMPT}, {"prompt_token_ids": ids}],
                         sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert [o.prompt for o in dicts] == [PROMPT, None]
    assert [o.prompt_token_ids for o in dicts] == [ids, ids]
    one = llm.generate({"prompt_token_ids": ids, "prompt": PROMPT}, params, use_tqdm=False)
    assert len(one) == 1 and one[0].prompt == PROMPT
    assert one[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    # text that repeats, so the n-gram proposer finds matches to draft from
    llm.generate(PROMPT * 4, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert llm.get_metrics()["proposed_tokens"] > 0  # the n-gram proposer drafted
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {}}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="needs"):
        llm.generate([{}], params, use_tqdm=False)  # type: ignore[list-item]


def test_generate_seed_seeds_the_engine_and_the_request(llm: LLM, capsys: Any) -> None:
    argv = ["generate", "--prompt", PROMPT, "--max-tokens", "12", "--temperature", "2",
            "--device-kv-bytes", "5e7", "--json",  # the fixture's speculation: a seeded
            "--proposer", "ngram", "-q", "3", "--speculative-policy", "fixed"]  # draw follows it
    assert main([*argv, "--seed", "3"]) == 0
    cli = json.loads(capsys.readouterr().out)["token_ids"]

    def sampled(seed: int) -> list[int]:
        params = SamplingParams(temperature=2.0, max_tokens=12, seed=seed)
        return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids

    assert cli == sampled(3)  # the request's own generator, seeded 3
    assert cli != sampled(4)


def test_a_flag_on_the_command_line_wins_over_the_preset() -> None:
    """--preset link-bound sets the link, the residency, the output length and the staging
    ring where the command line does not; a flag given wins (--residency fill with it runs
    fill, as a user asking for it expects)."""
    from specstream.bench.cli import DEFAULT_LINK_GBPS, settings_from

    def settings(*words: str) -> Any:
        return settings_from(build_parser().parse_args(["bench", "--device", "cpu", *words]))

    plain, preset = settings(), settings("--preset", "link-bound")
    assert (plain.residency, plain.link_gbps) == ("fill", DEFAULT_LINK_GBPS)
    assert (preset.residency, preset.link_gbps, preset.staging_buffers) == ("tail", 0.1, 4)
    mine = settings("--preset", "link-bound", "--residency", "fill", "--staging-buffers", "2")
    assert (mine.residency, mine.link_gbps, mine.staging_buffers) == ("fill", 0.1, 2)
