"""Attention: the plain reference and the exact merge of partial results (online softmax); the
engine's chunk-wave attention is ``waves.py`` (torch) and ``triton_wave.py``."""

from __future__ import annotations

from specstream.attention.reference import causal_mask, full_attention, gqa_group
from specstream.attention.streamed import (
    AttentionAccumulator,
    merge_partials,
    partial_attention,
)

__all__ = [
    "AttentionAccumulator",
    "causal_mask",
    "full_attention",
    "gqa_group",
    "merge_partials",
    "partial_attention",
]
