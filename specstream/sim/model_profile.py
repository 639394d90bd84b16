"""Model profiles: parameters, KV bytes per token and FLOPs per token from an HF config.json.

Dense decoder-only transformers (Llama, Qwen2/3, InternLM2/2.5) share one shape:
``L x (attention + gated MLP)`` plus embeddings and an LM head, so a handful of config numbers
give everything the cost model needs. The built-ins are the public config.json values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class ModelProfile:
    """The shape of a dense decoder; derived costs are properties."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size", "dtype_bytes"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{self.name}: {field} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads must be a multiple of num_kv_heads")

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (q, k, v, o projections, gated MLP, norms)."""
        h, q_dim, kv_dim = self.hidden_size, self.num_heads * self.head_dim, \
            self.num_kv_heads * self.head_dim
        attention = h * q_dim + 2 * h * kv_dim + q_dim * h
        mlp = 3 * h * self.intermediate_size
        return attention + mlp + 2 * h + 2 * self.head_dim

    @property
    def params(self) -> int:
        """All parameters (the embedding counted once when tied)."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_embeddings else embed
        return self.num_layers * self.layer_params + embed + head + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights occupy on the device."""
        return self.params * self.dtype_bytes

    @property
    def linear_params(self) -> int:
        """Parameters a decode step multiplies by: all layers plus the LM head (the embedding
        table is only gathered from)."""
        return self.num_layers * self.layer_params + self.vocab_size * self.hidden_size

    @property
    def decode_read_bytes(self) -> int:
        """Weight bytes one forward streams from HBM, whatever the batch."""
        return self.linear_params * self.dtype_bytes

    @property
    def flops_per_token(self) -> int:
        """Matrix FLOPs per token outside attention (2 per multiply-add)."""
        return 2 * self.linear_params

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs per (query token, context token) pair: QK^T and PV over all layers and heads."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return self.kv_bytes_per_token // self.num_layers

    def describe(self) -> str:
        return (f"{self.name}: {self.params / 1e9:.2f} B params, "
                f"{self.kv_bytes_per_token / 1024:.0f} KiB KV/token, "
                f"{self.flops_per_token / 1e9:.1f} GFLOP/token")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str = "model") -> ModelProfile:
        """Build from the dict of an HF config.json (Llama, Qwen2/3, InternLM2 keys)."""
        if config.get("num_experts") or config.get("num_local_experts"):
            raise ValueError(f"{name}: mixture-of-experts configs are not modelled")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        return cls(
            name=name,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            dtype_bytes=_DTYPE_BYTES.get(dtype.replace("torch.", ""), 2),
        )


MODELS: dict[str, ModelProfile] = {}


def register_model(profile: ModelProfile) -> ModelProfile:
    """Add a built-in under its lower-cased name; returns it."""
    MODELS[profile.name.lower()] = profile
    return profile


_V_QWEN3, _V_INTERNLM = 151936, 92544
# name, layers, hidden, heads, kv heads, head_dim, intermediate, vocab, tied (public configs)
for _row in (
    ("Qwen3-0.6B", 28, 1024, 16, 8, 128, 3072, _V_QWEN3, True),
    ("Qwen3-1.7B", 28, 2048, 16, 8, 128, 6144, _V_QWEN3, True),
    ("Qwen3-8B", 36, 4096, 32, 8, 128, 12288, _V_QWEN3, False),
    ("Qwen3-14B", 40, 5120, 40, 8, 128, 17408, _V_QWEN3, False),
    ("Qwen3-32B", 64, 5120, 64, 8, 128, 25600, _V_QWEN3, False),
    ("InternLM2.5-1.8B", 24, 2048, 16, 8, 128, 8192, _V_INTERNLM, False),
    ("InternLM2.5-7B", 32, 4096, 32, 8, 128, 14336, _V_INTERNLM, False),
    ("InternLM2.5-20B", 48, 6144, 48, 8, 128, 16384, _V_INTERNLM, False),
):
    register_model(ModelProfile(*_row))


def get_model(spec: str) -> ModelProfile:
    """A built-in by name, or a config.json path (or a checkpoint folder holding one)."""
    key = spec.lower()
    if key in MODELS:
        return MODELS[key]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        with path.open() as f:
            return ModelProfile.from_hf_config(json.load(f), name=path.parent.name or spec)
    known = ", ".join(m.name for m in MODELS.values())
    raise KeyError(f"unknown model {spec!r}: not a built-in ({known}) nor a config.json")
