"""The offline Python API, vLLM-like: ``LLM(...).generate(prompts, SamplingParams(...))``.

vLLM's spellings work where the concept exists: ``LLM(model, seed=..., max_model_len=...,
enable_prefix_caching=..., speculative_config={...}, tensor_parallel_size=1)`` (any
:class:`EngineConfig` field is a keyword), prompts as text, token ids, or vLLM's
``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}`` dicts, and
``generate(prompts, sampling_params=...)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Required, TypedDict

from tqdm.auto import tqdm

from specstream.config import MODES, EngineConfig
from specstream.engine.llm_engine import LLMEngine
from specstream.engine.request import RequestOutput
from specstream.sampling_params import SamplingParams, derive_seed
from specstream.speculative_config import engine_fields


class TextPrompt(TypedDict, total=False):
    """vLLM's ``TextPrompt``: text the model's tokenizer encodes."""

    prompt: Required[str]


class TokensPrompt(TypedDict, total=False):
    """vLLM's ``TokensPrompt``: token ids as they are (``prompt``: their text, if known, for
    ``RequestOutput.prompt``)."""

    prompt_token_ids: Required[list[int]]
    prompt: str


Prompt = str | Sequence[int] | TextPrompt | TokensPrompt
# vLLM's prompt dict keys for what this engine has not (multi-modal inputs, embeddings, ...)
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def default_model_dir(kind: str = "target") -> Path:
    """Folder of the embedded default model pair shipped with the package."""
    return Path(str(resources.files("specstream") / "assets" / f"default-{kind}"))


class LLM:
    """Load a model folder and generate for many prompts at once.

    ``model=None`` uses the embedded default target, and the embedded default draft where the
    options speculate (the default mode does) and name no ``draft_model``. Other keyword
    arguments are :class:`EngineConfig` fields (mode, device_kv_bytes, num_speculative_tokens, seed,
    max_model_len, enable_prefix_caching, ...).

    ``speculative_config`` takes vLLM's dict (``{"method": "draft_model", "model": DIR,
    "num_speculative_tokens": 4}``, or ``"ngram"``; see :mod:`specstream.speculative_config`);
    it must not contradict ``draft_model``, ``proposer`` or ``num_speculative_tokens`` given
    as well. ``tensor_parallel_size`` > 1 shards the target over that many ranks, one process
    each (``engine/exec/ranks.py``).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        draft_model: str | Path | None = None,
        trace: bool = False,
        *,
        speculative_config: Mapping[str, Any] | None = None,
        tensor_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise TypeError(f"unknown LLM option(s): {unknown}; valid: {sorted(fields)}")
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int):
            raise ValueError(f"tensor_parallel_size must be an integer, got "
                             f"{tensor_parallel_size!r}")
        kwargs["tensor_parallel_size"] = tensor_parallel_size
        if speculative_config is not None:
            draft_model = _apply_speculative_config(speculative_config, draft_model, kwargs)
        if model is None:
            model = default_model_dir("target")
            if draft_model is None and _wants_draft(kwargs):
                draft_model = default_model_dir("draft")
        if draft_model is not None:
            kwargs.setdefault("proposer", "draft")
        self.config = EngineConfig(draft_model=str(draft_model) if draft_model else None,
                                   **kwargs)
        self.engine = LLMEngine(model, self.config, trace=trace)
        self.tokenizer = self.engine.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt as token ids (text is encoded with the model's tokenizer; vLLM's prompt
        dicts give their ``prompt_token_ids``, or their ``prompt`` encoded)."""
        if isinstance(prompt, Mapping):
            return self.encode(_prompt_source(prompt))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: give token-id prompts")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's ``{"prompt": ...}`` and
        ``{"prompt_token_ids": [...]}`` dicts; one, or a list); outputs come back in prompt
        order."""
        single = isinstance(prompts, (str, Mapping)) or (
            isinstance(prompts, Sequence) and bool(prompts) and isinstance(prompts[0], int)
        )
        items: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item,arg-type]
        if not items:
            return []
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(items)
        if len(plist) != len(items):
            raise ValueError(f"{len(plist)} sampling params for {len(items)} prompts")
        encoded = [self.encode(p) for p in items]  # validate all before adding any
        ids: list[list[str]] = []
        added: list[str] = []
        try:
            for ptoks, p in zip(encoded, plist):
                group = []
                for i in range(p.n):
                    sub = p if p.n == 1 else dataclasses.replace(
                        p, n=1, seed=None if p.seed is None else derive_seed(p.seed, i))
                    rid = self.engine.add_request(ptoks, sub)
                    group.append(rid)
                    added.append(rid)
                ids.append(group)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        return self._run(items, encoded, ids, use_tqdm)

    def _run(self, prompts: list[Any], encoded: list[list[int]], ids: list[list[str]],
             use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        total = sum(len(g) for g in ids)
        bar = tqdm(total=total, desc="generate", unit="req", disable=not use_tqdm or total < 2)
        with bar:
            while len(final) < total and self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        results = []
        for prompt, ptoks, group in zip(prompts, encoded, ids):
            outs = [final[r].outputs[0] for r in group]
            for i, o in enumerate(outs):
                o.index = i
            first = final[group[0]]
            results.append(RequestOutput(
                first.request_id, _prompt_text(prompt), ptoks, outs, True, first.metrics,
                first.num_computed_tokens, prompt_logprobs=first.prompt_logprobs,
                num_cached_tokens=first.num_cached_tokens))
        return results

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (with ``tools``, OpenAI's
        function tools, as vLLM's ``LLM.chat`` takes them), then generate. The calls stay in
        the text: ``specstream.server.tool_calls.parse_tool_calls`` reads them out."""
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer, so no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        # the template writes any BOS itself, so the rendered text is encoded without specials
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(c, tools=tools),  # type: ignore[arg-type]
                add_special_tokens=False)
            for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_metrics(self) -> dict[str, Any]:
        return self.engine.get_metrics()

    def close(self) -> None:
        self.engine.close()


def _apply_speculative_config(cfg: Mapping[str, Any], draft_model: str | Path | None,
                              kwargs: dict[str, Any]) -> str | Path | None:
    """vLLM's ``speculative_config`` onto ``kwargs`` (proposer, num_speculative_tokens);
    returns the draft model folder. Raises ValueError where a keyword given as well says
    otherwise."""
    spec = engine_fields(cfg)
    for key in ("proposer", "num_speculative_tokens"):
        value, given = spec[key], kwargs.get(key)
        if value is None:
            continue
        if given is not None and given != value:
            raise ValueError(f"speculative_config sets {key}={value!r} but {key}={given!r} "
                             "was given too; give one of them")
        kwargs[key] = value
    model = spec["draft_model"]
    if model is not None and draft_model is not None and (
            Path(model).resolve() != Path(draft_model).resolve()):
        raise ValueError(f"speculative_config's model {model!r} is not draft_model "
                         f"{str(draft_model)!r}; give one of them")
    if spec["proposer"] == "ngram" and draft_model is not None:
        raise ValueError("speculative_config says method ngram but draft_model names a draft "
                         "model; give one of them")
    return model if model is not None else draft_model


def _prompt_source(prompt: Mapping[str, Any]) -> str | list[int]:
    """What a vLLM prompt dict holds: its token ids, else its text."""
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    if unknown:
        raise ValueError(f"prompt key(s) {unknown} are not supported here (text and token-id "
                         f"prompts only); a prompt dict takes {list(PROMPT_KEYS)}")
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" not in prompt:
        raise ValueError('a prompt dict needs "prompt" (text) or "prompt_token_ids"')
    text = prompt["prompt"]
    if not isinstance(text, str):
        raise ValueError(f'"prompt" must be text, got {type(text).__name__}')
    return text


def _prompt_text(prompt: Prompt) -> str | None:
    """``RequestOutput.prompt``: the prompt's text where it was given as text."""
    if isinstance(prompt, Mapping):
        text = prompt.get("prompt")
        return text if isinstance(text, str) else None
    return prompt if isinstance(prompt, str) else None


def _wants_draft(kwargs: dict[str, Any]) -> bool:
    """Whether options for the embedded target ask for speculation without naming a proposer
    (no mode: the default, which speculates where it can; draft tokens per round, token trees,
    or a mode that verifies drafts): the embedded draft answers."""
    proposer = kwargs.get("proposer")
    if proposer is not None:
        return bool(proposer == "draft")
    if kwargs.get("mode") is None:
        return True
    mode = MODES.get(kwargs["mode"])
    return (bool(kwargs.get("num_speculative_tokens")) or (kwargs.get("speculative_topk") or 1) > 1
            or (mode is not None and mode.needs_drafts))
