"""A robust restore baseline (issue 30, items 2 and 4): where a step's room cannot hold two whole
layers of its history, the `restore` modes restore each layer in pieces (exec/restore_pieces.py),
so they admit every request a streaming mode admits on the same budget, and decode exactly;
where the room holds them, the step restores whole layers as before. No room is reserved for
history the host attends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specstream import LLM, SamplingParams
from specstream.config import EngineConfig
from specstream.engine.layout import MIN_DEVICE_BLOCKS, RuntimeLayout
from specstream.engine.request import Request
from specstream.engine.sched.restore_room import RestoreRoom
from specstream.engine.sched.scheduler import Scheduler
from specstream.llm import default_model_dir
from specstream.models.config import ModelConfig

MiB = 1 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# as tests/test_engine_modes.py: the tiny 8-layer target's history offloads past 64 tokens
OFFLOAD = dict(block_size=16, chunk_tokens=64, resident_tail_tokens=32, offload_after_tokens=64,
               max_prefill_tokens=64, host_attention="off")
CHAIN = dict(num_speculative_tokens=3, speculative_topk=1, speculative_policy="fixed")
# 18 blocks of 16 tokens (`fill`; `tail`: 15): two layers of the step's history do not fit
SMALL = {"fill": 600_000, "tail": 500_000}


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def _run(folder, prompts, params=GREEDY, **kw) -> tuple[list[list[int]], dict, object]:
    """Greedy outputs, the metrics and the engine's history source (its piece counters)."""
    llm = LLM(folder, **kw)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.get_metrics(), llm.engine.history
    finally:
        llm.close()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompts((300, 700, 520), seed=3)


@pytest.fixture(scope="module")
def reference(tiny_target, prompts) -> list[list[int]]:
    tokens, _, _ = _run(tiny_target, prompts, mode="resident", device_kv_bytes=16 << 20)
    return tokens


TREE = dict(num_speculative_tokens=2, speculative_topk=2, speculative_num_draft_tokens=4,
            speculative_policy="fixed")


@pytest.mark.parametrize("mode, spec, residency", [
    ("offload", {}, "fill"),
    ("offload-spec", CHAIN, "fill"),
    ("offload-spec", CHAIN, "tail"),
    ("offload-spec", TREE, "fill"),
    ("parallel-spec", CHAIN, "fill"),
])
def test_pieces_decode_exactly(tiny_target, tiny_draft, prompts, reference, mode, spec,
                               residency):
    """On a budget whose room holds less than two layers of the step's history, every restore
    mode (chains and a token tree included) equals target-only greedy decoding token for
    token, restores in pieces (more copies in a step than layers), and stays within the
    budget; under `fill` two requests run at once, as `specstream` runs them there."""
    kw = dict(draft_model=tiny_draft, **spec) if spec else {}
    budget = SMALL[residency]
    tokens, m, source = _run(tiny_target, prompts, mode=mode, device_kv_bytes=budget,
                             residency=residency, **OFFLOAD, **kw)
    assert tokens == reference
    assert source.piece_steps > 0 and source.most_copies > 8  # 8 layers
    assert m["device_kv_peak_bytes"] <= budget
    assert m["max_concurrency"] == (2 if residency == "fill" else 1)
    if spec:
        assert m["proposed_tokens"] > 0


def test_a_room_that_holds_two_layers_restores_whole_layers(tiny_target, tiny_draft, prompts,
                                                           reference):
    """Where the budget can spare two whole layers, no step restores in pieces (as before:
    whole layers, the next one prefetched)."""
    tokens, m, source = _run(tiny_target, prompts, mode="offload-spec", device_kv_bytes=4 * MiB,
                             draft_model=tiny_draft, residency="tail", **CHAIN, **OFFLOAD)
    assert tokens == reference
    assert source.piece_steps == 0 and source.most_copies > 0
    assert m["max_concurrency"] == 3


