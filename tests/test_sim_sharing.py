"""The simulator's model of prefix sharing (issue 31): the replay of requests that share a prefix
moves each shared block once a round, as the engine's meter counts it; the round pipeline moves
the shared document once per verification; the committed shared-doc bench replays."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from specstream.sim.api import Scenario
from specstream.sim.engine_model import Geometry, engine_config
from specstream.sim.memory import plan
from specstream.sim.replay import ReplaySetup, replay
from specstream.sim.rounds import best_round
from specstream.sim.shared_replay import (
    is_shared_bench,
    shared_predictions,
    shared_setups,
    shared_table,
)
from specstream.sim.sharing_table import SHARING_MODES, SharedDoc, sharing_rows
from specstream.sim.step_cost import StepCost
from specstream.sim.workload import AcceptanceModel

RESULTS = Path(__file__).parents[1] / "bench" / "results"
SHARED_DOC = RESULTS / "shared-doc-link-bound.json"
THROUGHPUT_BOUND = 0.15  # issue 31: the simulator predicts the shared-doc run within 15%

# A small replay: 4 requests, each an 8-block document and 2 blocks of its own (16-token
# blocks, 2 layers, 64 bytes of KV a token), residency tail with a one-block tail: each
# request's cold history is the 8 document blocks and the first of its own (its newest block
# is the resident tail), through 12 output tokens.
BS, N, D_BLOCKS, OWN_COLD = 16, 4, 8, 1
GEOMETRY = Geometry(2, 64)
BLOCK_BYTES = BS * 64
SETTINGS = {"block_size": BS, "residency": "tail", "resident_tail_tokens": BS,
            "offload_after_tokens": BS, "device_kv_bytes": 256 * BLOCK_BYTES,
            "max_prefill_tokens": 1024, "chunk_tokens": 4 * BS, "host_attention": "off",
            "speculative_policy": "fixed", "num_speculative_tokens": 2}


def _setup(mode: str, sharing: bool) -> ReplaySetup:
    return ReplaySetup(
        mode=mode, config=engine_config(SETTINGS, mode, prefix_sharing=sharing),
        geometry=GEOMETRY, prompts=((D_BLOCKS + 2) * BS,) * N, output_len=12,
        acceptance=AcceptanceModel(alpha=0.5), cost=StepCost((1e-3,) + (0.0,) * 8),
        link_bw=1e9, shared_prefix=D_BLOCKS * BS)


@pytest.mark.parametrize("mode", ["offload", "offload-spec", "specstream", "parallel-spec"])
def test_a_shared_prefix_moves_once_a_round(mode: str) -> None:
    """Per decode round of k requests over a shared D-block prefix with S own cold blocks each:
    D + k S blocks with sharing, k (D + S) without (k: all N, or N / 2 a group in the two-group
    modes, fewer as requests finish)."""
    per = N // 2 if mode in ("specstream", "parallel-spec") else N
    per_round = []
    for sharing in (False, True):
        run = replay(_setup(mode, sharing), record=True)
        per_round.append(run.link_bytes_per_round)
        rounds = [f for f in run.records if f.num_seqs and not f.prefill_tokens]
        assert max(f.num_seqs for f in rounds) == per, (mode, sharing)
        for f in rounds:
            k = int(f.num_seqs)
            blocks = D_BLOCKS + k * OWN_COLD if sharing else k * (D_BLOCKS + OWN_COLD)
            assert f.history_bytes == blocks * BLOCK_BYTES, (mode, sharing, k)
    assert 0 < per_round[1] < per_round[0]  # the bench's link_bytes_per_round


def test_sharing_prefills_the_document_once() -> None:
    """The engine's prefix sharing engages in the replay: the requests that arrive together
    join the first one's prefill of the document instead of each prefilling it."""
    prompt = (D_BLOCKS + 2) * BS
    for sharing, prefilled in ((False, N * prompt), (True, prompt + (N - 1) * 2 * BS)):
        run = replay(_setup("specstream", sharing), record=True)
        assert sum(f.prefill_tokens for f in run.records) == prefilled


def test_a_shared_prefix_must_fit_the_prompts() -> None:
    with pytest.raises(ValueError, match="shared prefix"):
        replace(_setup("offload", True), shared_prefix=(D_BLOCKS + 3) * BS)


