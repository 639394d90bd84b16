"""A request's state as the scheduler sees it, and what the API hands back."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from specstream.engine.contract import TokenLogprobs
from specstream.sampling_params import SamplingParams

# A request's incremental decoder: each next token id -> the text it adds (None: not yet a
# whole character). ``Tokenizer.decode_stream`` makes one.
TextStream = Callable[[int], "str | None"]


class TextCodec(Protocol):
    """What the scheduler needs of a tokenizer (``specstream.tokenizer.Tokenizer``)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def decode_stream(self, skip_special_tokens: bool = True) -> TextStream: ...


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # Tokens whose KV is stored in the cache; the newest sampled token is never among them.
    num_computed_tokens: int = 0
    # Draft tokens proposed for the next round (verified together with the last token).
    draft_token_ids: list[int] = field(default_factory=list)
    # Their parents when they form a token tree (see SeqWork.parents); None = a chain.
    draft_parents: list[int] | None = None
    # Overlapped modes: drafts for the next round are still to be made (in the next step).
    needs_draft: bool = False
    # Tokens the draft model has seen (it drafted from them); the rest it must catch up on
    # before its next drafts.
    draft_seen: int = 0
    # Overlapped modes: which of the two groups (verified on alternate steps) it belongs to.
    group: int = -1
    finish_reason: str | None = None
    # The stop string or stop token id that ended it (None: eos, length, abort, error).
    stop_reason: int | str | None = None
    error: str | None = None
    # The output's text, grown a token at a time by ``text_stream`` (None: no tokenizer);
    # final once finished (cut at a stop string).
    output_text: str = ""
    text_stream: TextStream | None = None
    # SamplingParams.logprobs / prompt_logprobs: one entry per output / prompt token after
    # the first (None when not asked for), and the output's sum.
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    # Prompt tokens the prefix cache held (not prefilled).
    num_cached_tokens: int = 0
    # perf_counter times: first scheduled (left the queue), first and newest generated token,
    # finished.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_proposed: int = 0
    num_accepted: int = 0
    num_rounds: int = 0  # verification rounds (decode steps) this request took part in

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = []

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_prefill(self) -> bool:
        # Until the whole prompt has KV. (Not "more than one token without KV": a one-token
        # prompt would never count as a prefill, never join a group, and wait forever in the
        # two-group modes.)
        return self.num_computed_tokens < len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token: int, eos_token_ids: Collection[int],
               logprobs: TokenLogprobs | None = None) -> str | None:
        """Append one generated token (and its log-probabilities); returns why the request
        ends after it ("stop", "length") or None.

        As vLLM: eos (unless ignore_eos) and ``stop_token_ids`` end it, their text left out
        (kept with include_stop_str_in_output); a stop string ends it once more than
        min_tokens tokens were generated, the text cut before it (or after it, with
        include_stop_str_in_output). Only the new token's text is decoded, and only the text
        it could complete a stop string with is searched."""
        params = self.params
        self.output_token_ids.append(token)
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs.logprob
        stop_token = token in params.stop_token_ids
        if stop_token or (token in eos_token_ids and not params.ignore_eos):
            self.stop_reason = token if stop_token else None
            if params.include_stop_str_in_output:
                self._add_text(token)
            return "stop"
        piece = self._add_text(token)
        if piece and params.stop and len(self.output_token_ids) > params.min_tokens:
            longest = max(len(s) for s in params.stop)
            start = max(0, len(self.output_text) - len(piece) - longest + 1)
            hits = [(self.output_text.find(s, start), s) for s in params.stop]
            hits = [(at, s) for at, s in hits if at >= 0]
            if hits:
                at, s = min(hits)
                end = at + len(s) if params.include_stop_str_in_output else at
                self.output_text = self.output_text[:end]
                self.stop_reason = s
                return "stop"
        return "length" if len(self.output_token_ids) >= params.max_tokens else None

    def _add_text(self, token: int) -> str:
        piece = self.text_stream(token) if self.text_stream is not None else None
        if piece:
            self.output_text += piece
        return piece or ""


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``)."""

    logprob: float  # the target's raw log-softmax
    rank: int  # 1 = the most likely token at that position
    decoded_token: str | None = None  # the token's own text (None without a tokenizer)


# Per position: the chosen token's Logprob and those of the most likely tokens, by token id
# (vLLM's SampleLogprobs / PromptLogprobs: a list, one dict per position).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence (vLLM-like)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    # SamplingParams.logprobs: one dict per generated token (None when not asked for).
    logprobs: list[PositionLogprobs] | None = None
    # The sum of the generated tokens' log-probabilities (None without logprobs).
    cumulative_logprob: float | None = None
    # What stopped it: the stop string or the stop token id (None for eos and length).
    stop_reason: int | str | None = None
    # Speculation counters of this request.
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rounds: int = 0
    error: str | None = None

    @property
    def mean_accepted_len(self) -> float:
        """Mean tokens produced per verification round (accepted drafts + 1); the first token,
        which comes from the prefill, is not a round."""
        if not self.num_rounds:
            return 0.0
        return (self.num_accepted_tokens + self.num_rounds) / self.num_rounds


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    # Tokens whose KV is in the cache (prompt and output): prefill progress of a long prompt.
    num_computed_tokens: int = 0
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Prompt tokens found in the prefix cache (not prefilled).
    num_cached_tokens: int = 0
