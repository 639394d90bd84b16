"""Token trees verified by the engine: options, the scheduler's contract, and greedy output equal
to target-only decoding in every mode.

The trees come from a fake proposer (tree_oracle.py; no draft model): random top-k trees, and
where the target's greedy continuation of a request is known (computed first, target only), the
true next token sits at a random sibling slot of the true path's nodes, so paths of depth >= 2
through non-first children are accepted and their KV must be compacted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import capture_plans, reads_per_round
from tree_oracle import MODES, OracleTreeProposer

from specstream.attention.triton_wave import triton_available
from specstream.cli import build_parser, engine_kwargs
from specstream.config import EngineConfig
from specstream.engine.contract import SeqWork, StepOutput
from specstream.engine.exec.step_kv import StepKV
from specstream.engine.exec.verify import Verifier
from specstream.engine.llm_engine import LLMEngine
from specstream.engine.request import Request
from specstream.engine.sched.scheduler import Scheduler
from specstream.engine.stats import EngineStats
from specstream.kvcache.manager import KVManager
from specstream.kvcache.residency import OffloadPolicy
from specstream.sampling_params import SamplingParams
from specstream.spec.proposer import Proposal, Proposer, ProposeRequest

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# depth 4, three children per expanded node, 12 nodes: wider than the chain and deeper than 1
TREE = dict(proposer="draft", draft_model="unused: the engine gets the fake proposer",
            num_speculative_tokens=4, speculative_topk=3, speculative_num_draft_tokens=12,
            speculative_policy="fixed")
def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def _run(folder: Path, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
         drafter: Proposer | None = None, **kw) -> tuple[list[list[int]], dict]:
    """Generate with an engine built from ``kw`` (``drafter``: its proposer object)."""
    eng = LLMEngine(folder, EngineConfig(**kw), proposer=drafter)
    plist = params if isinstance(params, list) else [params] * len(prompts)
    try:
        ids = [eng.add_request(p, s) for p, s in zip(prompts, plist)]
        done: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    assert o.outputs[0].finish_reason == "length", o.outputs[0].error
                    done[o.request_id] = o.outputs[0].token_ids
        return [done[i] for i in ids], eng.get_metrics()
    finally:
        eng.close()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # 20 and 90: prefill chunks of 32 tokens or fewer share the decode bucket with the trees
    return _prompts((5, 300, 20, 90, 700))


@pytest.fixture(scope="module")
def reference(tiny_target, prompts) -> list[list[int]]:
    """Target-only greedy decoding with everything resident."""
    tokens, _ = _run(tiny_target, prompts, GREEDY, mode="resident", device_kv_bytes=16 << 20)
    return tokens


def _oracle(prompts, reference, **kw) -> OracleTreeProposer:
    return OracleTreeProposer([p + r for p, r in zip(prompts, reference)], **kw)


# ---- options ----------------------------------------------------------------------------
def test_tree_options_are_validated_and_derived() -> None:
    chain = EngineConfig(proposer="ngram", num_speculative_tokens=3)
    assert not chain.tree and chain.num_draft_tokens == 3 and chain.verify_tokens == 4
    tree = EngineConfig(**TREE)
    assert tree.tree and tree.q == 4 and tree.num_draft_tokens == 12 and tree.verify_tokens == 13
    assert EngineConfig().num_draft_tokens == 0 and EngineConfig().verify_tokens == 1
    bad = [
        (dict(proposer="ngram", speculative_topk=2), "n-gram proposer drafts one chain"),
        (dict(speculative_topk=2), "there is no proposer"),
        (dict(TREE, speculative_topk=0), "speculative_topk must be in"),
        (dict(TREE, speculative_num_draft_tokens=3), "less than the depth"),
        (dict(TREE, speculative_num_draft_tokens=65), "must be in \\[1, 64\\]"),
        (dict(TREE, speculative_topk=1), "a chain verifies exactly"),
        (dict(speculative_num_draft_tokens=4), "needs a proposer"),
    ]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            EngineConfig(**kw)
    with pytest.raises(TypeError, match="integer"):
        EngineConfig(**dict(TREE, speculative_topk=2.0))


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_takes_the_tree_options(command) -> None:
    extra = ["--prompt", "x"] if command == "generate" else []
    args = build_parser().parse_args(
        [command, *extra, "--speculative-topk", "4", "--speculative-num-draft-tokens", "16"])
    kw = engine_kwargs(args)
    assert kw["speculative_topk"] == 4 and kw["speculative_num_draft_tokens"] == 16
    args = build_parser().parse_args([command, *extra, "--speculative-eagle-topk", "2"])
    assert engine_kwargs(args)["speculative_topk"] == 2
    assert "speculative_topk" not in engine_kwargs(build_parser().parse_args([command, *extra]))


def test_bench_takes_the_tree_options() -> None:
    from specstream.bench.cli import settings_from

    args = build_parser().parse_args(["bench", "--speculative-topk", "4",
                                      "--speculative-num-draft-tokens", "16"])
    s = settings_from(args)
    assert s.engine_kwargs("specstream")["speculative_topk"] == 4
    assert s.engine_kwargs("specstream")["speculative_num_draft_tokens"] == 16
    assert "speculative_topk" not in s.engine_kwargs("offload")  # no speculation there


# ---- the scheduler's contract -----------------------------------------------------------
def test_scheduler_hands_trees_to_the_round_and_commits_the_path() -> None:
    config = EngineConfig(mode="resident", block_size=16, max_prefill_tokens=64, **TREE)
    sched = Scheduler(config, KVManager(16, 256, 0, OffloadPolicy(offload=False)),
                      max_model_len=4096, eos_token_ids=[2])
    # admission reserves a round's 1 + 12 slots, not 1 + 4: 56 + 13 tokens take 5 blocks
    chain = Scheduler(EngineConfig(mode="resident", block_size=16, proposer="ngram",
                                   speculative_policy="fixed"),
                      KVManager(16, 256, 0, OffloadPolicy(offload=False)))
    short = Request("s", list(range(3, 23)), SamplingParams(max_tokens=36))
    assert (sched.admission.reservation(short).device_blocks
            == chain.admission.reservation(short).device_blocks + 1)
    sched.add(Request("a", list(range(3, 23)), SamplingParams(max_tokens=40)))
    plan = sched.schedule()  # the prefill; its drafts are asked for right after it
    (d,) = plan.drafts
    assert (d.num_tokens, d.topk, d.max_nodes) == (4, 3, 12)
    tree, parents = [7, 8, 9, 10, 11], [-1, -1, 1, 1, 3]  # path 1 -> 3 -> 4 is 3 deep
    sched.update(plan, StepOutput(new_tokens={"a": [5]}, drafts={"a": tree},
                                  draft_parents={"a": parents}))
    plan = sched.schedule()
    (s,) = plan.seqs
    assert s.token_ids == (5, *tree) and s.num_drafts == 5 and s.parents == tuple(parents)
    assert s.is_tree and s.tree.depths == (1, 1, 2, 2, 3)
    assert s.positions() == [20, 21, 21, 22, 22, 23]  # the root's plus the depth
    # the worker accepted 8 -> 10 -> 11 and a bonus token: 3 drafts + 1 kept
    sched.update(plan, StepOutput(new_tokens={"a": [8, 10, 11, 6]}))
    req = sched.requests["a"]
    assert req.num_computed_tokens == 20 + 1 + 3
    assert req.draft_token_ids == [] and req.draft_parents is None
    # a chain proposal clears the parents
    plan = sched.schedule()
    sched.update(plan, StepOutput(drafts={"a": [1, 2]}))
    assert sched.requests["a"].draft_parents is None
    assert sched.schedule().seqs[0].parents == ()


def test_a_tree_never_runs_deeper_than_the_room() -> None:
    config = EngineConfig(mode="resident", block_size=16, **TREE)
    sched = Scheduler(config, KVManager(16, 256, 0, OffloadPolicy(offload=False)),
                      max_model_len=4096)
    sched.add(Request("a", [3, 4, 5], SamplingParams(max_tokens=3)))
    plan = sched.schedule()
    (d,) = plan.drafts
    assert d.count(1) == 1 and d.max_nodes == 12  # 3 tokens: the first, one draft, a bonus


def test_seq_work_chain_shaped_tree_is_a_chain() -> None:
    s = SeqWork("a", (1, 2, 3), 10, 2, False, True, 0, (0,), (), parents=(-1, 0))
    assert not s.is_tree and s.positions() == [10, 11, 12] and s.tree.depths == (1, 2)


def test_accepted_per_pos_counts_by_depth() -> None:
    st = EngineStats()
    st.count_accepted(12, 3, depth=4, tree=True)
    st.count_accepted(4, 1)
    assert st.accepted_per_pos == [2, 1, 1, 0]
    assert st.as_dict()["mean_tree_nodes_per_round"] == 12.0 and st.tree_rounds == 1


# ---- the engine: exact output in every mode ----------------------------------------------
@pytest.mark.parametrize("setting", list(MODES))
def test_tree_greedy_output_equals_target_only(tiny_target, prompts, reference, setting):
    oracle = _oracle(prompts, reference, chain_share=0.2)  # chains and trees in one round
    tokens, m = _run(tiny_target, prompts, GREEDY, oracle, **MODES[setting], **TREE)
    assert tokens == reference
    assert oracle.trees > 0 and oracle.chains > 0
    # every tree round kept the draft's tokens up to the root
    assert oracle.rollbacks and all(kept == root for kept, root in oracle.rollbacks)
    assert m["tree_rounds"] > 0 and m["mean_tree_nodes_per_round"] > TREE["speculative_topk"]
    assert m["accepted_per_pos"][1] > 0 and m["accepted_per_pos"][2] > 0  # depth >= 3 paths
    assert m["mean_accepted_len"] > 2.0
    if setting != "resident":
        assert m["link_bytes_h2d"] > 0  # history really crossed the link
        assert m["device_kv_peak_bytes"] <= MODES[setting]["device_kv_bytes"]
    if setting.endswith("/host"):
        assert m["host_attention_bytes"] > 0 and m["halved_rounds"] > 0  # in two halves


def test_every_piece_of_the_tree_round_is_needed(tiny_target, prompts, reference, monkeypatch):
    """The compaction runs (paths through non-first children), and without it, or with the
    tokens' positions taken as consecutive, the output is not the target's."""
    kw = dict(MODES["specstream/fill"], **TREE)
    tokens, m = _run(tiny_target, prompts, GREEDY, _oracle(prompts, reference), **kw)
    assert tokens == reference and m["tree_kv_moves"] > 0
    monkeypatch.setattr(Verifier, "compact", lambda self, moves: None)
    tokens, _ = _run(tiny_target, prompts, GREEDY, _oracle(prompts, reference), **kw)
    assert tokens != reference
    monkeypatch.undo()
    monkeypatch.setattr(SeqWork, "positions",
                        lambda self: list(range(self.start_pos,
                                                self.start_pos + len(self.token_ids))))
    tokens, _ = _run(tiny_target, prompts, GREEDY, _oracle(prompts, reference), **kw)
    assert tokens != reference


def test_a_fresh_prompt_shares_the_bucket_of_a_tree(tiny_target, monkeypatch):
    """A prompt that arrives while a tree is verified prefills in the tree's bucket with no
    committed keys: it sits out the committed wave, and both outputs are the target's."""
    ps = _prompts((40, 12), seed=3)
    ref, _ = _run(tiny_target, ps, GREEDY, mode="resident", device_kv_bytes=16 << 20)
    eng = LLMEngine(tiny_target, EngineConfig(mode="resident", device_kv_bytes=16 << 20, **TREE),
                    proposer=_oracle(ps, ref))
    plans = capture_plans(eng, monkeypatch)
    try:
        a = eng.add_request(ps[0], GREEDY)
        for _ in range(3):
            eng.step()
        b = eng.add_request(ps[1], GREEDY)
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        # the round's buckets as it built them: a tree's bucket with a request that has no
        # committed keys (the fresh prompt), which sits out the committed wave
        subsets = [b for p in plans for b in StepKV(p, eng.store).buckets
                   if b.new_shape is not None and b.tail_shape is not None
                   and b.tail_shape.index is not None]
    finally:
        eng.close()
    assert [done[a], done[b]] == ref
    assert subsets


