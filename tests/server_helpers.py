"""The live-server fixtures of the server tests: a tiny random Qwen3 with a trained byte-level
BPE tokenizer and chat template, a uvicorn server over it in a background thread, and parsing
of its Prometheus text.

``test_server.py`` re-exports these names for the tests that import them from there.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from specstream import LLM, SamplingParams

MODEL = "tiny"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
# n-gram speculation on: verification is lossless, so greedy text must still match offline
ENGINE = dict(device_kv_bytes=4_000_000, block_size=16, max_prefill_tokens=256, proposer="ngram",
              num_speculative_tokens=3)
PROMPTS = ["def step(self):", "The engine", "import torch\n", "class Scheduler:",
           "return self.", "# KV blocks", "for req in", "async def"]
# the same template, also reading a chat_template_kwargs variable (the live server of
# test_openai_params.py and the template file of test_serve_cli.py)
GREETING_TEMPLATE = CHAT_TEMPLATE + "{% if greeting %}{{ greeting }}{% endif %}"


def build_chat_model(folder: Path) -> Path:
    """A random 2-layer Qwen3 with a 512-token BPE trained on a fixed snapshot of this repo's
    scheduler source (examples/long_prompt.txt: the live sources change with every edit, and
    with them the tokenizer and what the random model says)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    snapshot = Path(__file__).resolve().parents[1] / "examples" / "long_prompt.txt"
    lines = snapshot.read_text().splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=512, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}))
    torch.manual_seed(0)
    eos = tok.token_to_id("<|endoftext|>")
    cfg = Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, max_position_embeddings=2048,
                      initializer_range=0.2, tie_word_embeddings=False, eos_token_id=eos,
                      bos_token_id=eos, pad_token_id=eos)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.getbasetemp() / "server-model")


class LiveServer:
    """uvicorn serving ``build_app(llm, config)`` on a free loopback port, in a thread."""

    def __init__(self, llm: LLM, **config: Any) -> None:
        import uvicorn

        from specstream.server.app import ServerConfig, build_app

        self.llm = llm
        self.app = build_app(llm, ServerConfig(model_name=MODEL, **config))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, args=([self.sock],), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    @property
    def engine(self) -> Any:
        return self.app.state.engine

    def client(self, **kw: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "x"),
                             max_retries=0, **kw)

    def async_client(self, **kw: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, **kw)

    def metric(self, name: str) -> float:
        """The sum of the samples whose ``name{labels}`` key (see ``parse_metrics``) starts
        with ``name``."""
        samples = parse_metrics(httpx.get(self.url + "/metrics").text)
        return sum(v for k, v in samples.items() if k.startswith(name))

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.llm.close()


def parse_metrics(text: str, model: str = MODEL) -> dict[str, float]:
    """Prometheus text (parsed by prometheus-client, so it must be valid) as a dict keyed
    ``name{label="value",...}``, labels sorted; every sample must carry ``model_name=model``,
    which the keys leave out, as they leave out vLLM's ``engine`` label (always "0" here)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name", None) == model, s
            assert labels.pop("engine", "0") == "0", s
            inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out[s.name + (f"{{{inner}}}" if inner else "")] = s.value
    return out


def greedy(llm: LLM, prompts: list[Any], max_tokens: int) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
