"""Logprobs as OpenAI's responses spell them: pure functions of the engine's per-position
:class:`~specstream.engine.request.Logprob` dicts.

Completions carry ``tokens``, ``token_logprobs``, ``top_logprobs`` (by text) and
``text_offset``; chat carries ``content`` entries with bytes; vLLM's ``prompt_logprobs`` keys
by token id. JSON has no ``-inf``: OpenAI's and vLLM's floor (-9999) stands in for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specstream.engine.request import Logprob, PositionLogprobs

LOGPROB_FLOOR = -9999.0  # what OpenAI and vLLM send for a log-probability of -inf


@dataclass(frozen=True)
class TokenNames:
    """How tokens are written in logprobs: their text (the engine's ``decoded_token``, else
    the tokenizer's), or ``token_id:<id>`` (vLLM's return_tokens_as_token_ids)."""

    tok: Any  # the Tokenizer, or None (token-id models)
    as_ids: bool = False

    def text(self, token_id: int, lp: Logprob | None = None) -> str:
        if self.as_ids or self.tok is None:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tok.decode([token_id], skip_special_tokens=False)

    def bytes(self, token_id: int, text: str) -> list[int]:
        if self.as_ids or self.tok is None:
            return list(text.encode("utf-8"))
        return self.tok.token_bytes(token_id)


def _floor(logprob: float) -> float:
    """JSON has no -inf (nor NaN): OpenAI's floor instead."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _top(position: PositionLogprobs, n: int) -> list[tuple[int, Logprob]]:
    """The ``n`` most likely tokens at a position, most likely first."""
    return sorted(((t, lp) for t, lp in position.items() if lp.rank <= n),
                  key=lambda item: item[1].rank)


Positions = Sequence[PositionLogprobs | None]  # one entry per token (None: no logprobs)


def _position(positions: Positions | None, i: int) -> PositionLogprobs | None:
    return positions[i] if positions is not None and i < len(positions) else None


def completion_logprobs(token_ids: list[int], positions: Positions | None,
                        top_n: int, names: TokenNames, offset: int = 0
                        ) -> tuple[dict[str, list[Any]], int]:
    """Completions ``logprobs`` for ``token_ids`` (``positions[i]`` holds token i's): tokens,
    their log-probabilities, ``top_n`` alternatives (and the token itself) by text, and text
    offsets from ``offset`` on. A position without logprobs (the prompt's first token) has
    null ones. Also returns the offset after the last token."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    for i, token_id in enumerate(token_ids):
        pos = _position(positions, i)
        lp = pos.get(token_id) if pos is not None else None
        text = names.text(token_id, lp)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if pos is None or lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_floor(lp.logprob))
        top: dict[str, float] = {}
        for t, p in [*_top(pos, top_n), (token_id, lp)]:  # tokens of the same text: the likelier
            top.setdefault(names.text(t, p), _floor(p.logprob))
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(token_ids: list[int], positions: Positions | None,
                  top_n: int, names: TokenNames) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` for ``token_ids``: each token with its log-probability, its
    bytes and the ``top_n`` most likely tokens at its position."""
    content = []
    for i, token_id in enumerate(token_ids):
        pos = _position(positions, i)
        lp = pos.get(token_id) if pos is not None else None
        text = names.text(token_id, lp)
        top = [] if pos is None else [
            {"token": (t_text := names.text(t, p)), "logprob": _floor(p.logprob),
             "bytes": names.bytes(t, t_text)} for t, p in _top(pos, top_n)]
        content.append({"token": text,
                        "logprob": LOGPROB_FLOOR if lp is None else _floor(lp.logprob),
                        "bytes": names.bytes(token_id, text), "top_logprobs": top})
    return content


def prompt_logprobs_body(positions: Positions | None, names: TokenNames
                         ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token, ``{token id: {logprob, rank,
    decoded_token}}`` (None for the first token)."""
    if positions is None:
        return None
    return [None if pos is None else {
        str(t): {"logprob": _floor(p.logprob), "rank": p.rank, "decoded_token": names.text(t, p)}
        for t, p in pos.items()} for pos in positions]
