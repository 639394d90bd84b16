"""Constraints as users spell them (OpenAI's response_format, vLLM's structured_outputs, SGLang's
json_schema / regex / ebnf), compiled once each into an llguidance grammar.

Compilation checks the grammar against the tokenizer, so a grammar the library rejects fails
here, before the request is admitted, with the library's message (a 400 over HTTP)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import llguidance

# The spellings a Constraint takes: vLLM's structured_outputs keys and SGLang's request fields
# map onto these ("ebnf" and "grammar" are GBNF or Lark text; "json_object" any JSON object).
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "ebnf", "lark")
# JSON as json.dumps writes it: ", " and ": ", no other whitespace (a free choice of whitespace
# lets a small model pad an object with blanks until max_tokens); a schema's "x-guidance"
# options override it.
JSON_LAYOUT: Any = {  # llguidance.JsonCompileOptions (a TypedDict of its stubs only)
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint the grammar library rejects, or one spelled in no form it knows."""


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint. ``spec``: the schema as JSON text (``json_schema``), the
    pattern (``regex``), the choices as a JSON list of strings (``choice``), the grammar text
    (``grammar``, ``ebnf``, ``lark``), or "" (``json_object``)."""

    kind: str
    spec: str = ""
    # The request field it came from (an HTTP 400 names it); not part of its identity.
    source: str = field(default="", compare=False)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, source: str = "") -> Constraint:
        text = schema if isinstance(schema, str) else json.dumps(schema)  # its key order kept
        return cls("json_schema", text, source)

    @classmethod
    def choice(cls, options: list[str], source: str = "") -> Constraint:
        if not options or not all(isinstance(o, str) for o in options):
            raise GrammarError("a choice constraint needs a non-empty list of strings")
        return cls("choice", json.dumps(options), source)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown constraint kind {self.kind!r}; one of {', '.join(KINDS)}")


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked against a tokenizer)."""
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind in ("json_object", "json_schema"):
            text = '{"type": "object"}' if kind == "json_object" else spec
            json.loads(text)
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
        if kind == "lark":
            return llguidance.grammar_from("lark", spec)
        if kind in ("grammar", "ebnf"):
            return llguidance.grammar_from("ebnf", spec)
        if kind == "choice":
            return llguidance.grammar_from("choice", spec)
        return llguidance.grammar_from("regex", spec)
    except (ValueError, TypeError) as err:  # json.JSONDecodeError is a ValueError
        raise GrammarError(f"invalid {kind} constraint: {err}") from err


@lru_cache(maxsize=256)
def compile_constraint(constraint: Constraint, tokenizer: llguidance.LLTokenizer) -> str:
    """The checked grammar of ``constraint`` for ``tokenizer``, cached: a schema that many
    requests send is compiled once. Raises GrammarError with the library's message."""
    grammar = grammar_text(constraint)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise GrammarError(f"invalid {constraint.kind} constraint: {messages[0]}")
    return grammar


@lru_cache(maxsize=8)
def grammar_tokenizer(tokenizer_json: str, eos_token_ids: tuple[int, ...],
                      vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """The grammar library's view of a tokenizer (tokenizer.json text), built once (about a
    second for a 150K vocabulary). ``vocab_size``: the model's logits width where it pads the
    tokenizer's vocabulary."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                  eos_token=list(eos_token_ids) or None)
