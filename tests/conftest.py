"""Shared fixtures: a tiny random Qwen3 target and draft saved as HF checkpoints."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. It must be on before the first
# import of triton (the engine imports it with the attention backends), so it is set here,
# before any test module imports the package.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _save_qwen3(folder: Path, layers: int, hidden: int, seed: int) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=128, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=2 * hidden,
        max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(cfg).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 layers (so one layer of history is small next to the device budget), GQA 2."""
    return _save_qwen3(tmp_path_factory.mktemp("target"), layers=8, hidden=64, seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An unrelated smaller model: its drafts are mostly rejected, which exercises rollback."""
    return _save_qwen3(tmp_path_factory.mktemp("draft"), layers=2, hidden=32, seed=1)


@pytest.fixture(scope="module", autouse=True)
def _collect_engines_after_module() -> Iterator[None]:
    """Engines a module's servers or fixtures left in reference cycles are freed when the module
    ends, not at some later collection: each reserves its host tier (8 GiB of address space by
    default), and a process holding several cannot fork (Ray's start, for one, fails with
    ENOMEM)."""
    yield
    gc.collect()

