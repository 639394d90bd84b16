"""A request's state as the scheduler sees it, and what the API hands back."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from specstream.sampling_params import SamplingParams


class RequestError(Exception):
    """A failure that belongs to one request (its own seed, its own draft state): the engine
    fails that request alone and carries on with the others."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # Tokens whose KV is stored in the cache; the newest sampled token is never among them.
    num_computed_tokens: int = 0
    # Draft tokens proposed for the next round (verified together with the last token).
    draft_token_ids: list[int] = field(default_factory=list)
    # Their parents when they form a token tree (see SeqWork.parents); None = a chain.
    draft_parents: list[int] | None = None
    draft_probs: torch.Tensor | None = None  # [len(draft_token_ids), V] or None
    # Overlapped modes: drafts for the next round are still to be made (in the next step).
    needs_draft: bool = False
    # Tokens the draft model has seen (it drafted from them); the rest it must catch up on
    # before its next drafts.
    draft_seen: int = 0
    # Overlapped modes: which of the two groups (verified on alternate steps) it belongs to.
    group: int = -1
    finish_reason: str | None = None
    error: str | None = None
    output_text: str = ""
    first_token_time: float | None = None
    finish_time: float | None = None
    num_proposed: int = 0
    num_accepted: int = 0
    num_rounds: int = 0  # verification rounds (decode steps) this request took part in

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

    def stop_reason(self, eos_token_ids: Collection[int],
                    decode: Callable[[list[int]], str] | None) -> str | None:
        """Why the request ends after its newest token ("stop", "length"), or None. A stop
        string cuts ``output_text`` before it."""
        params, tok = self.params, self.output_token_ids[-1]
        if tok in params.stop_token_ids or (tok in eos_token_ids and not params.ignore_eos):
            return "stop"
        if params.stop and decode is not None:
            text = decode(self.output_token_ids)
            hits = [text.find(s) for s in params.stop if s in text]
            if hits:
                self.output_text = text[: min(hits)]
                return "stop"
        return "length" if len(self.output_token_ids) >= params.max_tokens else None


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
