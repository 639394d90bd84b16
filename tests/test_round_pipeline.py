"""Pieces of the round pipeline: the gap filler's rule, the draft's cache, the engine's chunked
attention, and a deeper staging ring (outputs unchanged)."""

from __future__ import annotations

import pytest
import torch

from specstream import LLM, SamplingParams
from specstream.attention import (
    AttentionAccumulator,
    causal_mask,
    full_attention,
    partial_attention,
)
from specstream.engine.exec.gap_filler import GapFiller
from specstream.engine.trace import Tracer
from specstream.models.loader import load_model
from specstream.spec.draft import DraftModelProposer
from specstream.spec.proposer import ProposeRequest

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


class _Clock:
    """A fake ``time.perf_counter`` for the gap filler; draft steps advance it."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


class _FakeJob:
    """A draft job whose steps each take ``step_s`` on the fake clock."""

    def __init__(self, clock: _Clock, steps: int, step_s: float) -> None:
        self.clock, self.left, self.step_s, self.ran = clock, steps, step_s, 0

    @property
    def done(self) -> bool:
        return self.left == 0

    def step(self) -> bool:
        self.clock.now += self.step_s
        self.left -= 1
        self.ran += 1
        return self.left > 0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    import specstream.engine.exec.gap_filler as overlap

    fake = _Clock()
    monkeypatch.setattr(overlap, "time", fake)
    return fake


def test_gap_filler_runs_a_step_only_while_the_link_stays_busy(clock: _Clock) -> None:
    job = _FakeJob(clock, steps=8, step_s=0.004)
    gap = GapFiller(job, Tracer(False), budget=0.0)  # type: ignore[arg-type]
    gap.step_ema = 0.004
    # the issued copies keep the link busy 10 ms: two 4 ms steps fit, a third would not
    gap.fill(lambda: False, clock.now + 0.010)
    assert job.ran == 2 and gap.overrun_s == 0.0
    # the link is done in 1 ms: a 4 ms step would leave it idle, so none runs
    gap.fill(lambda: False, clock.now + 0.001)
    assert job.ran == 2
    # a landed chunk ends the gap at once, however long the link stays busy
    gap.fill(lambda: True, clock.now + 1.0)
    assert job.ran == 2
    # what did not fit runs after verification
    assert gap.finish() == pytest.approx(6 * 0.004) and job.done


def test_gap_filler_counts_link_idle_time_against_its_budget(clock: _Clock) -> None:
    job = _FakeJob(clock, steps=3, step_s=0.010)
    gap = GapFiller(job, Tracer(False), budget=0.01)  # type: ignore[arg-type]
    clock.now += 1.0  # a second of verification so far: 10 ms of slack
    # no estimate yet: the first step runs and outlasts the link's work by 9 ms; the 1 ms of
    # slack left cannot cover another 10 ms step
    gap.fill(lambda: False, clock.now + 0.001)
    assert job.ran == 1
    assert gap.overrun_s == pytest.approx(0.009)


def test_merged_partials_lse_and_any_order() -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 8, 16, generator=g)
    k = torch.randn(300, 2, 16, generator=g)
    v = torch.randn(300, 2, 16, generator=g)
    mask = causal_mask(5, 300)
    att = AttentionAccumulator()
    for lo, hi in ((250, 300), (0, 37), (100, 250), (37, 100)):  # the masked piece comes first
        att.add(*partial_attention(q, k[lo:hi], v[lo:hi], 0.3, mask[:, lo:hi]))
    ref = full_attention(q, k, v, 0.3, mask)
    assert ((att.result() - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    _, lse = partial_attention(q, k, v, 0.3, mask)
    assert torch.allclose(att.lse(), lse, rtol=1e-5, atol=1e-5)


def test_merged_partials_empty_rows_then_very_negative_scores() -> None:
    """A fully masked first chunk must not pin the running max at 0: scores of -200 would
    underflow to nothing against it."""
    v = torch.randn(6, 1, 8, generator=torch.Generator().manual_seed(4))
    q, k = torch.ones(2, 2, 8), torch.full((6, 1, 8), -25.0)  # every score is -200
    k[4] = -24.0  # one key a little less negative
    att = AttentionAccumulator()
    att.add(*partial_attention(q, k[:3], v[:3], 1.0, torch.zeros(2, 3, dtype=torch.bool)))
    assert torch.isneginf(att.lse()).all()  # nothing attended yet
    att.add(*partial_attention(q, k[3:], v[3:], 1.0))
    ref = full_attention(q, k[3:], v[3:], 1.0)
    assert torch.isfinite(att.result()).all()
    assert torch.allclose(att.result(), ref, atol=1e-5)
    assert torch.allclose(att.lse(), torch.full((2, 2), -192.0 + 0.0), atol=1e-3)


@pytest.fixture(scope="module")
def draft_model(tiny_draft):
    return load_model(tiny_draft, torch.float32, "cpu")


def _drafts(proposer: DraftModelProposer, tokens: list[int], rounds: int) -> list[list[int]]:
    """Draft 3 tokens a round, accept the first one, and go on."""
    out = []
    for _ in range(rounds):
        prop = proposer.propose([ProposeRequest("r", tokens, 3, GREEDY)])[0]
        out.append(list(prop.token_ids))
        tokens = tokens + prop.token_ids[:1] + [7]
        proposer.rollback("r", len(tokens) - 1)
    return out


def test_window_cache_at_least_the_context_drafts_as_the_full_cache(draft_model) -> None:
    tokens = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    full = _drafts(DraftModelProposer(draft_model, "full"), tokens, 12)
    window = _drafts(DraftModelProposer(draft_model, "window", window_tokens=512), tokens, 12)
    assert window == full


def test_window_cache_stays_bounded_and_keeps_sinks(draft_model) -> None:
    p = DraftModelProposer(draft_model, "window", window_tokens=32, sink_tokens=4)
    tokens = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    _drafts(p, tokens, 40)
    c = p.caches["r"]
    assert 4 + 32 <= c.length <= 4 + 32 + p.slack + 3 + 1
    assert c.num_tokens > 200  # every token was seen; the old ones were evicted
    # the sinks are the prompt's first tokens' KV, unchanged by the evictions
    fresh = DraftModelProposer(draft_model, "full")
    fresh.propose([ProposeRequest("s", tokens[:4], 1, GREEDY)])
    assert torch.allclose(c.k[0][:4], fresh.caches["s"].k[0][:4], atol=1e-6)


def test_deeper_staging_ring_changes_nothing_but_the_schedule(tiny_target, tiny_draft) -> None:
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (300, 500, 90, 700)]
    ref = LLM(tiny_target, mode="resident", device_kv_bytes=16 << 20)
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        ref.close()
    for buffers in (2, 6):
        llm = LLM(tiny_target, mode="specstream", draft_model=tiny_draft, num_speculative_tokens=3,
                  device_kv_bytes=2_000_000, link_gbps=2.0, block_size=16, chunk_tokens=64,
                  staging_buffers=buffers, resident_tail_tokens=32, offload_after_tokens=64,
                  max_prefill_tokens=64)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
            m = llm.get_metrics()
        finally:
            llm.close()
        assert got == want, buffers
        assert m["device_kv_peak_bytes"] <= 2_000_000
