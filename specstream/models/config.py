"""Model configuration parsed from a HuggingFace ``config.json``.

One decoder covers Llama, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm) and InternLM2/2.5 (fused,
grouped ``wqkv``). This module turns the families' config dialects, including the older
``rope_theta``/``rope_scaling`` form and the transformers-5 ``rope_parameters`` form, into one
frozen :class:`ModelConfig`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# model_type -> family; the family decides the weight layout and the attention extras.
_FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "internlm2": "internlm2",
}

# architectures[0] -> model_type, for configs that omit model_type.
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "InternLM2ForCausalLM": "internlm2",
}

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class ModelConfigError(ValueError):
    """A config.json that cannot describe a model this engine runs."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    # llama3 / yarn extras; None where the type does not use them
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ModelConfigError(
                f"unsupported rope scaling type {self.rope_type!r}; supported: {ROPE_TYPES}"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ModelConfigError(f"rope theta and factor must be > 0, got {self}")


@dataclass(frozen=True)
class ModelConfig:
    family: str  # llama | qwen2 | qwen3 | internlm2
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama attention_bias, InternLM2 bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(
                    f"config field {name} must be > 0, got {getattr(self, name)}"
                )
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def context_length(self) -> int:
        """Longest sequence the rope scaling is meant for (vLLM's derived max_model_len):
        linear/dynamic stretch max_position_embeddings by factor, yarn the original length;
        llama3 configs already state the scaled length."""
        rope = self.rope
        if rope.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * rope.factor)
        if rope.rope_type == "yarn":
            orig = rope.original_max_position_embeddings or self.max_position_embeddings
            return max(self.max_position_embeddings, int(orig * rope.factor))
        return self.max_position_embeddings

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type is None:
            archs = raw.get("architectures") or []
            model_type = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
        family = _FAMILIES.get(str(model_type))
        if family is None:
            raise ModelConfigError(
                f"unknown architecture: model_type {model_type!r} "
                f"(supported: {sorted(_FAMILIES)})"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            head_dim = int(raw.get("head_dim") or hidden // heads)
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            _check_no_sliding_window(raw, str(model_type))
            if family == "internlm2":
                bias = bool(raw.get("bias", True))  # InternLM2Config's default
                qkv_bias, o_bias, mlp_bias = bias, bias, False
            elif family == "qwen2":
                qkv_bias, o_bias, mlp_bias = True, False, False
            elif family == "qwen3":
                qkv_bias = o_bias = bool(raw.get("attention_bias", False))
                mlp_bias = False
            else:
                qkv_bias = o_bias = bool(raw.get("attention_bias", False))
                mlp_bias = bool(raw.get("mlp_bias", False))
            return cls(
                family=family,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                intermediate_size=int(raw["intermediate_size"]),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=_parse_rope(raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=qkv_bias,
                o_bias=o_bias,
                mlp_bias=mlp_bias,
                qk_norm=family == "qwen3",
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            )
        except KeyError as exc:
            raise ModelConfigError(f"config.json is missing the field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ModelConfigError):
                raise
            raise ModelConfigError(f"config.json has a field of the wrong type: {exc}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {path}")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{cfg_path} is not valid JSON: {exc}") from None
        cfg = cls.from_dict(raw)
        # generation_config.json often lists more end tokens (chat models' end-of-turn).
        gen_path = Path(path) / "generation_config.json"
        if gen_path.is_file():
            try:
                eos = json.loads(gen_path.read_text()).get("eos_token_id")
            except (json.JSONDecodeError, AttributeError):
                eos = None
            extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
            merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *(int(e) for e in extra)]))
            if merged != cfg.eos_token_ids:
                cfg = replace(cfg, eos_token_ids=merged)
        return cfg


def _check_no_sliding_window(raw: dict[str, Any], model_type: str) -> None:
    """The decoder attends to the whole history; refuse configs that say otherwise."""
    window = raw.get("sliding_window")
    enabled = raw.get("use_sliding_window", model_type == "mistral")
    max_pos = int(raw.get("max_position_embeddings", 4096))
    if enabled and window is not None and int(window) < max_pos:
        raise ModelConfigError(
            f"sliding-window attention (sliding_window={window}) is not supported"
        )


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Both dialects: transformers-5 ``rope_parameters``, older ``rope_theta``+``rope_scaling``."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    scaling = dict(params) if isinstance(params, dict) else dict(raw.get("rope_scaling") or {})
    theta = float(scaling.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "ntk":  # some InternLM2 remote-code configs spell dynamic NTK this way
        rope_type = "dynamic"
    partial = scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ModelConfigError(f"partial_rotary_factor={partial} is not supported (only 1.0)")

    def opt(key: str) -> Any:
        return scaling.get(key)

    orig = opt("original_max_position_embeddings")
    return RopeConfig(
        theta=theta,
        rope_type=str(rope_type),
        factor=float(scaling.get("factor", 1.0) or 1.0),
        low_freq_factor=opt("low_freq_factor"),
        high_freq_factor=opt("high_freq_factor"),
        original_max_position_embeddings=int(orig) if orig is not None else None,
        beta_fast=opt("beta_fast"),
        beta_slow=opt("beta_slow"),
        attention_factor=opt("attention_factor"),
    )
