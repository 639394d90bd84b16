"""Rotary position embeddings with the scaling types the supported families ship.

default, linear (position interpolation), dynamic (NTK, the type InternLM2.5 uses), llama3 and
yarn. The formulas follow the families' reference code so logits match transformers.
"""

from __future__ import annotations

import math

import torch

from specstream.models.config import RopeConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))


def compute_inv_freq(
    rope: RopeConfig, dim: int, max_positions: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] (float32, as transformers computes them) and the factor
    that scales cos/sin (yarn's attention factor, else 1)."""
    kind = rope.rope_type
    if kind == "default":
        return _base_inv_freq(rope.theta, dim), 1.0
    if kind == "linear":
        return _base_inv_freq(rope.theta, dim) / rope.factor, 1.0
    if kind == "dynamic":
        # NTK-aware: past the trained length the base grows with the current sequence length.
        seq = max(seq_len or 0, max_positions)
        base = rope.theta * ((rope.factor * seq / max_positions) - (rope.factor - 1)) ** (
            dim / (dim - 2)
        )
        return _base_inv_freq(base, dim), 1.0
    if kind == "llama3":
        inv = _base_inv_freq(rope.theta, dim)
        low, high = rope.low_freq_factor or 1.0, rope.high_freq_factor or 4.0
        orig = rope.original_max_position_embeddings or 8192
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(rope, dim, max_positions)
    raise ValueError(f"unsupported rope type {kind!r}")


def _yarn(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    factor = rope.factor
    orig = rope.original_max_position_embeddings or max_positions
    attn_factor = rope.attention_factor
    if attn_factor is None:
        attn_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    beta_fast, beta_slow = rope.beta_fast or 32.0, rope.beta_slow or 1.0

    def correction_dim(num_rot: float) -> float:
        return (dim * math.log(orig / (num_rot * 2 * math.pi))) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    idx = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((idx - low) / (high - low)).clamp(0, 1)
    extrapolation = _base_inv_freq(rope.theta, dim)
    interpolation = extrapolation / factor
    keep = 1 - ramp  # 1 = keep the original frequency (high-frequency dims)
    return interpolation * (1 - keep) + extrapolation * keep, float(attn_factor)


class RotaryEmbedding:
    """RoPE tables for absolute token positions (no parameters, so not an nn.Module buffer:
    models built on the meta device need no re-initialisation)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        self.rope = rope
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq, self.scale = compute_inv_freq(rope, head_dim, max_positions)
        self._inv_freq = inv_freq.float()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [num_tokens] -> cos, sin: [num_tokens, 1, head_dim] in fp32
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        inv_freq = self._inv_freq
        if self.rope.rope_type == "dynamic":
            seq_len = int(positions.max().item()) + 1 if positions.numel() else 0
            if seq_len > self.max_positions:
                inv, _ = compute_inv_freq(self.rope, self.head_dim, self.max_positions, seq_len)
                inv_freq = inv.float().to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale)[:, None, :], (emb.sin() * self.scale)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
