"""``specstream serve``'s command line: vLLM's spellings (positional MODEL,
--speculative-config and its keys, --generation-config, --chat-template,
--enable-prompt-tokens-details), the errors that exit with 2 before any engine is built, and
the options reaching the ServerConfig (engine and uvicorn stubbed out)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from server_helpers import GREETING_TEMPLATE  # noqa: E402


def serve_args(*argv: str) -> argparse.Namespace:
    from specstream.server.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize("config, flags, want", [
    ('{"method": "draft_model", "model": "d", "num_speculative_tokens": 3}', [], ("draft", "d", 3)),
    ('{"method": "draft", "num_speculative_tokens": 2}', [], ("draft", None, 2)),
    ('{"method": "ngram", "num_speculative_tokens": 5}', ["--proposer", "ngram"],
     ("ngram", None, 5)),
    ('{"model": "d"}', ["-q", "2", "--draft-model", "d"], ("draft", "d", 2)),
])
def test_speculative_config_maps_to_the_engine_flags(config: str, flags: list[str],
                                                     want: tuple[Any, ...]) -> None:
    from specstream.cli import engine_kwargs
    from specstream.server.cli import apply_speculative_config

    args = apply_speculative_config(serve_args("--speculative-config", config, *flags))
    assert (args.proposer, args.draft_model, args.num_speculative_tokens) == want
    kw = engine_kwargs(args)
    assert (kw["proposer"], kw["num_speculative_tokens"]) == (want[0], want[2])


@pytest.mark.parametrize("argv, message", [
    (["--speculative-config", "{bad"], "not valid JSON"),
    (["--speculative-config", "[1]"], "must be a JSON object"),
    (["--speculative-config", '{"method": "eagle"}'], "unknown method 'eagle'"),
    (["--speculative-config", '{"num_speculative_tokens": 4}'], 'give "method"'),
    (["--speculative-config", '{"method": "ngram", "prompt_lookup_max": 5}'],
     "prompt_lookup_max 5 cannot be honoured"),  # 4, the proposer's own, is accepted
    (["--speculative-config", '{"method": "ngram", "prompt_lookup_maximum": 4}'],
     "unknown key(s) 'prompt_lookup_maximum'"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
     "num_speculative_tokens"),
    (["--speculative-config", '{"method": "ngram", "model": "d"}'], "takes no"),
    (["--speculative-config", '{"method": "ngram"}', "--proposer", "draft"],
     "--proposer says 'draft'"),
    (["--speculative-config", '{"method": "draft", "num_speculative_tokens": 4}', "-q", "2"],
     "-q says 2"),
    (["--speculative-config", '{"model": "a"}', "--draft-model", "b"], "--draft-model says 'b'"),
    (["--speculative-config", '{"method": "ngram"}', "--draft-model", "b"], "method ngram"),
])
def test_bad_speculative_config_exits_with_2(argv: list[str], message: str,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    import specstream.server.cli
    from specstream.cli import main

    def never(*args: Any, **kw: Any) -> None:
        raise AssertionError("the error must come before the engine is built")

    monkeypatch.setattr(specstream.server.cli, "build_llm", never)
    try:
        rc = main(["serve", *argv])
    except SystemExit as exc:  # argparse's own error exit
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


def test_serve_command_defaults_to_loopback() -> None:
    import argparse

    from specstream.server.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--api-key", "k", "--mode", "stream"])
    assert (args.host, args.port, args.api_key, args.mode) == ("127.0.0.1", 8000, "k", "stream")
    assert args.func.__name__ == "run_serve"


def test_positional_model_and_vllm_flags(tmp_path: Path) -> None:
    from specstream.server.cli import apply_speculative_config

    args = apply_speculative_config(serve_args(str(tmp_path), "--enable-prompt-tokens-details"))
    assert args.model == str(tmp_path) and args.enable_prompt_tokens_details
    same = apply_speculative_config(serve_args(str(tmp_path), "--model", str(tmp_path)))
    assert same.model == str(tmp_path)
    with pytest.raises(ValueError, match="given twice"):
        apply_speculative_config(serve_args(str(tmp_path), "--model", str(tmp_path / "x")))
    assert serve_args().generation_config == "auto"  # vLLM's default


@pytest.mark.parametrize("config, want", [
    ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}',
     ("ngram", None, 5)),  # vLLM's documented example
    ('{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}', ("ngram", None, None)),
    ('{"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1, '
     '"max_model_len": null, "disable_by_batch_size": null, "enforce_eager": true}',
     ("draft", "d", 2)),
])
def test_speculative_config_takes_vllms_keys(config: str, want: tuple[Any, ...]) -> None:
    from specstream.server.cli import apply_speculative_config

    args = apply_speculative_config(serve_args("--speculative-config", config))
    assert (args.proposer, args.draft_model, args.num_speculative_tokens) == want


@pytest.mark.parametrize("config, message", [
    ('{"method": "ngram", "prompt_lookup_min": 2}', "prompt_lookup_min 2 cannot be honoured"),
    ('{"method": "ngram", "prompt_lookup_max": 5}', "longest earlier match of the last 1 to 4"),
    ('{"model": "d", "draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size 2"),
    ('{"model": "d", "max_model_len": 512}', "max_model_len 512 cannot be honoured"),
    ('{"model": "d", "quantization": "fp8"}', 'quantization "fp8" cannot be honoured'),
])
def test_speculative_config_says_what_it_cannot_honour(config: str, message: str) -> None:
    from specstream.server.cli import speculative_config

    with pytest.raises(argparse.ArgumentTypeError) as err:
        speculative_config(config)
    assert message in str(err.value)


def test_generation_config_and_chat_template_options(tmp_path: Path) -> None:
    from specstream.server.cli import generation_defaults, load_chat_template

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_new_tokens": 64,
         "do_sample": True, "eos_token_id": 2}))
    want = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_tokens": 64}
    assert generation_defaults("auto", str(tmp_path)) == want
    assert generation_defaults(str(tmp_path), None) == want  # DIR
    assert generation_defaults("vllm", str(tmp_path)) == {}
    assert generation_defaults("auto", str(tmp_path / "none")) == {}  # no file: no defaults
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(str(tmp_path / "none"), None)
    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match="temperature"):
        generation_defaults("auto", str(tmp_path))
    file = tmp_path / "t.jinja"
    file.write_text("{{ messages[0]['content'] }}é")
    assert load_chat_template(str(file)) == "{{ messages[0]['content'] }}é"
    assert load_chat_template("{% for m in messages %}{{ m.content }}\\n{% endfor %}") == \
        "{% for m in messages %}{{ m.content }}\n{% endfor %}"  # shell escapes, as vLLM
    with pytest.raises(ValueError, match="neither a file nor a template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_serve_passes_the_options_to_the_server(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``specstream serve MODEL --chat-template ... --generation-config auto ...`` reaches
    the engine's model and the ServerConfig (engine and uvicorn stubbed out)."""
    import uvicorn

    import specstream.server.app
    import specstream.server.cli
    from specstream.cli import main

    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "generation_config.json").write_text('{"temperature": 0.3, "max_new_tokens": 9}')
    (tmp_path / "t.jinja").write_text(GREETING_TEMPLATE)
    seen: dict[str, Any] = {}

    class Stub:
        def close(self) -> None:
            seen["closed"] = True

    def build_llm(args: argparse.Namespace) -> Stub:
        seen["model"] = args.model
        return Stub()

    monkeypatch.setattr(specstream.server.cli, "build_llm", build_llm)
    monkeypatch.setattr(specstream.server.app, "build_app",
                        lambda llm, config: seen.setdefault("config", config))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    rc = main(["serve", str(folder), "--chat-template", str(tmp_path / "t.jinja"),
               "--enable-prompt-tokens-details"])
    config = seen["config"]
    assert rc == 0 and seen["model"] == str(folder) and seen["closed"]
    assert config.model_name == "my-model" and config.chat_template == GREETING_TEMPLATE
    assert dict(config.default_sampling) == {"temperature": 0.3, "max_tokens": 9}
    assert config.enable_prompt_tokens_details
    seen.clear()
    assert main(["serve", str(folder), "--generation-config", "vllm"]) == 0
    assert dict(seen["config"].default_sampling) == {} and seen["config"].chat_template is None
