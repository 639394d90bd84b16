"""The staging ring sized to the device budget (issue 30, item 1): small budgets that ran before
chunk waves start again, the configured ring is kept where the budget can spare it, and a budget
below the least the model runs with is refused naming that least in bytes."""

from __future__ import annotations

import pytest

from specstream import LLM, SamplingParams
from specstream.config import EngineConfig
from specstream.engine.layout import (
    AUTO_CHUNK_TOKENS,
    AUTO_STAGING_SHARE,
    MIN_AUTO_CHUNK_TOKENS,
    MIN_DEVICE_BLOCKS,
    STAGING_SHARE,
    RuntimeLayout,
    auto_chunk_tokens,
    staging_ring,
)
from specstream.llm import default_model_dir
from specstream.models.config import ModelConfig

MiB = 1 << 20
TARGET = default_model_dir("target")


def _layout(**kw) -> RuntimeLayout:
    return RuntimeLayout.build(EngineConfig(**kw), ModelConfig.from_dir(TARGET), 4, frozenset())


def test_the_configured_ring_is_kept_where_it_fits() -> None:
    assert staging_ring(64 * MiB, 2 * MiB, 2, 8) == (2, 8)
    assert staging_ring(64 * MiB, 2 * MiB, 4, 2) == (4, 2)


def test_the_chunk_is_2048_tokens_where_the_budget_spares_a_ring_of_them() -> None:
    ring = 2 * 8 * 1024  # bytes of the ring per chunk token (2 waves x 8 requests x 1 KiB)
    assert auto_chunk_tokens(4 << 30, ring, 128) == AUTO_CHUNK_TOKENS == 2048
    assert auto_chunk_tokens(int(2048 * ring / AUTO_STAGING_SHARE), ring, 128) == 2048
    assert auto_chunk_tokens(int(2048 * ring / AUTO_STAGING_SHARE) - 1, ring, 128) == 1024


@pytest.mark.parametrize("budget", [1 * MiB, 12 * MiB, 47 * MiB, 100 * MiB, 300 * MiB])
@pytest.mark.parametrize("block", [16, 128, 256, 512])
def test_a_small_budget_shortens_the_chunk_to_keep_its_blocks(budget: int, block: int) -> None:
    ring = 2 * 8 * 1024
    chunk = auto_chunk_tokens(budget, ring, block)
    assert chunk % block == 0 and block <= chunk <= AUTO_CHUNK_TOKENS
    least = max(block, MIN_AUTO_CHUNK_TOKENS)
    # within the share, or as short as it goes; never shorter than it had to be
    assert chunk * ring <= AUTO_STAGING_SHARE * budget or chunk == least
    assert chunk == least or 2 * chunk > AUTO_CHUNK_TOKENS or (
        2 * chunk * ring > AUTO_STAGING_SHARE * budget)


def test_the_auto_chunk_leaves_a_small_budget_more_blocks_and_a_given_one_is_kept() -> None:
    """The matrix's 12 x 1K cell at 0.6 of its KV (46.7 MB): 2048-token chunks took 21 MB of
    it for staging (32 blocks left); the auto chunk keeps the ring to an eighth."""
    auto = _layout(mode="specstream", proposer="ngram", device_kv_bytes=46_714_060)
    given = _layout(mode="specstream", proposer="ngram", device_kv_bytes=46_714_060,
                    chunk_tokens=2048)
    assert given.chunk_tokens == 2048 and given.num_device_blocks == 32
    assert auto.chunk_tokens < 2048
    assert auto.history_reserve_bytes <= AUTO_STAGING_SHARE * 46_714_060
    assert auto.num_device_blocks >= 50
    big = _layout(mode="specstream", proposer="ngram", device_kv_bytes=4 << 30)
    assert big.chunk_tokens == 2048 and (big.staging_buffers, big.wave_requests) == (2, 8)
    # the restore modes take the same room out of their pool, so they admit the same tails
    restore = _layout(mode="offload-spec", proposer="ngram", device_kv_bytes=46_714_060)
    assert restore.chunk_tokens == auto.chunk_tokens
    assert restore.num_device_blocks - restore.restore_room_blocks == auto.num_device_blocks


@pytest.mark.parametrize("budget", [1 * MiB, 3 * MiB, 16_000_000, 24_000_000, 40 * MiB])
@pytest.mark.parametrize("asked", [(2, 8), (1, 8), (4, 2)])
def test_a_ring_that_does_not_fit_shrinks_to_the_share(budget: int, asked: tuple[int, int]
                                                       ) -> None:
    buffers, wave = staging_ring(budget, 2 * MiB, *asked)
    assert 1 <= buffers <= asked[0] and 1 <= wave <= asked[1]
    fit = int(budget * STAGING_SHARE) // (2 * MiB)
    # within the share, and never less than one chunk of one request
    assert buffers * wave <= max(1, fit)
    if asked[0] > 1 and fit >= 2:
        assert buffers >= 2  # a copy in flight while the previous wave is attended


@pytest.mark.parametrize("budget", [16_000_000, 24_000_000])
def test_small_budgets_start_in_every_streaming_mode(budget: int) -> None:
    """The issue's budgets: refused before (a 32 MB ring on the embedded pair), run now."""
    for mode in ("stream", "specstream"):
        spec = {"proposer": "ngram"} if mode == "specstream" else {}
        layout = _layout(mode=mode, device_kv_bytes=budget, **spec)
        assert layout.history_reserve_bytes <= budget * STAGING_SHARE
        assert layout.num_device_blocks >= MIN_DEVICE_BLOCKS
        assert (layout.history_reserve_bytes + layout.num_device_blocks * layout.block_bytes
                <= budget)


def test_the_least_budget_is_named_in_bytes_and_runs() -> None:
    with pytest.raises(ValueError, match=r"below the least .*: (\d+) bytes") as err:
        _layout(mode="stream", device_kv_bytes=1 * MiB)
    least = int(err.value.args[0].split(": ")[1].split(" bytes")[0])
    layout = _layout(mode="stream", device_kv_bytes=least)
    assert layout.num_device_blocks == MIN_DEVICE_BLOCKS
    with pytest.raises(ValueError, match="below the least"):
        _layout(mode="stream", device_kv_bytes=least - 1)


def test_a_16_mb_budget_streams_and_equals_resident() -> None:
    """``specstream generate --mode specstream --device-kv-bytes 16e6``, as the offline API
    runs it, on prompts longer than the device holds (15 blocks of 128 tokens next to a
    4 MiB ring): history streams through the shrunk ring, greedy output equal to everything
    resident."""
    import torch

    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(10, 1000, (n,), generator=g).tolist()}
               for n in (1500, 2200)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs, metrics = {}, {}
    for mode, budget in (("resident", 256 * MiB), ("specstream", 16_000_000)):
        llm = LLM(mode=mode, device_kv_bytes=budget, link_gbps=4.0)
        try:
            outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                       use_tqdm=False)]
            metrics[mode] = llm.get_metrics()
        finally:
            llm.close()
    assert outs["specstream"] == outs["resident"]
    assert metrics["specstream"]["link_bytes_per_round"] > 0  # history did stream
    assert metrics["specstream"]["device_kv_peak_bytes"] <= 16_000_000
