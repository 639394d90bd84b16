"""One decoder-only transformer for Llama, Qwen2, Qwen3 and InternLM2/2.5.

Tokens of all requests in a step arrive flattened (``[num_tokens]``). The model holds no state
and no KV cache: each layer computes q/k/v of the new tokens (``qkv``) and takes the attention
output back (``finish``). ``forward`` gets attention from an :class:`AttentionContext` supplied
by the caller; the engine's round drives the layers itself (``engine/round.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from specstream.models.config import ModelConfig
from specstream.models.rope import RotaryEmbedding, apply_rotary


class AttentionContext(Protocol):
    """What the model needs from the engine for one forward pass."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store k/v of the new tokens and return attention output.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        returns [num_tokens, num_heads, head_dim]
        """
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
        )
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: [num_tokens, hidden] -> q [n, heads, D], k and v [n, kv_heads, D] (rotated)
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def out(self, attn: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # attn: [num_tokens, heads, D] -> [num_tokens, hidden]
        return self.o_proj(attn.reshape(attn.shape[0], -1).to(dtype))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to attention: q, k, v of the new tokens."""
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer after attention: output projection, residuals, MLP."""
        x = x + self.self_attn.out(attn, x.dtype)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)


class CausalLM(nn.Module):
    """Parameter names follow the HF Llama/Qwen layout (``model.layers.N.self_attn.q_proj``...)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # Per-layer entry points, so a caller can drive the layers itself (the engine's round does,
    # interleaving each layer with the copies and draft steps around it); ``forward`` is the
    # same computation with attention from an AttentionContext.
    @property
    def layers(self) -> Sequence[DecoderLayer]:
        return cast("Sequence[DecoderLayer]", self.model.layers)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        # input_ids, positions: [num_tokens] -> hidden [num_tokens, hidden], rotary (cos, sin)
        return self.model.embed_tokens(input_ids), self.model.rotary.cos_sin(positions)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]
        x, (cos, sin) = self.embed(input_ids, positions)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(x, cos, sin)
            x = layer.finish(x, ctx.attend(i, q, k, v))
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [n, hidden] -> fp32 logits [n, vocab]
        return self.lm_head(hidden).float()
