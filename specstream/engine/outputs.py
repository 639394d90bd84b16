"""What the API hands back for a request: its ``RequestOutput`` (text, tokens,
log-probabilities as vLLM shapes them, timing)."""

from __future__ import annotations

from specstream.engine.contract import TokenLogprobs
from specstream.engine.request import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    Request,
    RequestOutput,
)
from specstream.tokenizer import Tokenizer


class OutputBuilder:
    """Builds request outputs; caches each token's own text for log-probabilities."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}

    def build(self, req: Request) -> RequestOutput:
        """What the API hands back for a request now (its text so far while it runs: the
        incremental decoder's, nothing decoded again)."""
        logprobs = None if req.logprobs is None else [self.logprobs(e) for e in req.logprobs]
        comp = CompletionOutput(
            index=0, text=req.output_text, token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason, num_proposed_tokens=req.num_proposed,
            num_accepted_tokens=req.num_accepted, num_rounds=req.num_rounds, error=req.error,
            logprobs=logprobs,
            cumulative_logprob=None if logprobs is None else req.cumulative_logprob,
            stop_reason=req.stop_reason,
        )
        metrics = {"arrival_time": req.arrival_time}
        for key in ("first_scheduled_time", "first_token_time", "last_token_time"):
            if getattr(req, key) is not None:
                metrics[key] = getattr(req, key)
        if req.finish_time is not None:
            metrics["finished_time"] = req.finish_time
        if req.first_token_time is not None:
            metrics["ttft_s"] = req.first_token_time - req.arrival_time
        if req.finish_time is not None and req.first_token_time is not None:
            n = max(1, len(req.output_token_ids) - 1)
            metrics["tpot_s"] = (req.finish_time - req.first_token_time) / n
        prompt = None
        if req.prompt_logprobs is not None:  # the first prompt token has none
            prompt = [None, *(self.logprobs(e) for e in req.prompt_logprobs)]
        return RequestOutput(req.request_id, None, list(req.prompt_token_ids), [comp],
                             req.finished, metrics, req.num_computed_tokens,
                             prompt_logprobs=prompt, num_cached_tokens=req.num_cached_tokens)

    def logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        """One position's log-probabilities as vLLM hands them out: the chosen token's, then
        the most likely ones', by token id, with each token's text."""
        out = {entry.token: Logprob(entry.logprob, entry.rank, self.token_text(entry.token))}
        for rank, (tok, lp) in enumerate(entry.top, 1):
            if tok not in out:
                out[tok] = Logprob(lp, rank, self.token_text(tok))
        return out

    def token_text(self, token: int) -> str | None:
        """A token's own text (cached: the same few thousand tokens come back again and
        again)."""
        if self.tokenizer is None:
            return None
        text = self.texts.get(token)
        if text is None:
            text = self.texts[token] = self.tokenizer.decode(
                [token], skip_special_tokens=False)
        return text
