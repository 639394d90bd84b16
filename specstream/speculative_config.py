"""vLLM's ``speculative_config`` as this engine's speculation settings.

One mapping for ``LLM(speculative_config={...})`` and ``specstream serve --speculative-config
JSON``: :func:`engine_fields` turns vLLM's keys into the :class:`~specstream.config.EngineConfig`
fields they stand for, and refuses, naming the key and why, what this engine cannot honour.

vLLM's methods here: ``draft_model`` (alias ``draft``; a draft model folder, ``model``) and
``ngram`` (prompt lookup). Its other keys are accepted at the values where they change nothing
here (one device, local folders, always eager, ...); the n-gram proposer's match sizes are
fixed, so ``prompt_lookup_min`` / ``prompt_lookup_max`` must equal them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# vLLM's speculative methods this engine has, by the proposer that implements them
METHODS = {"draft_model": "draft", "draft": "draft", "ngram": "ngram"}
KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
# vLLM's other SpeculativeConfig keys, accepted at the values where they change nothing here
NO_OP: dict[str, tuple[Any, ...]] = {
    "draft_tensor_parallel_size": (None, 1),  # one device
    "tensor_parallel_size": (None, 1),
    "max_model_len": (None,),  # the draft keeps a window of its own (draft_cache)
    "disable_by_batch_size": (None,),  # speculative_policy auto decides per round
    "quantization": (None,),
    "revision": (None,),  # local folders only
    "code_revision": (None,),
    "enforce_eager": (None, True, False),  # always eager: no CUDA graphs here
    "disable_padded_drafter_batch": (False, True),  # EAGLE only
    "acceptance_method": (None, "rejection_sampler"),  # vLLM v0's name for what is done here
    "rejection_sample_method": (None, "standard"),
}


def engine_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``speculative_config`` as ``{"proposer", "draft_model",
    "num_speculative_tokens"}`` (EngineConfig's fields; None where it says nothing).

    Raises ValueError naming the key where a key is unknown, a value cannot be honoured, or
    the method is one this engine does not have.
    """
    if not isinstance(cfg, Mapping):
        raise ValueError(f"speculative_config must be a dict (JSON object), got {cfg!r}")
    unknown = sorted(set(cfg) - set(KEYS) - set(NO_OP))
    if unknown:
        raise ValueError(f"unknown speculative_config key(s) {', '.join(map(repr, unknown))}; "
                         f"this engine takes {', '.join(KEYS + tuple(NO_OP))}")
    for key, accepted in NO_OP.items():
        if key in cfg and not any(cfg[key] == a and type(cfg[key]) is type(a)
                                  for a in accepted):
            raise ValueError(f"speculative_config {key} {json.dumps(cfg[key])} cannot be "
                             f"honoured by this engine; it takes "
                             f"{' or '.join(json.dumps(a) for a in accepted)}")
    model, q = cfg.get("model"), cfg.get("num_speculative_tokens")
    method = cfg.get("method", "draft_model" if model is not None else None)
    if method is None:
        raise ValueError('speculative_config: give "method" (draft_model or ngram) or a draft '
                         '"model"')
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"speculative_config method {method!r} is not built here; this engine "
                         f"has {', '.join(METHODS)}")
    proposer = METHODS[method]
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f'speculative_config "model" must be a folder name, got {model!r}')
    if model is not None and proposer == "ngram":
        raise ValueError('speculative_config method "ngram" takes no "model"')
    if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
        raise ValueError(
            f'speculative_config "num_speculative_tokens" must be an integer >= 1, got {q!r}')
    if proposer == "ngram":  # vLLM ignores the lookup sizes for other methods
        _check_lookup(cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max"))
    return {"proposer": proposer, "draft_model": model, "num_speculative_tokens": q}


def _check_lookup(low: Any, high: Any) -> None:
    """The n-gram proposer's match sizes are fixed (the longest earlier match of the last
    ``min_n`` to ``max_n`` tokens): only those values can be honoured."""
    from specstream.spec.ngram import NgramProposer

    fixed = NgramProposer()
    for key, value, want in (("prompt_lookup_min", low, fixed.min_n),
                             ("prompt_lookup_max", high, fixed.max_n)):
        if value is not None and (isinstance(value, bool) or value != want):
            raise ValueError(
                f"speculative_config {key} {json.dumps(value)} cannot be honoured: this "
                f"engine's n-gram proposer drafts from the longest earlier match of the last "
                f"{fixed.min_n} to {fixed.max_n} tokens (prompt_lookup_min {fixed.min_n}, "
                f"prompt_lookup_max {fixed.max_n}); leave it out or give {want}")
