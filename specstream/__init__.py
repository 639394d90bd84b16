"""SpecStream: long-context LLM serving with CPU KV offloading, streamed exact attention and
speculative decoding on the same device."""

from __future__ import annotations

from specstream.engine.request import CompletionOutput, RequestOutput
from specstream.llm import LLM
from specstream.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
