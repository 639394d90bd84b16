"""One decoder-only transformer for Llama, Qwen2, Qwen3 and InternLM2/2.5.

Tokens of all requests in a step arrive flattened (``[num_tokens]``). The model holds no state
and no KV cache: each layer computes q/k/v of the new tokens (``qkv``) and takes the attention
output back (``finish``). ``forward`` gets attention from an :class:`AttentionContext` supplied
by the caller; the engine's round drives the layers itself (``engine/exec/round.py``).
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
        return self.weight * _normalize(x, self.eps)


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dimension in fp32, back in x's dtype (RMSNorm before its weight)."""
    return _rms_norm(x.float(), eps).to(x.dtype)


def _rms_norm_plain(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rms_norm_fused(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), eps=eps)  # one kernel instead of five


_rms_norm = _rms_norm_fused if hasattr(F, "rms_norm") else _rms_norm_plain


def _fused(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input; the projections'
    parameters become views of it, so memory is not doubled and loading stays by name."""
    weight = torch.cat([lin.weight.data for lin in linears])
    bias = (torch.cat([lin.bias.data for lin in linears])
            if all(lin.bias is not None for lin in linears) else None)
    at = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[at : at + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[at : at + n], requires_grad=False)
        at += n
    return weight, bias


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

        # Set by `fuse`: q/k/v as one projection, and the q/k norm weights per head
        # ([heads + kv_heads, D]); buffers, so that moving the model moves them.
        self.qkv_weight: torch.Tensor | None
        self.qkv_bias: torch.Tensor | None
        self.qk_norm_weight: torch.Tensor | None
        for name in ("qkv_weight", "qkv_bias", "qk_norm_weight"):
            self.register_buffer(name, None, persistent=False)

    def fuse(self) -> None:
        """One projection for q, k and v, and one norm and one rotation for q and k together
        (the same arithmetic, fewer kernels: a decode step is launch-bound on a GPU). Call once
        the weights are loaded."""
        self.qkv_weight, self.qkv_bias = _fused([self.q_proj, self.k_proj, self.v_proj])
        if self.q_norm is not None and self.k_norm is not None:
            d = self.head_dim
            self.qk_norm_weight = torch.cat((self.q_norm.weight.data.expand(self.num_heads, d),
                                             self.k_norm.weight.data.expand(self.num_kv_heads, d)))

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: [num_tokens, hidden] -> q [n, heads, D], k and v [n, kv_heads, D] (rotated)
        n, h, kv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_weight is not None:
            q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split((h * d, kv * d, kv * d),
                                                                       dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qk = torch.cat((q.view(n, h, d), k.view(n, kv, d)), dim=1)  # [n, heads + kv_heads, D]
        if self.q_norm is not None and self.k_norm is not None:
            weight = self.qk_norm_weight
            if weight is None:
                weight = torch.cat((self.q_norm.weight.expand(h, d),
                                    self.k_norm.weight.expand(kv, d)))
            qk = weight * _normalize(qk, self.q_norm.eps)  # per head, as two RMSNorms
        qk = apply_rotary(qk, cos, sin)
        return qk[:, :h], qk[:, h:], v.reshape(n, kv, d)

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

        self.gate_up_weight: torch.Tensor | None  # set by `fuse` (buffers)
        self.gate_up_bias: torch.Tensor | None
        for name in ("gate_up_weight", "gate_up_bias"):
            self.register_buffer(name, None, persistent=False)

    def fuse(self) -> None:
        """Gate and up as one projection (see ``Attention.fuse``)."""
        self.gate_up_weight, self.gate_up_bias = _fused([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


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

    def fuse(self) -> CausalLM:
        """Fuse each layer's projections of the same input (q/k/v, gate/up) once the weights
        are loaded; see ``Attention.fuse``."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

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