def _save_tiny3(folder: Path) -> Path:
    """A tiny 3-layer Qwen3 (fp32: 256 bytes of KV per token per layer, 96 KiB a 128-token
    block of every layer): ~10 blocks in 1 MiB."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128,
                      max_position_embeddings=4096, initializer_range=0.2,
                      tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny3(tmp_path_factory.mktemp("tiny3"))


@pytest.mark.parametrize("host", [dict(host_attention="auto"),
                                  dict(host_attention_fraction=0.5)])
def test_the_users_case_is_admitted_and_exact(tiny3, host):
    """The report: `offload-spec`, 1 MiB, a 3-layer model, a 3.1K-token prompt, host attention
    on; refused before ("request needs 15 device KV blocks but the device budget holds 10")
    while `specstream` admitted it. Now both run it, equal to everything resident."""
    prompt = _prompts((3100,), seed=0)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want, _, _ = _run(tiny3, prompt, params, mode="resident", device_kv_bytes=64 * MiB)
    kw = dict(device_kv_bytes=1 * MiB, resident_tail_tokens=128, proposer="ngram", **host)
    streamed, _, _ = _run(tiny3, prompt, params, mode="specstream", **kw)
    tokens, m, source = _run(tiny3, prompt, params, mode="offload-spec", **kw)
    assert streamed == want and tokens == want
    assert source.piece_steps > 0 and m["device_kv_peak_bytes"] <= 1 * MiB
    assert m["host_kv_peak_bytes"] > 0


def _layout(**kw) -> RuntimeLayout:
    model = ModelConfig.from_dir(default_model_dir("target"))
    return RuntimeLayout.build(EngineConfig(**kw), model, 4, frozenset())


def test_the_least_budget_is_named_in_bytes_and_runs() -> None:
    """A budget below the least a restore mode runs with is refused naming that least in
    bytes: the pool's minimum and one block of room; that least itself builds, with one
    block of room (a layer restored a block at a time)."""
    for mode in ("offload", "offload-spec", "parallel-spec"):
        spec = {} if mode == "offload" else dict(proposer="ngram")
        with pytest.raises(ValueError, match=r"below the least .*: (\d+) bytes") as err:
            _layout(mode=mode, device_kv_bytes=64 * 1024, **spec)
        least = int(err.value.args[0].split(": ")[1].split(" bytes")[0])
        layout = _layout(mode=mode, device_kv_bytes=least, **spec)
        assert least == (MIN_DEVICE_BLOCKS + 1) * layout.block_bytes
        assert layout.restore_room_blocks == 1
        assert layout.num_device_blocks == MIN_DEVICE_BLOCKS + 1
        with pytest.raises(ValueError, match="below the least"):
            _layout(mode=mode, device_kv_bytes=least - 1, **spec)


def _admits(mode: str, budget: int, prompt_len: int, **kw) -> bool:
    """Whether an idle engine of ``mode`` on the tiny 3-layer shape admits a prompt."""
    model = ModelConfig(family="qwen3", vocab_size=128, hidden_size=64, num_layers=3,
                        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                        max_position_embeddings=1 << 16)
    config = EngineConfig(mode=mode, device_kv_bytes=budget, proposer="ngram", **kw)
    try:
        layout = RuntimeLayout.build(config, model, 4, frozenset())
        sched = Scheduler.for_layout(config, layout)
        sched.add(Request("r", list(range(prompt_len)), SamplingParams(max_tokens=32)))
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("kw", [{}, dict(resident_tail_tokens=128),
                                dict(residency="tail", chunk_tokens=512)])
def test_restore_admits_what_specstream_admits(kw) -> None:
    """On every budget from below the least to several MiB and every prompt length, a request
    `specstream` admits is admitted by `offload-spec` and `parallel-spec`."""
    cases = [(b, n) for b in range(256 * 1024, 6 * MiB, 160 * 1024)
             for n in (600, 3100, 12_000, 40_000)]
    admitted = [(b, n) for b, n in cases if _admits("specstream", b, n, **kw)]
    assert 0 < len(admitted) < len(cases)  # the sweep crosses the edge
    for budget, n in admitted:
        assert _admits("offload-spec", budget, n, **kw), (budget, n)
        assert _admits("parallel-spec", budget, n, **kw), (budget, n)


def test_the_room_lends_whole_layers_where_spare_and_reserves_no_host_share() -> None:
    """The room's policy: two whole layers where the pool spares them, else what is spare,
    never less than the guaranteed room; admission holds at most the guaranteed room; the
    host's fixed share of cold blocks takes no room."""
    room = RestoreRoom(layers=4, guaranteed=3)
    assert room.whole(10) == 5  # 20 layer-blocks in 4 planes a block
    assert room.lend(10, spare=9) == 5  # whole layers, as before
    assert room.lend(10, spare=4) == 4 and room.lend(10, spare=1) == 3
    assert room.lend(0, spare=9) == 0
    assert room.reserved(5) == 3 and room.reserved(2) == 2
    half = RestoreRoom(layers=4, guaranteed=3, host_fraction=0.5)
    assert half.link_blocks(11) == 6 and RestoreRoom(4, 3).link_blocks(11) == 11
    # the scheduler's reservation: the host's half of the cold blocks is not restored
    config = dict(mode="offload-spec", proposer="ngram", device_kv_bytes=64 * MiB, block_size=16,
                  resident_tail_tokens=32, offload_after_tokens=64)
    model = ModelConfig(family="qwen3", vocab_size=128, hidden_size=64, num_layers=4,
                        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                        max_position_embeddings=4096)
    held = []
    for extra in ({}, dict(host_attention_fraction=0.5)):
        cfg = EngineConfig(**config, **extra)
        sched = Scheduler.for_layout(cfg, RuntimeLayout.build(cfg, model, 4, frozenset()))
        req = Request("r", list(range(1600)), SamplingParams(max_tokens=32))
        held.append(sched.admission.reservation(req).restore_blocks)
    assert held[1] < held[0] and held[1] == -(-2 * (100 - 50) // 4)


@pytest.mark.parametrize("lent", [(3, 4), (6,), (2, 7, 9)])
def test_pieces_return_every_layer_bit_for_bit(lent):
    """Lent fewer blocks than two layers need, the source restores each request's layer
    history in pieces of at most half the room, two in flight where two fit (the next one
    issued while one is attended), which together are its host history, bit for bit."""
    from specstream.backends import make_backend
    from specstream.engine.contract import SeqWork, StepPlan
    from specstream.engine.exec.history import make_source
    from specstream.kvcache.storage import KVStore

    cfg = ModelConfig(family="qwen3", vocab_size=8, hidden_size=32, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=8,
                      max_position_embeddings=64)
    backend = make_backend("cpu")
    try:
        store = KVStore(cfg, torch.float32, 4, num_device_blocks=12, num_host_blocks=10,
                        backend=backend)
        store.host.copy_(torch.randn(store.host.shape))
        histories = [(7, 2, 9), (0, 5, 1, 4)]  # host blocks of two requests: 14 slots wanted
        seqs = tuple(SeqWork(f"r{i}", (1,), 4 * len(h), 0, False, True, 4 * len(h), (i,),
                             (h,)) for i, h in enumerate(histories))
        source = make_source("restore", store, 4, 2)
        room = 3 * len(lent)
        for _ in range(2):  # a second step through the same source
            source.begin(StepPlan(seqs, restore_blocks=lent), [[0, 1]])
            for layer in range(3):
                got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
                for wave in source.waves(layer):
                    ring = source.ring
                    assert ring is not None
                    if room >= 2 and ring.jobs:  # double-buffered: the next one in flight
                        assert len(ring.pending) >= 2
                    [(_, k, v, shape)] = source.landed(wave)
                    assert k.shape[1] <= 4 * max(1, room // 2)
                    got[int(shape.index[0])].append(torch.stack([k[0], v[0]]))
                    source.release(wave)
                for i, h in enumerate(histories):
                    want = store.host_rows(layer)[list(h)]  # [blocks, 2, bs, kv, D]
                    want = want.transpose(0, 1).reshape(2, -1, 2, 8)
                    assert torch.equal(torch.cat(got[i], dim=1), want)
            source.end()
        assert source.piece_steps == 2 and source.most_copies > 3
    finally:
        backend.close()


def test_every_piece_is_copied_after_the_compute_queued_before_it() -> None:
    """Slots are reused within a step: every copy into them is ordered after the compute
    queued before it (``after_compute``; on CUDA the copy stream waits for the attention that
    read the slot), as the whole-layer path's copies are."""
    from test_cuda_backend import RecordingBackend, plan, tiny_store

    from specstream.engine.exec.restore import LayerRestore

    backend = RecordingBackend()
    try:
        store = tiny_store(backend)
        source = LayerRestore(store, chunk_tokens=8, staging_buffers=2)
        work = plan(((0, 1), (2, 3), (4,)), ((5, 6),))  # 7 blocks a layer, 6 slots lent
        source.begin(work, [[0, 1]])  # type: ignore[arg-type]
        for layer in range(store.cfg.num_layers):
            keys = [0, 0]
            for _, k, _, shape in source.drain(layer):
                keys[int(shape.index[0])] += k.shape[1]
            assert keys == [20, 8]
        source.end()
        assert source.piece_steps == 1
        assert backend.log and all(after for _, _, after in backend.log)
    finally:
        backend.close()
