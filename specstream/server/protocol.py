"""OpenAI's and vLLM's request bodies as strict pydantic models.

Requests are validated strictly, as the OpenAI API does: ``"5"`` is not an integer, a field of
the wrong type is a 400 naming the field, and an unrecognised argument is a 400 ("Unrecognized
request argument supplied: foo"). The fields are OpenAI's and vLLM's (same names, defaults and
checks, so vLLM's and SGLang's clients work unchanged). Which of them are accepted only at
their no-op values is :mod:`specstream.server.field_policy`'s; a body is decoded and validated
by :func:`specstream.server.request_body.parse_request`.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import Field

from specstream.server.errors import APIError
from specstream.server.field_policy import (
    CHAT_NOOP,
    CHAT_TEMPLATE_NOOP,
    COMPLETION_NOOP,
    MAX_LOGPROBS,
    SAMPLING_NOOP,
    NoopTable,
    StrictModel,
)
from specstream.server.structured_fields import constraint_of
from specstream.server.tools import tool_choice_error


class StreamOptions(StrictModel):
    include_usage: bool | None = True  # vLLM: stream_options given means usage unless false
    continuous_usage_stats: bool | None = False  # vLLM: usage on every chunk too


class _SamplingRequest(StrictModel):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's)."""

    model: str
    max_tokens: int | None = None
    # Sampling: None takes the server's default (--generation-config), else vLLM's.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    best_of: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    # The response's id (as X-Request-Id; the header wins).
    request_id: str | None = None
    # With logprobs: tokens as "token_id:<id>" (text that is not valid UTF-8 stays readable).
    return_tokens_as_token_ids: bool | None = None
    # Output constraints (server/structured_fields.py): OpenAI's, vLLM's, SGLang's spellings.
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    # Accepted at their no-op values (see ``NOOP``, from field_policy).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None

    NOOP: ClassVar[NoopTable] = SAMPLING_NOOP

    def unsupported(self) -> APIError | None:
        try:
            constraint_of(self)  # the constraint's spelling; its grammar is the engine's
        except APIError as err:
            return err
        return super().unsupported() or self._check()

    def _check(self) -> APIError | None:
        """vLLM's checks across fields."""
        if self.stream_options is not None and not self.stream:
            return APIError(400, "Stream options can only be defined when `stream=True`.",
                            param="stream_options")
        lp = self.prompt_logprobs
        if lp is not None and not 0 <= lp <= MAX_LOGPROBS:
            return APIError(400, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {lp}",
                            param="prompt_logprobs")
        if lp and self.stream:
            return APIError(400, "`prompt_logprobs` are not available when `stream=True`.",
                            param="prompt_logprobs")
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options
                                           and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``; ``prompt`` is text, token ids, or a list of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    prompt_embeds: Any = None

    NOOP: ClassVar[NoopTable] = COMPLETION_NOOP

    def _check(self) -> APIError | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            return APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got "
                                 f"{self.logprobs}", param="logprobs")
        if self.max_tokens == 0 and not self.echo:
            return APIError(400, "max_tokens must be >= 1 (0 only with echo, which returns "
                                 "the prompt alone)", param="max_tokens")
        return super()._check()


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ToolFunction(StrictModel):
    """A function a tool call names: its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


class ToolCall(StrictModel):
    """One call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: ToolFunction


class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no parameters
    strict: bool | None = None  # calls are always held to the schema when constrained


class ToolDefinition(StrictModel):
    """An entry of ``tools``."""

    type: Literal["function"]
    function: FunctionDefinition


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # none only beside an assistant's tool_calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # What the openai client sends back when a reply is appended to the history as it came.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates read it (a call's arguments as an object where they
        are a JSON object, as vLLM hands them to templates)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


_RENDER_ARGS = {"messages", "add_generation_prompt", "continue_final_message", "chat_template",
                "tools"}


class _ChatTemplateFields(StrictModel):
    """How messages are rendered: vLLM's fields, shared by chat and ``/tokenize``."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: Any = None
    tools: list[ToolDefinition] | None = None

    NOOP: ClassVar[NoopTable] = CHAT_TEMPLATE_NOOP

    def template_check(self) -> APIError | None:
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                return APIError(400, f"messages[{i}]: 'content' is required (only an "
                                     "assistant message with tool_calls may leave it out)",
                                param="messages")
        if self.continue_final_message and "add_generation_prompt" in self.model_fields_set \
                and self.add_generation_prompt:
            return APIError(400, "Cannot set both `continue_final_message` and "
                                 "`add_generation_prompt` to True.",
                            param="continue_final_message")
        return None

    def render_args(self) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """Messages and keyword arguments for ``Tokenizer.apply_chat_template``."""
        messages = [m.as_template_input() for m in self.messages]
        kwargs = {k: v for k, v in (self.chat_template_kwargs or {}).items()
                  if k not in _RENDER_ARGS}  # the request's own fields decide those
        if self.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        if self.documents is not None:
            kwargs["documents"] = self.documents
        kwargs["continue_final_message"] = self.continue_final_message
        kwargs["add_generation_prompt"] = (self.add_generation_prompt
                                           and not self.continue_final_message)
        return messages, kwargs


class ChatCompletionRequest(_ChatTemplateFields, _SamplingRequest):
    """``POST /v1/chat/completions``; messages are rendered with the model's chat template."""

    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's echo: the reply starts with the last message's text when that is the assistant's.
    echo: bool = False
    include_reasoning: bool = True
    reasoning_effort: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    verbosity: str | None = None
    web_search_options: Any = None

    NOOP: ClassVar[NoopTable] = CHAT_NOOP

    def _check(self) -> APIError | None:
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            return APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}",
                            param="top_logprobs")
        if top and not self.logprobs:
            return APIError(400, "when using `top_logprobs`, `logprobs` must be set to true.",
                            param="top_logprobs")
        return tool_choice_error(self) or self.template_check() or super()._check()

    @property
    def top_n(self) -> int | None:
        """Top logprobs per token (SamplingParams.logprobs); None without logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeCompletionRequest(StrictModel):
    """``POST /tokenize`` with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_ChatTemplateFields):
    """``POST /tokenize`` with messages, rendered as chat completions render them."""

    model: str | None = None
    return_token_strs: bool | None = False

    def unsupported(self) -> APIError | None:
        return super().unsupported() or self.template_check()


class DetokenizeRequest(StrictModel):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]

