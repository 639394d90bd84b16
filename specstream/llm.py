"""The offline Python API, vLLM-like: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specstream.config import MODES, EngineConfig
from specstream.engine.llm_engine import LLMEngine
from specstream.engine.request import RequestOutput
from specstream.sampling_params import SamplingParams, derive_seed

Prompt = str | Sequence[int]


def default_model_dir(kind: str = "target") -> Path:
    """Folder of the embedded default model pair shipped with the package."""
    return Path(str(resources.files("specstream") / "assets" / f"default-{kind}"))


class LLM:
    """Load a model folder and generate for many prompts at once.

    ``model=None`` uses the embedded default target; with ``proposer="draft"`` and no
    ``draft_model`` the embedded default draft is used. Other keyword arguments are
    :class:`EngineConfig` fields (mode, device_kv_bytes, num_speculative_tokens, ...).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        draft_model: str | Path | None = None,
        trace: bool = False,
        **kwargs: Any,
    ) -> None:
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise TypeError(f"unknown LLM option(s): {unknown}; valid: {sorted(fields)}")
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
        """A prompt as token ids (text is encoded with the model's tokenizer)."""
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
        """Generate for every prompt; outputs come back in prompt order."""
        single = isinstance(prompts, str) or (
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
                first.request_id, prompt if isinstance(prompt, str) else None, ptoks, outs,
                True, first.metrics,
            ))
        return results

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer, so no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        # the template writes any BOS itself, so the rendered text is encoded without specials
        prompts = [
            self.tokenizer.encode(self.tokenizer.apply_chat_template(c),  # type: ignore[arg-type]
                                  add_special_tokens=False)
            for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_metrics(self) -> dict[str, Any]:
        return self.engine.get_metrics()

    def close(self) -> None:
        self.engine.close()


def _wants_draft(kwargs: dict[str, Any]) -> bool:
    """Whether options for the embedded target ask for speculation without naming a proposer
    (draft tokens per round, token trees, or a mode that verifies drafts): the embedded draft
    answers."""
    proposer = kwargs.get("proposer")
    if proposer is not None:
        return bool(proposer == "draft")
    mode = MODES.get(kwargs.get("mode", EngineConfig.mode))
    return (bool(kwargs.get("num_speculative_tokens")) or (kwargs.get("speculative_topk") or 1) > 1
            or (mode is not None and mode.needs_drafts))
