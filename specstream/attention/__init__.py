"""Attention: the plain reference and the chunk-streamed exact path (online softmax)."""

from __future__ import annotations

from specstream.attention.reference import causal_mask, full_attention, gqa_group
from specstream.attention.streamed import (
    AttentionAccumulator,
    ChunkedAttention,
    merge_partials,
    partial_attention,
    streamed_attention,
)

__all__ = [
    "AttentionAccumulator",
    "ChunkedAttention",
    "causal_mask",
    "full_attention",
    "gqa_group",
    "merge_partials",
    "partial_attention",
    "streamed_attention",
]
