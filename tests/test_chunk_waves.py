"""Chunk waves in the engine: one attention call per wave whatever the number of requests, the
Triton path equal to the torch path (under Triton's interpreter on the CPU), and acceptance that
reads nothing back until its one read-back."""

from __future__ import annotations

import pytest
import torch
from helpers import reads_per_round

from specstream import LLM, SamplingParams
from specstream.attention import waves
from specstream.attention.waves import TorchWaves
from specstream.spec.acceptance import accept_drafts, accept_drafts_on_device

OFFLOAD = dict(block_size=16, chunk_tokens=64, resident_tail_tokens=32, offload_after_tokens=64,
               max_prefill_tokens=64)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


class CountingWaves(TorchWaves):
    calls = 0

    def add(self, k, v, shape):  # type: ignore[no-untyped-def]
        CountingWaves.calls += 1
        super().add(k, v, shape)


def _decode_round_calls(tiny_target, num_requests: int, wave_requests: int) -> tuple[int, int]:
    """Attention calls of the first decode round that verifies every request (no prefill in
    it), and the model's layer count. Every request has 4 history chunks of 64 tokens."""
    llm = LLM(tiny_target, mode="stream", device_kv_bytes=8_000_000, residency="tail",
              host_attention="off",
              wave_requests=wave_requests, **dict(OFFLOAD, max_prefill_tokens=2048))
    eng = llm.engine
    eng.worker.attention = CountingWaves
    for p in _prompts((4 * 64 + 40,) * num_requests):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    try:
        for _ in range(200):
            CountingWaves.calls = 0
            before = len(eng.rounds)
            eng.step()
            if len(eng.rounds) > before:
                r = eng.rounds[-1]
                if r.num_seqs == num_requests and r.prefill_tokens == 0:
                    return CountingWaves.calls, eng.model_config.num_layers
        raise AssertionError("no decode round verified every request")
    finally:
        llm.close()


@pytest.mark.parametrize("num_requests", [1, 4])
def test_attention_calls_per_round_do_not_grow_with_requests(tiny_target, num_requests):
    """A decode round attends, per layer, 4 chunk waves and one tail wave, whether it verifies
    one request or four."""
    calls, layers = _decode_round_calls(tiny_target, num_requests, wave_requests=8)
    assert calls == layers * (4 + 1)


def test_wave_width_splits_a_bucket(tiny_target):
    """With two requests per wave, four requests' j-th chunks are two waves."""
    calls, layers = _decode_round_calls(tiny_target, 4, wave_requests=2)
    assert calls == layers * (2 * 4 + 1)


def test_a_wave_ends_at_its_longest_chunk(tiny_target):
    """A history wave's keys end at its longest chunk, not at its staging region's end: a
    request's last chunk, shorter than chunk_tokens, is attended without padding (the tail
    waves pad to a block at most). Outputs equal resident's."""
    widths: list[tuple[int, int]] = []  # (keys in the wave, longest request's keys)

    class Widths(TorchWaves):
        def add(self, k, v, shape):  # type: ignore[no-untyped-def]
            widths.append((k.shape[1], int(shape.key_len.max())))
            super().add(k, v, shape)

    prompts = _prompts((150, 230))
    ref = LLM(tiny_target, mode="resident", device_kv_bytes=4_000_000, block_size=16)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY, use_tqdm=False)]
    ref.close()
    llm = LLM(tiny_target, mode="stream", device_kv_bytes=1_000_000, residency="tail",
              host_attention="off", **OFFLOAD)
    llm.engine.worker.attention = Widths
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.close()
    assert got == want
    chunk = OFFLOAD["chunk_tokens"]
    assert any(longest < chunk for _, longest in widths)  # short last chunks were streamed
    assert all(keys - longest < OFFLOAD["block_size"] for keys, longest in widths)


