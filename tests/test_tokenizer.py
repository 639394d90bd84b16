"""specstream.tokenizer.Tokenizer against transformers.AutoTokenizer on a small trained BPE."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specstream.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]

# Qwen-style: system prompt default, tool list through tojson (non-ASCII, '<' and key order must
# survive as transformers renders them), raise_exception on a bad role, generation prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful. "
    "{{ {'zeta': 'é<b>', 'alpha': 1} | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "héllo wörld, ça va? 你好，世界 🙂 tabs\tand\nnewlines",
    "def f(x):\n    return x * 2  # code too",
]

TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "héllo 你好 🙂 unseen: Ωmega ∑",
    "special <|im_start|>inside<|im_end|> text",
    "line\n\nbreaks\tand   runs of spaces",
    "",
]


def _make_tokenizer(folder: Path, bos_post_processor: bool) -> Path:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    if bos_post_processor:  # Llama-3 style: the tokenizer itself prepends BOS
        bos_id = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
        )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {  # the AddedToken dict form older configs use
            "__type": "AddedToken", "content": "<|im_end|>", "lstrip": False,
            "normalized": False, "rstrip": False, "single_word": False, "special": True,
        },
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "bos-post-processor"])
def folders(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    folder = _make_tokenizer(tmp_path_factory.mktemp("tok"), request.param)
    return Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder)), request.param


def test_encode_decode_match_transformers(folders: Any) -> None:
    ours, hf, bos_added = folders
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
            assert (ids[:1] == [ours.bos_token_id]) == (bos_added and special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip
                ), (text, skip)
        plain = ours.encode(text, add_special_tokens=False)
        assert ours.decode(plain, skip_special_tokens=False) == text  # byte-level round trip
    assert ours.vocab_size == len(hf)


def test_special_token_ids(folders: Any) -> None:
    ours, hf, _ = folders
    assert ours.bos_token == "<s>" and ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == hf.eos_token_id
    assert ours.eos_token_id is not None


@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_matches_transformers(folders: Any, gen_prompt: bool) -> None:
    ours, hf, _ = folders
    conversations = [
        [{"role": "user", "content": "Hi there <b>!"}],
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "  2+2?  "},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "你好 🙂"},
        ],
    ]
    for messages in conversations:
        want = hf.apply_chat_template(messages, add_generation_prompt=gen_prompt, tokenize=False)
        got = ours.apply_chat_template(messages, add_generation_prompt=gen_prompt)
        assert got == want
        assert got.endswith("<|im_start|>assistant\n") == gen_prompt
    assert '"zeta": "é<b>"' in ours.apply_chat_template(conversations[0])


def test_chat_template_errors(folders: Any) -> None:
    from jinja2.exceptions import TemplateError

    ours, _, _ = folders
    with pytest.raises(TemplateError, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="role"):
        ours.apply_chat_template([{"content": "no role"}])


def test_template_file_and_missing_template(tmp_path: Path) -> None:
    folder = _make_tokenizer(tmp_path / "t", bos_post_processor=False)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="chat_template"):
        Tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}])
    template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    (folder / "chat_template.jinja").write_text(template)
    assert Tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_missing_tokenizer_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path)