# ---- the round pipeline --------------------------------------------------------------------
DOC = SharedDoc(num_requests=16, doc_len=8192, own_len=512, output_len=256)


def _scenario() -> Scenario:
    sc = Scenario.from_names("H200", "Qwen3-8B", "Qwen3-0.6B", (int(DOC.context),), 16, 0.75,
                             DOC.output_len, pcie_gen=5)
    return replace(sc, policy=replace(sc.policy, residency="tail", q=4))


def test_the_roofline_sharing_gain_is_bounded_by_the_sharing_factor() -> None:
    sc = _scenario()
    cold = sc.policy.cold_tokens("offload", DOC.context)
    rows = sharing_rows(sc, DOC)
    assert [r.mode for r in rows] == [m for m in SHARING_MODES for _ in range(2)]
    for off, on in zip(rows[::2], rows[1::2], strict=True):
        gain = on.round.tokens_per_s / off.round.tokens_per_s
        assert 1.0 < gain <= DOC.cold_factor(cold) * 1.001, off.mode
        assert on.round.link_bytes < off.round.link_bytes
    # with every token of the prompt cold the bound is the N (D + S) / (D + N S)
    assert DOC.cold_factor(DOC.doc_len + DOC.own_len) == pytest.approx(DOC.sharing_factor)


def test_the_roofline_moves_n_copies_without_sharing_and_one_with() -> None:
    """Sharing off: every request's cold history; on: the document once per verification
    (specstream: two groups, so twice a round), plus every request's own cold tokens."""
    sc = _scenario()
    kv = sc.costs.kv_bytes("target")
    cold = sc.policy.cold_tokens("specstream", DOC.context)
    contexts = [DOC.context] * DOC.num_requests
    off = best_round("specstream", sc.costs, sc.policy, contexts, sc.acceptance)
    on = best_round("specstream", sc.costs, sc.policy, contexts, sc.acceptance,
                    shared=float(DOC.doc_len))
    n, d = DOC.num_requests, DOC.doc_len
    assert off.link_bytes == pytest.approx(n * cold * kv)
    assert on.link_bytes == pytest.approx((2 * d + n * (cold - d)) * kv)


def test_the_host_holds_the_document_once() -> None:
    sc = _scenario()
    kv = sc.costs.kv_bytes("target")
    contexts = [DOC.context] * DOC.num_requests
    cold = sc.policy.cold_tokens("offload", DOC.context)
    off = plan("offload", sc.costs, sc.policy, contexts)
    on = plan("offload", sc.costs, sc.policy, contexts, float(DOC.doc_len))
    assert off.host_bytes == pytest.approx(DOC.num_requests * cold * kv)
    assert on.host_bytes == pytest.approx((DOC.doc_len + DOC.num_requests
                                           * (cold - DOC.doc_len)) * kv)
    assert on.sub_batch >= off.sub_batch
    fill = replace(sc.policy, residency="fill")
    with pytest.raises(ValueError, match="tail only"):
        plan("offload", sc.costs, fill, contexts, float(DOC.doc_len))


# ---- the committed shared-doc bench ----------------------------------------------------------
def test_the_shared_doc_bench_replays() -> None:
    """`specstream bench --workload shared-doc --preset link-bound`: every run replayed with
    its own settings, prefix sharing as it ran and host attention where it attended, each
    run's throughput within the issue's 15% (in sample; deterministic draws), the document
    prefilled once with sharing."""
    data = json.loads(SHARED_DOC.read_text())
    assert is_shared_bench(data)
    setups = shared_setups(data)
    assert set(setups) == {f"{m} {s}" for m in data["modes"] for s in ("off", "on")}
    w = data["workload"]
    for key, s in setups.items():
        assert s.config.prefix_sharing == key.endswith("on")
        assert s.host is not None and s.config.host_attends  # the run attended on the host
        assert s.shared_prefix == w["doc_len"]
    data, predicted = shared_predictions(SHARED_DOC, seeds=2)
    _, errors = shared_table(data, predicted)
    assert max(map(abs, errors.values())) < THROUGHPUT_BOUND, errors
    for mode in data["modes"]:
        on, off = predicted[f"{mode} on"].result, predicted[f"{mode} off"].result
        assert on.throughput > 2 * off.throughput, mode
        assert on.ttft_s < off.ttft_s, mode  # the document is prefilled once
