"""KV tensors of both tiers.

Both tiers are layer-major: ``[num_layers, 2 (K, V), num_blocks, block_size, kv_heads,
head_dim]``. On the device a request's consecutive blocks of one layer are one contiguous view
(attention reads them without a copy). On the host a run of consecutive blocks of one layer is
one contiguous source per K/V plane, so restoring a chunk (the hot path: every round, every
layer) is two copies per run of blocks on a DMA engine, not two per block; a write-back (once
per block) gathers its block's layers, which a backend may split into contiguous copies.
"""

from __future__ import annotations

import torch

from specstream.backends.base import TransferBackend, TransferHandle
from specstream.kvcache.manager import BlockCopy, CopyKind
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
        tok = (block_size, cfg.num_kv_heads, cfg.head_dim)
        # zeroed once: attention reads padding rows of partly filled blocks (masked, but a
        # NaN left in free memory would survive a mask), so every slot must hold a finite value
        self.device = backend.alloc_device((cfg.num_layers, 2, num_device_blocks, *tok),
                                           dtype).zero_()
        self.host = (
            backend.alloc_host((cfg.num_layers, 2, num_host_blocks, *tok), dtype)
            if num_host_blocks else None
        )
        self._host_rows: list[torch.Tensor] = []

    def release(self) -> None:
        """Drop both tiers' tensors (the engine is closing): an engine object that outlives
        its close no longer holds the memory, or the host tier's address space."""
        self.device = self.device.new_empty(0)
        self.host = None
        self._host_rows = []

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
        self.device[layer, 0, blocks, offsets] = k.to(self.dtype)
        self.device[layer, 1, blocks, offsets] = v.to(self.dtype)

    def gather(
        self, layer: int, blocks: torch.Tensor, num_tokens: int, first: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[num_tokens, num_kv_heads, head_dim]`` of a request's tail blocks.

        ``first >= 0`` says the blocks are consecutive from ``first``: a view, no copy.
        """
        if first >= 0:
            x = self.device[layer, :, first : first + blocks.numel()]  # [2, nb, bs, kv, D]
        else:
            x = self.device[layer].index_select(1, blocks)
        flat = x.reshape(2, -1, self.cfg.num_kv_heads, self.cfg.head_dim)
        return flat[0, :num_tokens], flat[1, :num_tokens]

    def copy_blocks(self, copies: tuple[BlockCopy, ...]) -> None:
        """Whole-block copies (all layers), synchronous: within a tier (prefix-cache hits), or
        host to device over the link (a shared block's device copy), one transfer a layer."""
        for kind in CopyKind:
            pairs = [(s, d) for k, s, d in copies if k is kind]
            if not pairs:
                continue
            if kind is CopyKind.HOST_TO_DEVICE:
                host, rows = [s for s, _ in pairs], torch.tensor([d for _, d in pairs])
                for handle in [self.restore_rows(layer, torch.tensor(host),
                                                 self.device[layer].transpose(0, 1),
                                                 "shared-device", rows=rows)
                               for layer in range(self.cfg.num_layers)]:
                    handle.wait()
                continue
            tier = self.host if kind is CopyKind.HOST_TO_HOST else self.device
            assert tier is not None, f"{kind.value} copy without that tier"
            src = dst = tier
            s_idx = torch.tensor([s for s, _ in pairs], device=src.device)
            d_idx = torch.tensor([d for _, d in pairs], device=dst.device)
            dst.index_copy_(2, d_idx, src.index_select(2, s_idx).to(dst.device))

    def writeback(self, pairs: list[tuple[int, int]], tag: object) -> list[TransferHandle]:
        """Device-to-host copies of whole blocks (all layers), low priority, one transfer."""
        assert self.host is not None, "write-back without a host tier"
        copies = [(self.host[:, :, h], self.device[:, :, d]) for d, h in pairs]
        return [self.backend.d2h_many(copies, tag)]

    def restore(
        self, layer: int, host_blocks: tuple[int, ...], dst: torch.Tensor, tag: object
    ) -> list[TransferHandle]:
        """Host-to-device copies of one layer of ``host_blocks`` into ``dst``.

        dst: [2, >= len(host_blocks), block_size, num_kv_heads, head_dim]
        """
        assert self.host is not None, "restore without a host tier"
        rows = dst.transpose(0, 1)  # [blocks, 2, block_size, kv, D]: a view of dst
        return [self.backend.h2d_gather(rows, self.host_rows(layer), list(host_blocks), tag)]

    def host_rows(self, layer: int) -> torch.Tensor:
        """The host tier of one layer as rows of blocks, ``[num_blocks, 2, block_size,
        num_kv_heads, head_dim]`` (a view, made once)."""
        assert self.host is not None, "no host tier"
        if not self._host_rows:
            self._host_rows = [self.host[i].transpose(0, 1) for i in range(self.cfg.num_layers)]
        return self._host_rows[layer]

    def restore_rows(
        self, layer: int, host_blocks: torch.Tensor, dst_rows: torch.Tensor, tag: object,
        rows: torch.Tensor | None = None,
    ) -> TransferHandle:
        """One layer of ``host_blocks`` (``[n]`` long) into blocks ``rows`` of ``dst_rows``
        (None: the first n) as one transfer: a chunk wave.

        dst_rows: [blocks, 2, block_size, num_kv_heads, head_dim] (a staging slot seen as rows
        of blocks: ``slot.transpose(0, 1)``)
        """
        return self.backend.h2d_gather(dst_rows, self.host_rows(layer), host_blocks, tag,
                                       rows=rows)
