"""KV tensors of both tiers, block-major so a block of all layers is one contiguous run.

Layout of both pools: ``[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``.
A write-back moves one block for all layers in one copy; a restore moves one block of one layer
(K and V separately, so the destination can be a flat token range).
"""

from __future__ import annotations

import torch

from specstream.backends.base import TransferBackend, TransferHandle
from specstream.models.config import ModelConfig


class KVStore:
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        backend: TransferBackend,
    ) -> None:
        self.cfg, self.dtype, self.block_size, self.backend = cfg, dtype, block_size, backend
        shape = (cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.device = backend.alloc_device((num_device_blocks, *shape), dtype)
        self.host = (
            backend.alloc_host((num_host_blocks, *shape), dtype) if num_host_blocks else None
        )

    @property
    def layer_token_bytes(self) -> int:
        """K+V bytes of one token in one layer."""
        return 2 * self.cfg.num_kv_heads * self.cfg.head_dim * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers."""
        return self.block_size * self.cfg.num_layers * self.layer_token_bytes

    def write(
        self,
        layer: int,
        blocks: torch.Tensor,  # [num_tokens] device block per token
        offsets: torch.Tensor,  # [num_tokens] slot within the block
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> None:
        self.device[blocks, layer, 0, offsets] = k.to(self.dtype)
        self.device[blocks, layer, 1, offsets] = v.to(self.dtype)

    def gather(
        self, layer: int, blocks: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[num_tokens, num_kv_heads, head_dim]`` of a request's tail blocks."""
        x = self.device[blocks, layer]  # [nb, 2, bs, kv, D]
        k = x[:, 0].reshape(-1, self.cfg.num_kv_heads, self.cfg.head_dim)[:num_tokens]
        v = x[:, 1].reshape(-1, self.cfg.num_kv_heads, self.cfg.head_dim)[:num_tokens]
        return k, v

    def writeback(self, pairs: list[tuple[int, int]], tag: object) -> list[TransferHandle]:
        """Device-to-host copies of whole blocks (all layers), low priority, one transfer."""
        assert self.host is not None, "write-back without a host tier"
        copies = [(self.host[h], self.device[d]) for d, h in pairs]
        return [self.backend.d2h_many(copies, tag)]

    def restore(
        self, layer: int, host_blocks: tuple[int, ...], dst: torch.Tensor, tag: object
    ) -> list[TransferHandle]:
        """Host-to-device copies of one layer of ``host_blocks`` into ``dst``.

        dst: [2, >= len(host_blocks), block_size, num_kv_heads, head_dim]
        """
        assert self.host is not None, "restore without a host tier"
        copies = [(dst[kv, j], self.host[hb, layer, kv])
                  for j, hb in enumerate(host_blocks) for kv in (0, 1)]
        return [self.backend.h2d_many(copies, tag)]
