"""What the request models accept: strict types, no unknown fields, and the fields this server
cannot honour accepted only at the values where they change nothing.

A field of a ``NOOP`` table is accepted only at its listed values (``store: false``,
``priority: 0``, ...; ``response_format`` text and ``best_of == n`` are checked by the request
model and by SamplingParams) and is otherwise a 400 naming it, so a client never silently gets
other semantics than it asked for. A :class:`Why` among the values says why the others are
refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from specstream.server.errors import APIError

MAX_LOGPROBS = 20  # vLLM's default max_logprobs (and OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class Why:
    """The reason a refusal names, after the values a field is accepted at."""

    text: str


STRUCTURED = Why(": give the constraint as response_format, structured_outputs, guided_json / "
                 "guided_regex / guided_choice / guided_grammar, or json_schema / regex / ebnf")
FUNCTIONS = Why(": give them as tools and tool_choice")

NoopTable = dict[str, tuple[Any, ...]]  # field -> the values it is accepted at (and a Why)


class StrictModel(BaseModel):
    """A request model as OpenAI validates one: ``"5"`` is not an integer, an unrecognised
    argument is a 400; fields of ``NOOP`` are accepted only at their no-op values."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # Fields accepted only at these values (each does nothing here at them); a reason may
    # follow the values. Anything else is a 400 naming the field.
    NOOP: ClassVar[NoopTable] = {}

    def unsupported(self) -> APIError | None:
        """A 400 for the first field set to a value this server does not implement."""
        for name, accepted in self.NOOP.items():
            value = getattr(self, name)
            values = [a for a in accepted if not isinstance(a, Why)]
            if not any(value == a and type(value) is type(a) for a in values):
                why = next((a.text for a in accepted if isinstance(a, Why)), "")
                shown = " or ".join(json.dumps(a) for a in values)
                return APIError(400, f"'{name}' = {json.dumps(value)[:80]} is not supported by "
                                     f"this server (it accepts {shown}){why}.", param=name)
        return None


# Completions and chat completions alike (vLLM's sampling fields it has no use for here).
SAMPLING_NOOP: NoopTable = {
    "store": (None, False, Why(": responses are not stored")),
    "service_tier": (None, "auto", "default"),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (None,),
    "priority": (0, Why(": requests are served first come, first served")),
    "use_beam_search": (False,),
    "length_penalty": (1.0, Why(": it applies to beam search only")),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None,),
    **{name: (None, STRUCTURED) for name in (
        "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag")},
    "cache_salt": (None, Why(": the prefix cache is shared by all requests")),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
}

COMPLETION_NOOP: NoopTable = {**SAMPLING_NOOP, "suffix": (None,), "prompt_embeds": (None,)}

# How chat messages are rendered (chat completions and /tokenize).
CHAT_TEMPLATE_NOOP: NoopTable = {
    "chat_template": (None, Why(": templates sent with requests are not trusted; start the "
                                "server with --chat-template instead")),
    "mm_processor_kwargs": (None,),
}

CHAT_NOOP: NoopTable = {
    **SAMPLING_NOOP, **CHAT_TEMPLATE_NOOP,
    "reasoning_effort": (None,), "modalities": (None, ["text"]), "audio": (None,),
    "prediction": (None,), "functions": (None, [], FUNCTIONS),
    "function_call": (None, "none", FUNCTIONS), "verbosity": (None,),
    "web_search_options": (None,)}
