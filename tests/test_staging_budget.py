"""The staging ring sized to the device budget (issue 30, item 1): small budgets that ran before
chunk waves start again, the configured ring is kept where the budget can spare it, and a budget
below the least the model runs with is refused naming that least in bytes."""

from __future__ import annotations

import pytest

from specstream import LLM, SamplingParams
from specstream.config import EngineConfig
from specstream.engine.layout import MIN_DEVICE_BLOCKS, STAGING_SHARE, RuntimeLayout, staging_ring
from specstream.llm import default_model_dir
from specstream.models.config import ModelConfig

MiB = 1 << 20
TARGET = default_model_dir("target")


def _layout(**kw) -> RuntimeLayout:
    return RuntimeLayout.build(EngineConfig(**kw), ModelConfig.from_dir(TARGET), 4, frozenset())


def test_the_configured_ring_is_kept_where_it_fits() -> None:
    assert staging_ring(64 * MiB, 2 * MiB, 2, 8) == (2, 8)
    assert staging_ring(64 * MiB, 2 * MiB, 4, 2) == (4, 2)


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
