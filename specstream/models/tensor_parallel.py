"""Tensor-parallel shards of the decoder, as vLLM shards it: rank ``r`` of ``tp`` holds its
attention heads' rows of q/k/v (column-parallel), their columns of the output projection
(row-parallel), its slice of the MLP's gate/up rows and down columns, and the replicated rest
(embeddings, norms, LM head). The row-parallel outputs are all-reduced over the process group,
so each layer's output, and every rank's logits, equal the unsharded model's up to the order
the partial sums are added in.

KV heads split with their query heads (query head j reads KV head j // group, and both split
into contiguous blocks, so a rank's queries find their KV heads on the same rank); where there
are fewer KV heads than ranks, each rank holds the one its queries read (replicated). Each rank
loads only its slices, one checkpoint tensor at a time (``loader.load_model(shard=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from specstream.models.config import ModelConfig

if TYPE_CHECKING:
    from specstream.models.decoder import CausalLM


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of a tensor-parallel group of ``size`` (``group``: the process group of
    the all-reduces; None: the default group)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Raises ValueError naming what does not split over ``size`` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    for what, n in (("attention heads", cfg.num_heads),
                    ("MLP intermediate size", cfg.intermediate_size)):
        if n % size:
            raise ValueError(f"{n} {what} do not split over {size} ranks")
    kv = cfg.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ValueError(f"{kv} KV heads neither split over nor replicate evenly onto {size} "
                         "ranks")


def rank_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shape of one rank's part of the model."""
    check_shardable(cfg, size)
    return replace(cfg, num_heads=cfg.num_heads // size,
                   num_kv_heads=max(1, cfg.num_kv_heads // size),
                   intermediate_size=cfg.intermediate_size // size)


def shard_tensor(name: str, tensor: torch.Tensor, cfg: ModelConfig, shard: Shard
                 ) -> torch.Tensor:
    """Rank ``shard.rank``'s part of the decoder tensor ``name`` (decoder names, the full
    model's ``cfg``)."""
    r, n, d = shard.rank, shard.size, cfg.head_dim
    if n == 1:
        return tensor
    is_bias = name.endswith(".bias")
    if ".self_attn.q_proj." in name:
        heads = cfg.num_heads // n
        return tensor[r * heads * d:(r + 1) * heads * d]
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        kv = cfg.num_kv_heads
        first, count = (r * (kv // n), kv // n) if kv >= n else (r // (n // kv), 1)
        return tensor[first * d:(first + count) * d]
    if ".self_attn.o_proj." in name:
        if is_bias:  # added once, after the all-reduce: rank 0's part
            return tensor if r == 0 else torch.zeros_like(tensor)
        heads = cfg.num_heads // n
        return tensor[:, r * heads * d:(r + 1) * heads * d]
    if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
        rows = cfg.intermediate_size // n
        return tensor[r * rows:(r + 1) * rows]
    if ".mlp.down_proj." in name:
        if is_bias:
            return tensor if r == 0 else torch.zeros_like(tensor)
        cols = cfg.intermediate_size // n
        return tensor[:, r * cols:(r + 1) * cols]
    return tensor  # embeddings, norms (q/k norms are per head_dim), LM head: replicated


class RowParallel(nn.Module):
    """A row-parallel projection: this rank's partial product, summed over the group."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x)
        dist.all_reduce(out, group=self.group)
        return out


def parallelize(model: CausalLM, shard: Shard) -> None:
    """Wrap each layer's output and down projections in all-reduces (after loading: the
    parameter names stay the checkpoint's until then)."""
    if shard.size == 1:
        return
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallel(attn.o_proj, shard.group)  # type: ignore[assignment]
        mlp.down_proj = RowParallel(mlp.down_proj, shard.group)  # type: ignore[assignment]
