"""Tokenizer from a model folder (tokenizer.json + tokenizer_config.json), offline.

Special tokens (BOS) come from tokenizer.json's post-processor, as in transformers 5. The chat
template is rendered with Jinja2 in a sandbox with the globals and filters transformers gives it,
with transformers' ``continue_final_message`` and extra template variables.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders
from tokenizers.decoders import DecodeStream


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as a dict
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        self._tok = _HFTokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.config = cfg  # tokenizer_config.json as written (served by /tokenizer_info)
        self.chat_template: str | None = _default_template(cfg.get("chat_template"))
        template_file = folder / "chat_template.jinja"
        if self.chat_template is None and template_file.is_file():
            self.chat_template = template_file.read_text()
        # Special tokens the chat template may read (bos_token, eos_token, pad_token, ...).
        self.special_tokens: dict[str, str] = {
            key: tok
            for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                        "cls_token", "mask_token")
            if (tok := _token_str(cfg.get(key))) is not None
        }
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        # byte-level BPE (GPT-2, Llama 3, Qwen): vocabulary strings spell bytes, one char each
        self._byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        self._added = {t.content for t in self._tok.get_added_tokens_decoder().values()}

    def to_json(self) -> str:
        """tokenizer.json as the tokenizers library writes it (the grammar library reads it)."""
        return str(self._tok.to_str())

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The post-processor in tokenizer.json adds BOS where the model wants one (Llama 3);
        # transformers 5 does the same and ignores tokenizer_config's add_bos_token.
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str | None:
        """The vocabulary's own spelling of a token (``Ġthe``); None outside it."""
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> list[int]:
        """The bytes a token stands for (a piece of a UTF-8 character, for byte-level and
        byte-fallback tokens), as OpenAI's logprobs ``bytes`` give them."""
        raw = self._tok.id_to_token(token_id)
        if raw is not None and raw not in self._added:
            if self._byte_level and all(c in _BYTE_OF for c in raw):
                return [_BYTE_OF[c] for c in raw]
            if len(raw) == 6 and raw.startswith("<0x") and raw.endswith(">"):  # byte fallback
                return [int(raw[3:5], 16)]
        return list(self.decode([token_id], skip_special_tokens=False).encode("utf-8"))

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """An incremental decoder (tokenizers' DecodeStream): called with each next token id,
        it returns the text that token adds (None while it ends inside a character), decoding
        only a few tokens each time; the pieces join to ``decode`` of all the ids."""
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda token_id: stream.step(self._tok, token_id)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, *,
        chat_template: str | None = None, continue_final_message: bool = False,
        **variables: Any,
    ) -> str:
        """The conversation as the template renders it. ``chat_template`` replaces the
        tokenizer's; ``variables`` (vLLM's chat_template_kwargs, ``documents``, ...) are given
        to the template; with ``continue_final_message`` the text ends inside the last message
        (its end-of-turn markup cut off), so the model continues it (transformers' rule)."""
        template_text = chat_template or self.chat_template
        if not template_text:
            raise ValueError("this tokenizer has no chat_template; pass a plain prompt instead")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each "
                             "other")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each chat message needs 'role' and 'content', got {m!r}")
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson  # jinja's own escapes HTML and sorts keys
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        template = env.from_string(template_text)
        context = {**self.special_tokens, "tools": None, "documents": None, **variables}
        text = template.render(**context, messages=messages,
                               add_generation_prompt=add_generation_prompt)
        if continue_final_message and messages:
            text = _cut_after_final(text, messages[-1]["content"])
        return text


def _cut_after_final(text: str, final: str) -> str:
    """``text`` up to the end of the final message's content (which the template may have
    stripped of surrounding spaces), leaving out what the template closes the turn with."""
    core = final.strip()
    if not core or core not in text:
        raise ValueError("continue_final_message: the final message's text does not appear in "
                         "the rendered conversation")
    at = text.rindex(core)
    kept = final.lstrip()
    end = at + len(kept) if text[at: at + len(kept)] == kept else at + len(core)
    return text[:end]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the vocabulary char that spells each byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return {c: b for b, c in enumerate(chars)}


_BYTE_OF = _byte_decoder()


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _default_template(value: Any) -> str | None:
    """tokenizer_config may hold one template or a list of named ones; use "default"."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value
