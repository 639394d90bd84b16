"""Grammar-constrained decoding (structured outputs): constraints compiled by llguidance
(``grammar``), a request's matcher and the token masks of speculative rounds, chains and trees,
that roll back exactly (``matcher``), and the worker's matchers (``rounds``).

Only ``grammar`` is imported here: SamplingParams carries a Constraint, and the scheduler's side
imports no torch."""

from specstream.structured.grammar import (
    JSON_LAYOUT,
    Constraint,
    GrammarError,
    compile_constraint,
    grammar_tokenizer,
)

__all__ = ["JSON_LAYOUT", "Constraint", "GrammarError", "compile_constraint", "grammar_tokenizer"]
