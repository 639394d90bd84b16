"""Grammar-constrained decoding (structured outputs): constraints compiled by llguidance, and
per-position token masks for speculative rounds (chains and trees) that roll back exactly."""

from specstream.structured.grammar import (
    Constraint,
    GrammarError,
    compile_constraint,
    grammar_tokenizer,
)
from specstream.structured.matcher import Matcher, chain_masks, mask_logits, tree_masks

__all__ = [
    "Constraint",
    "GrammarError",
    "Matcher",
    "chain_masks",
    "compile_constraint",
    "grammar_tokenizer",
    "mask_logits",
    "tree_masks",
]