@pytest.mark.skipif(not waves.triton_available(), reason="triton cannot be imported here")
def test_triton_engine_path_equals_torch(tiny_target, tiny_draft):
    """The engine's Triton path (Triton's interpreter on the CPU) decodes what the torch path
    decodes, streamed history, ragged chunks and speculation included."""
    prompts = _prompts((150, 230))
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_target, mode="specstream", draft_model=tiny_draft,
                  device_kv_bytes=1_000_000, attention_backend=backend, **OFFLOAD)
        assert llm.engine.worker.attention is waves.ATTENTION.get(backend)
        outs[backend] = [o.outputs[0].token_ids
                         for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        llm.close()
    assert outs["triton"] == outs["torch"]


def test_auto_backend_is_torch_on_cpu():
    assert waves.resolve_backend("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        from specstream.config import EngineConfig

        EngineConfig(attention_backend="flash")


def test_acceptance_reads_nothing_back_before_its_one_read_back(monkeypatch):
    """accept_drafts_on_device never reads a device value (no .tolist/.item/.cpu/int());
    accept_drafts then reads tokens and counts back in one .tolist()."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    drafts = torch.randint(0, 11, (3, 4), generator=g)
    probs = torch.softmax(torch.randn(3, 4, 11, generator=g), -1)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=2)]
    gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    want = accept_drafts(logits, drafts, [4, 2, 3], probs, params,
                         [None, torch.Generator().manual_seed(1),
                          torch.Generator().manual_seed(2)])

    reads: list[str] = []
    for name in ("tolist", "item", "cpu", "__int__", "__bool__", "__index__"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _name=name, _real=real, **k):  # type: ignore[no-untyped-def]
            reads.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    num_accepted, tokens = accept_drafts_on_device(logits, drafts, [4, 2, 3], probs, params,
                                                   gens)
    assert reads == []
    monkeypatch.undo()
    got = [t[: n + 1] for t, n in zip(tokens.tolist(), num_accepted.tolist())]
    assert got == want.output_tokens


def test_a_specstream_decode_round_reads_back_once(tiny_target, tiny_draft, monkeypatch):
    """A decode round of `specstream` (one group verified, the other drafting) brings its
    results home in one read-back: the verified tokens and counts and the new drafts together.
    Counted as reads of tensor values (.tolist/.item/.cpu/int()/bool()) during Worker.run."""
    llm = LLM(tiny_target, mode="specstream", draft_model=tiny_draft, device_kv_bytes=2_000_000,
              speculative_policy="fixed",  # drafts every round, whatever a loaded machine times
              merge_groups=False,  # two groups: one verifies while the other drafts
              **dict(OFFLOAD, max_prefill_tokens=2048))
    eng = llm.engine
    for p in _prompts((300, 280, 260, 240)):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    counted = reads_per_round(
        eng, monkeypatch, lambda plan: plan.seqs and not any(s.prefill for s in plan.seqs)
        and any(not d.after_verify for d in plan.drafts), max_steps=60)
    llm.close()
    assert len(counted) >= 3
    assert counted == [1] * len(counted)


def test_draft_stream_drafting_enqueues_after_the_first_copies(tiny_target, tiny_draft):
    """`draft-stream` (specstream's drafting on CUDA), driven on the CPU with a stand-in stream:
    the other group's draft steps are enqueued once the round's first copies are in flight (the
    link never waits for the host to enqueue them), joined before the read-back, and the output
    is the target's greedy output."""
    from contextlib import contextmanager

    from specstream.engine.exec.drafting import DRAFTING

    prompts = _prompts((300, 280, 260, 240))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm = LLM(tiny_target, mode="specstream", draft_model=tiny_draft, device_kv_bytes=2_000_000,
              **OFFLOAD)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()

    llm = LLM(tiny_target, mode="specstream", draft_model=tiny_draft, device_kv_bytes=2_000_000,
              speculative_policy="fixed",  # drafts every round
              merge_groups=False, **OFFLOAD)  # two groups: the other one drafts meanwhile
    eng = llm.engine
    events: list[str] = []
    backend = eng.backend

    @contextmanager
    def draft_stream():  # type: ignore[no-untyped-def]
        events.append("draft-stream")
        yield "stream"

    backend.draft_stream = draft_stream  # type: ignore[attr-defined]
    backend.join = lambda stream: events.append(f"join {stream}")  # type: ignore[attr-defined]
    real_restore = eng.store.restore_rows

    def restore_rows(*a, **k):  # type: ignore[no-untyped-def]
        events.append("copy")
        return real_restore(*a, **k)

    eng.store.restore_rows = restore_rows  # type: ignore[method-assign]
    real_run = eng.worker.run

    def run(plan, *args):  # type: ignore[no-untyped-def]
        events.append("step")
        return real_run(plan, *args)

    eng.worker.run = run  # type: ignore[method-assign]
    eng.worker.drafting = DRAFTING.get("draft-stream")(eng.tracer, backend)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()
    assert got == want
    drafted = [i for i, e in enumerate(events) if e == "draft-stream"]
    assert drafted and events.count("join stream") == len(drafted)
    # within a step that copies history, the draft steps were queued after its first copies
    checked = 0
    for i in drafted:
        start = max(j for j in range(i) if events[j] == "step")
        end = next((j for j in range(i, len(events)) if events[j] == "step"), len(events))
        if "copy" in events[start:end]:
            assert "copy" in events[start:i], events[start : i + 1]
            checked += 1
    assert checked >= 3
