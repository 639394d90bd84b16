"""Greedy speculative output equals transformers' assisted generation on the same model pair.

transformers' ``generate(assistant_model=...)`` is the reference implementation of draft-model
speculative decoding. It reads the draft length from the *assistant's* generation config, so the
assistant is set to a constant ``num_assistant_tokens = q`` with the confidence-based early stop
off (``assistant_confidence_threshold = 0``), which makes it draft exactly q tokens per round,
as our engine does. transformers assists batch size 1 only: it runs one prompt at a time, our
engine runs the prompts as one batch of mixed lengths.

Three drafts cover the acceptance range: an unrelated random model (drafts nearly always
rejected), a slightly perturbed copy of the target (partial acceptance, so rounds end at
different positions for different requests) and the target itself (every draft accepted, so
bonus tokens are produced).

The prompts were chosen so that transformers' own target-only greedy decoding equals ours
(random tiny models can have near-tie logits where two correct implementations differ);
``test_target_only_reference_agrees`` guards that premise.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specstream import LLM, SamplingParams

NEW_TOKENS = 24
PROMPT_LENGTHS = (5, 60, 300)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Relative weight noise of the "noisy" draft: mean accepted length about 2.5 at q=4.
NOISE = 0.005


def _load_hf(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _ours(target: Path, prompts: list[list[int]], **kw: Any) -> tuple[list[list[int]], dict]:
    llm = LLM(target, mode="resident", device_kv_bytes=16 << 20, block_size=16, **kw)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.get_metrics()
    finally:
        llm.close()


class _ForwardCounter:
    """Counts forward passes of a module (transformers' target forwards = its rounds)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.count = 0
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.count += 1

    def remove(self) -> None:
        self._handle.remove()


def _hf_greedy(model: Any, prompt: list[int], assistant: Any | None = None) -> list[int]:
    """transformers greedy decoding of one prompt (assisted when ``assistant`` is given)."""
    ids = torch.tensor([prompt])
    extra = {} if assistant is None else {"assistant_model": assistant}
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **extra,
        )
    return out[0, len(prompt):].tolist()


def _constant_assistant(folder: Path, q: int) -> Any:
    """The draft as a transformers assistant that proposes exactly q tokens every round."""
    model = _load_hf(folder)
    gc = model.generation_config
    gc.num_assistant_tokens = q
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0
    return model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def hf_target(tiny_target: Path) -> Iterator[Any]:
    yield _load_hf(tiny_target)


@pytest.fixture(scope="module")
def hf_reference(hf_target: Any, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' target-only greedy continuation of every prompt."""
    return [_hf_greedy(hf_target, p) for p in prompts]


@pytest.fixture(scope="module")
def drafts(tiny_target: Path, tiny_draft: Path,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    noisy = _load_hf(tiny_target)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(NOISE * torch.randn(p.shape, generator=g))
    folder = tmp_path_factory.mktemp("noisy_draft")
    noisy.save_pretrained(folder)
    return {"unrelated": tiny_draft, "noisy": folder, "self": tiny_target}


def test_target_only_reference_agrees(tiny_target, prompts, hf_reference):
    tokens, _ = _ours(tiny_target, prompts)
    assert tokens == hf_reference


@pytest.mark.parametrize("q", [2, 4])
@pytest.mark.parametrize("draft", ["unrelated", "noisy", "self"])
def test_speculative_equals_transformers_assisted(tiny_target, drafts, hf_target, prompts,
                                                  hf_reference, draft, q):
    assistant = _constant_assistant(drafts[draft], q)
    counter = _ForwardCounter(hf_target)
    try:
        assisted = [_hf_greedy(hf_target, p, assistant) for p in prompts]
    finally:
        counter.remove()
    ours, metrics = _ours(tiny_target, prompts, draft_model=drafts[draft],
                          num_speculative_tokens=q, speculative_policy="fixed")

    assert assisted == hf_reference  # transformers' assisted generation is lossless here
    assert ours == assisted
    assert metrics["rounds"] > 0
    hf_accepted_len = len(prompts) * NEW_TOKENS / counter.count
    if draft == "self":  # both really drafted q tokens per round and accepted them
        assert metrics["mean_accepted_len"] > q and hf_accepted_len > q
    elif draft == "noisy":  # some accepted, some rejected
        assert 1.0 < metrics["mean_accepted_len"] < q + 1
        assert 1.0 < hf_accepted_len < q + 1
