"""Facts computed once from the EngineConfig and the model: how the KV budgets split into blocks,
staging and restore room, and what the model says about itself. The config stays as given."""

from __future__ import annotations

from dataclasses import dataclass

from specstream.config import EngineConfig, default_offload_after
from specstream.models.config import ModelConfig
from specstream.options import History


@dataclass(frozen=True)
class RuntimeLayout:
    # Tokens per KV block, and the bytes of one block across all layers / of one token in one
    # layer (K and V).
    block_size: int
    block_bytes: int
    layer_token_bytes: int
    # The target's layers (a block holds one slot of each; host attention splits by layer).
    num_layers: int
    # KV blocks of the device pool (tails) and of the host tier (offloaded history).
    num_device_blocks: int
    num_host_blocks: int
    # Device bytes kept out of the pool for history in flight: the staging ring of chunk waves
    # (`stream`);
    # 0 otherwise (`restore` modes hold their two restored layers in pool blocks that each
    # admitted request reserves its share of).
    history_reserve_bytes: int
    # History past this many tokens moves to the host (resolved against the model's context).
    offload_after_tokens: int
    # The model's context and its end-of-sequence token ids.
    max_model_len: int
    eos_token_ids: frozenset[int]

    @classmethod
    def build(cls, config: EngineConfig, model: ModelConfig, dtype_bytes: int,
              eos_token_ids: frozenset[int]) -> RuntimeLayout:
        mode = config.mode_spec
        layer_token_bytes = model.kv_bytes_per_token(dtype_bytes) // model.num_layers
        block_bytes = config.block_size * model.num_layers * layer_token_bytes
        budget = config.device_budget
        history_reserve = (config.staging_buffers * config.wave_requests * config.chunk_tokens
                           * layer_token_bytes if mode.history is History.STREAM else 0)
        num_device_blocks = (budget - history_reserve) // block_bytes
        if num_device_blocks < 2:
            raise ValueError(
                f"device_kv_bytes={budget} leaves {num_device_blocks} KV blocks of "
                f"{block_bytes} bytes after {history_reserve} bytes of staging; raise it")
        max_len = model.max_position_embeddings
        if config.max_model_len is not None:
            if config.max_model_len > max_len:
                raise ValueError(
                    f"max_model_len={config.max_model_len} is longer than the model's context "
                    f"of {max_len} tokens (max_position_embeddings)")
            max_len = config.max_model_len
        return cls(
            block_size=config.block_size,
            block_bytes=block_bytes,
            layer_token_bytes=layer_token_bytes,
            num_layers=model.num_layers,
            num_device_blocks=num_device_blocks,
            num_host_blocks=config.host_kv_bytes // block_bytes if mode.offload else 0,
            history_reserve_bytes=history_reserve,
            offload_after_tokens=(config.offload_after_tokens
                                  if config.offload_after_tokens is not None
                                  else default_offload_after(max_len)),
            max_model_len=max_len,
            eos_token_ids=eos_token_ids,
        )