@pytest.mark.parametrize("with_probs", [False, True])
def test_seeded_sampled_trees_run_finish_and_repeat(tiny_target, prompts, reference, with_probs):
    """Sampled requests verify point-mass trees (lossless for any fixed children; the
    distribution tests are in test_tree_acceptance.py): seeded ones finish, give the same
    tokens again, and the same tokens in another mode (a request's randomness is its own)."""
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=10 + i, max_tokens=16,
                             ignore_eos=True) for i in range(len(prompts))]
    params[0] = GREEDY  # greedy and sampled requests in the same tree rounds
    runs = []
    for setting in ("specstream/fill", "specstream/fill", "resident"):
        oracle = _oracle(prompts, reference, seed=1, chain_share=0.3, with_probs=with_probs)
        tokens, m = _run(tiny_target, prompts, params, oracle, **MODES[setting], **TREE)
        assert m["tree_rounds"] > 0 and oracle.trees > 0
        runs.append(tokens)
    assert [len(t) for t in runs[0]] == [24] + [16] * (len(prompts) - 1)
    assert runs[0][0] == reference[0]
    assert runs[0] == runs[1] == runs[2]


def test_a_malformed_tree_fails_its_request_alone(tiny_target, prompts, reference):
    class TooDeep(OracleTreeProposer):
        def _one(self, r: ProposeRequest) -> Proposal:
            if len(r.token_ids) == len(prompts[0]) + 1:  # request 0's first drafts
                return Proposal(list(range(3, 3 + r.num_tokens + 1)), None,
                                list(range(-1, r.num_tokens)))
            return super()._one(r)

    eng = LLMEngine(tiny_target, EngineConfig(**MODES["resident"], **TREE),
                    proposer=TooDeep([p + r for p, r in zip(prompts, reference)]))
    try:
        ids = [eng.add_request(p, GREEDY) for p in prompts[:2]]
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o.outputs[0] for o in eng.step() if o.finished})
    finally:
        eng.close()
    assert done[ids[0]].finish_reason == "error" and "token tree" in done[ids[0]].error
    assert done[ids[1]].token_ids == reference[1]


