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
    # (`stream`); 0 otherwise (`restore` modes hold their restored layers in pool blocks lent
    # to each step; see restore_room_blocks).
    history_reserve_bytes: int
    # History past this many tokens moves to the host (resolved against the model's context).
    offload_after_tokens: int
    # The model's context and its end-of-sequence token ids.
    max_model_len: int
    eos_token_ids: frozenset[int]
    # The staging ring as sized to the budget (``staging_ring``): waves in the ring and
    # requests per wave (the configured ones where the budget can spare them).
    staging_buffers: int = 2
    wave_requests: int = 8
    # The device KV budget this run (``EngineConfig.device_budget``).
    device_budget_bytes: int = 0
    # Tokens of one request's history a chunk (``auto_chunk_tokens`` where not configured).
    chunk_tokens: int = 2048
    # `restore` modes: pool blocks the budget guarantees a step's restores (``restore_room``):
    # two whole layers of history where they fit in it or in what else is free, a layer in
    # pieces otherwise; 0 in other modes.
    restore_room_blocks: int = 0

    @classmethod
    def build(cls, config: EngineConfig, model: ModelConfig, dtype_bytes: int,
              eos_token_ids: frozenset[int], free_device_bytes: int | None = None
              ) -> RuntimeLayout:
        """``free_device_bytes``: the device's free memory once the models are loaded (the
        budget's base on CUDA without device_kv_bytes)."""
        mode = config.mode_spec
        layer_token_bytes = model.kv_bytes_per_token(dtype_bytes) // model.num_layers
        block_bytes = config.block_size * model.num_layers * layer_token_bytes
        budget = config.device_budget(free_device_bytes)
        buffers, wave = config.staging_buffers, config.wave_requests
        chunk = (config.chunk_tokens if config.chunk_tokens is not None else
                 auto_chunk_tokens(budget, buffers * wave * layer_token_bytes, config.block_size))
        region_bytes = chunk * layer_token_bytes  # one chunk of one request
        history_reserve, room = 0, 0
        if mode.history is History.STREAM:
            buffers, wave = staging_ring(budget, region_bytes, buffers, wave,
                                         MIN_DEVICE_BLOCKS * block_bytes)
            history_reserve = buffers * wave * region_bytes
        num_device_blocks = (budget - history_reserve) // block_bytes
        if mode.history is History.RESTORE:
            room = restore_room(budget, block_bytes, region_bytes, buffers, wave)
        if num_device_blocks < MIN_DEVICE_BLOCKS + room:
            least = MIN_DEVICE_BLOCKS * block_bytes + (
                region_bytes if mode.history is History.STREAM else 0)
            staging = (f" and one {chunk}-token chunk of staging ({region_bytes} "
                       "bytes; a smaller chunk_tokens needs less)"
                       if mode.history is History.STREAM else "")
            if mode.history is History.RESTORE:
                least += block_bytes
                staging = " and one more of room to restore history in"
            raise ValueError(
                f"device_kv_bytes={budget} is below the least this model runs with in mode "
                f"{config.mode}: {least} bytes ({MIN_DEVICE_BLOCKS} KV blocks of {block_bytes} "
                f"bytes{staging})")
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
            staging_buffers=buffers,
            wave_requests=wave,
            device_budget_bytes=budget,
            restore_room_blocks=room,
            chunk_tokens=chunk,
        )


MIN_DEVICE_BLOCKS = 2  # KV blocks the pool needs at least (a request's tail and its next)
# The staging ring takes at most this share of the device budget (the rest holds KV blocks).
STAGING_SHARE = 0.5
# Where chunk_tokens is not configured: the longest chunk, the ring's share of the budget that
# shorter chunks keep it to, and the shortest chunk they go down to.
AUTO_CHUNK_TOKENS, AUTO_STAGING_SHARE, MIN_AUTO_CHUNK_TOKENS = 2048, 0.125, 256


def auto_chunk_tokens(budget: int, ring_token_bytes: int, block_size: int) -> int:
    """The chunk of a ring of ``ring_token_bytes`` per chunk token (its waves x requests x
    one layer's token): AUTO_CHUNK_TOKENS where that ring fits in AUTO_STAGING_SHARE of the
    budget, else halved until it does or reaches MIN_AUTO_CHUNK_TOKENS (a block at least;
    always a multiple of block_size). A shorter chunk costs more waves a layer on long
    histories; a ring too large for the budget costs the blocks every request's KV needs."""
    chunk = max(1, AUTO_CHUNK_TOKENS // block_size) * block_size
    least = max(1, MIN_AUTO_CHUNK_TOKENS // block_size) * block_size
    while chunk > least and chunk * ring_token_bytes > AUTO_STAGING_SHARE * budget:
        chunk = max(least, chunk // 2 // block_size * block_size)
    return chunk


def restore_room(budget: int, block_bytes: int, region_bytes: int, buffers: int, wave: int
                 ) -> int:
    """Pool blocks of a `restore` mode's guaranteed room on a device budget: those the staging
    ring would take from a streaming mode's pool on the same budget (so the tails it admits
    fit here too), at least one (a layer restored one block at a time, in its planes), and
    never so many that the pool keeps fewer than ``MIN_DEVICE_BLOCKS`` besides."""
    ring = staging_ring(budget, region_bytes, buffers, wave, MIN_DEVICE_BLOCKS * block_bytes)
    ring_bytes = ring[0] * ring[1] * region_bytes
    taken = budget // block_bytes - max(0, budget - ring_bytes) // block_bytes
    return max(1, min(taken, budget // block_bytes - MIN_DEVICE_BLOCKS))


def staging_ring(budget: int, region_bytes: int, buffers: int, wave: int, keep: int = 0
                 ) -> tuple[int, int]:
    """(waves, requests per wave) of the staging ring for a device budget: the configured
    ``buffers x wave`` chunk regions where they fit in ``STAGING_SHARE`` of the budget and
    leave ``keep`` bytes (the pool's least), else as many regions as fit there (never fewer
    than one chunk of one request), as at least two waves where two regions fit and more than
    one wave was asked for (a copy lands while the previous wave is attended)."""
    fit = max(1, min(int(budget * STAGING_SHARE), budget - keep) // region_bytes)
    if buffers * wave <= fit:
        return buffers, wave
    if buffers == 1:
        return 1, min(wave, fit)
    wave = min(wave, max(1, fit // 2))
    return min(buffers, fit // wave), wave