def test_a_tree_decode_round_reads_back_once(tiny_target, prompts, reference, monkeypatch):
    """As for chains: the tree round's acceptance, its KV compaction and the drafts come to
    the host in one read-back."""
    eng = LLMEngine(tiny_target, EngineConfig(**MODES["specstream/fill"], **TREE),
                    proposer=_oracle(prompts, reference))
    for p in prompts[:4]:
        eng.add_request(p, GREEDY)
    try:
        counted = reads_per_round(eng, monkeypatch, lambda plan: plan.seqs and not any(
            s.prefill for s in plan.seqs) and any(s.is_tree for s in plan.seqs))
    finally:
        eng.close()
    assert len(counted) >= 3
    assert counted == [1] * len(counted)


@pytest.mark.skipif(not triton_available(), reason="triton cannot be imported here")
def test_tree_rounds_on_the_triton_path(tiny_target, prompts, reference):
    """The Triton backend (its interpreter on the CPU): committed tails and history in its
    kernel, the new tokens' masked wave on the torch path, merged; output the target's."""
    ps, ref = [prompts[i] for i in (0, 2, 3)], [reference[i] for i in (0, 2, 3)]
    tokens, m = _run(tiny_target, ps, GREEDY, _oracle(ps, ref, chain_share=0.2),
                     **dict(MODES["specstream/tail"], attention_backend="triton"), **TREE)
    assert tokens == ref and m["tree_rounds"] > 0 and m["link_bytes_h2d"] > 0
