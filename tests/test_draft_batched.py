"""Batched drafting (``spec/draft.py``): drafts of a batch equal drafts made one request at a
time, one attention call per layer and query bucket, no device read inside a draft step, and the
window cache's eviction and rollback as spelled out by a plain per-request reference."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest
import torch

from specstream.attention import causal_mask, full_attention
from specstream.attention.buckets import buckets_of
from specstream.attention.waves import TorchWaves, WaveShape
from specstream.models.decoder import CausalLM
from specstream.models.loader import load_model
from specstream.sampling import SamplingTensors, logits_to_probs
from specstream.sampling_params import SamplingParams
from specstream.spec.draft import DraftModelProposer
from specstream.spec.proposer import Proposal, ProposeRequest

WINDOW = dict(cache="window", window_tokens=40, sink_tokens=4, max_draft_tokens=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
PARAMS = {
    "greedy": [GREEDY] * 6,
    "sampled": [SamplingParams(temperature=0.9, seed=s, max_tokens=64) for s in range(6)],
    "mixed": [
        GREEDY,
        SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=64),
        SamplingParams(temperature=0.7, top_p=0.9, seed=4, max_tokens=64),
        SamplingParams(temperature=0.0, seed=9, max_tokens=64),
        SamplingParams(temperature=1.0, top_k=1, seed=5, max_tokens=64),
        SamplingParams(temperature=1.2, top_k=20, top_p=0.8, seed=6, max_tokens=64),
    ],
}
# Context lengths: 150 and 60 are longer than sinks + window (a window prefill of 44 tokens,
# more than a decode bucket holds), 37 a full prefill of its own bucket, the rest share one.
LENGTHS = [3, 150, 1, 37, 60]


@pytest.fixture(scope="module")
def draft_model(tiny_draft):
    return load_model(tiny_draft, torch.float32, "cpu")


Propose = Callable[[list[ProposeRequest]], list[Proposal]]


def _simulate(proposer: DraftModelProposer, params: Sequence[SamplingParams], rounds: int,
              one_at_a_time: bool, seed: int = 0) -> list[list[Proposal]]:
    """Rounds of drafting for LENGTHS-long contexts: a random number of drafts per request
    (0 included), a random accepted prefix plus one target token, rollback. Halfway request 0
    finishes and a new one takes its slot (the batch's slots are then not consecutive)."""
    rng = random.Random(seed)
    ctx = {f"r{i}": [rng.randrange(128) for _ in range(n)] for i, n in enumerate(LENGTHS)}
    par = {f"r{i}": params[i] for i in range(len(LENGTHS))}
    out = []
    for r in range(rounds):
        if r == rounds // 2:
            proposer.free("r0")
            del ctx["r0"]
            ctx["new"] = [rng.randrange(128) for _ in range(70)]
            par["new"] = params[len(LENGTHS)]
        reqs = [ProposeRequest(rid, list(t), rng.choice([0, 1, 3, 4, 4]), par[rid])
                for rid, t in ctx.items()]
        if one_at_a_time:
            props = [proposer.propose([q])[0] for q in reqs]
        else:
            props = proposer.propose(reqs)
        out.append(props)
        for q, p in zip(reqs, props):
            assert len(p.token_ids) == q.num_tokens
            accepted = rng.randrange(len(p.token_ids) + 1)
            ctx[q.request_id] += list(p.token_ids[:accepted]) + [rng.randrange(128)]
            proposer.rollback(q.request_id, len(ctx[q.request_id]) - 1)
    return out


@pytest.mark.parametrize("policy", ["window", "full"])
@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_batch_drafts_equal_one_request_at_a_time(draft_model, policy, kind) -> None:
    kw = WINDOW if policy == "window" else dict(cache="full")
    batched = _simulate(DraftModelProposer(draft_model, **kw), PARAMS[kind], 16, False)
    alone = _simulate(DraftModelProposer(draft_model, **kw), PARAMS[kind], 16, True)
    for props_b, props_a in zip(batched, alone):
        assert [p.token_ids for p in props_b] == [p.token_ids for p in props_a]
        for b, a in zip(props_b, props_a):
            assert (b.probs is None) == (a.probs is None)
            if b.probs is not None and a.probs is not None:
                assert b.probs.shape == (len(b.token_ids), 128)
                assert torch.allclose(b.probs, a.probs, atol=1e-6)


class _Counting(TorchWaves):
    calls: list[int] = []  # W of each attention call

    def add(self, k: torch.Tensor, v: torch.Tensor, shape: WaveShape) -> None:
        type(self).calls.append(k.shape[0])
        super().add(k, v, shape)


def test_one_attention_call_per_layer_and_bucket(draft_model) -> None:
    _Counting.calls = []
    proposer = DraftModelProposer(draft_model, **WINDOW, attention=_Counting)
    layers = len(draft_model.layers)
    reqs = [ProposeRequest(f"r{i}", [t % 128 for t in range(n)], 4, GREEDY)
            for i, n in enumerate(LENGTHS)]
    job = proposer.start(reqs)
    # the first forward: each request's catch-up (sinks + window at most), in query buckets
    catch_up = [min(n, 44) for n in LENGTHS]
    buckets = buckets_of(catch_up)
    assert len(buckets) == 4  # [3, 1] together, 44, 37 and 44 alone
    job.step()
    assert len(_Counting.calls) == layers * len(buckets)
    assert sorted(_Counting.calls[:len(buckets)]) == sorted(len(b) for b in buckets)
    for _ in range(3):  # draft steps: one token per request, all in one bucket
        _Counting.calls = []
        job.step()
        assert _Counting.calls == [len(LENGTHS)] * layers
    assert job.done


_READS = ("tolist", "item", "cpu", "numpy", "__int__", "__index__", "__bool__", "__float__")


def _forbid_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("a draft step read a tensor value on the host")

    for name in _READS:
        monkeypatch.setattr(torch.Tensor, name, boom)


@pytest.mark.parametrize("kind", ["greedy", "mixed"])
def test_draft_steps_read_nothing_back(draft_model, monkeypatch, kind) -> None:
    """With every way of reading a tensor on the host patched to raise, a job's steps run to
    the end (a second round: 1-3 token catch-ups next to each other, different numbers of
    drafts); ``result`` then reads the drafts back, the same as without the patches."""
    params, counts = PARAMS[kind], [4, 2, 0, 3, 1]
    drafts = []
    for guarded in (False, True):
        proposer = DraftModelProposer(draft_model, **WINDOW)
        rng = random.Random(1)
        ctx = [[rng.randrange(128) for _ in range(n)] for n in LENGTHS]
        for i, p in enumerate(proposer.propose(
                [ProposeRequest(f"r{i}", t, 4, params[i]) for i, t in enumerate(ctx)])):
            ctx[i] += list(p.token_ids[: i % 3]) + [7]
            proposer.rollback(f"r{i}", len(ctx[i]) - 1)
        reqs = [ProposeRequest(f"r{i}", t, counts[i], params[i]) for i, t in enumerate(ctx)]
        job = proposer.start(reqs)
        if guarded:
            _forbid_reads(monkeypatch)
            with pytest.raises(AssertionError, match="read a tensor value"):
                torch.zeros(2).tolist()  # the guard is on
        steps = 1
        while job.step():
            steps += 1
        monkeypatch.undo()
        assert steps == max(counts)
        props = job.result()  # the one read-back
        assert [len(p.token_ids) for p in props] == counts
        drafts.append([p.token_ids for p in props])
    assert drafts[0] == drafts[1]


def test_host_flags_give_what_reading_the_tensors_gives(draft_model) -> None:
    """The draft passes its parameters as device tensors with the two branch flags known on the
    host (no read-back); that equals logits_to_probs finding them itself."""
    params = PARAMS["mixed"]
    logits = torch.randn(len(params), 128, generator=torch.Generator().manual_seed(0))
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie: the lower id wins
    t = SamplingTensors.from_params(params)
    got = logits_to_probs(logits, t.temperature, t.top_k, t.top_p, filters=True,
                          any_greedy=True)
    want = logits_to_probs(logits, [p.temperature for p in params], [p.top_k for p in params],
                           [p.top_p for p in params])
    assert torch.equal(got, want)
    plain = params[1:3]
    t = SamplingTensors.from_params([SamplingParams(temperature=p.temperature) for p in plain])
    assert torch.equal(logits_to_probs(logits[1:3], t.temperature, t.top_k, t.top_p,
                                       filters=False, any_greedy=False),
                       logits_to_probs(logits[1:3], [p.temperature for p in plain], 0, 1.0))


class _PlainWindowDraft:
    """The window cache spelled out for one request, with plain attention: K/V of the sinks and
    the recent tokens, evicted down to sinks + window once past sinks + window + slack after a
    forward; rollback drops the newest entries; a new request prefills its sinks and last
    window. Greedy drafts."""

    def __init__(self, model: CausalLM, window: int, sinks: int, slack: int = 64) -> None:
        self.model, self.window, self.sinks, self.slack = model, window, sinks, slack
        self.k: list[torch.Tensor | None] = [None] * len(model.layers)
        self.v: list[torch.Tensor | None] = [None] * len(model.layers)
        self.length = self.num_tokens = self.evictions = 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        old_k, old_v = self.k[layer], self.v[layer]
        keys = k if old_k is None else torch.cat([old_k[: self.length], k])
        values = v if old_v is None else torch.cat([old_v[: self.length], v])
        self.k[layer], self.v[layer] = keys, values
        return full_attention(q, keys, values, self.model.config.head_dim**-0.5,
                              causal_mask(q.shape[0], keys.shape[0]))

    def _forward(self, tokens: list[int], positions: list[int]) -> int:
        hidden = self.model(torch.tensor(tokens), torch.tensor(positions), self)
        self.length += len(tokens)
        self.num_tokens = positions[-1] + 1
        if self.length > self.sinks + self.window + self.slack:
            keep = list(range(self.sinks)) + list(range(self.length - self.window, self.length))
            self.k = [x[keep] for x in self.k if x is not None]
            self.v = [x[keep] for x in self.v if x is not None]
            self.length = self.sinks + self.window
            self.evictions += 1
        return int(self.model.compute_logits(hidden[-1:]).argmax())

    def propose(self, tokens: list[int], num: int) -> list[int]:
        todo = list(range(self.num_tokens, len(tokens)))
        if self.num_tokens == 0 and len(todo) > self.sinks + self.window:
            todo = todo[: self.sinks] + todo[-self.window :]
        out = [self._forward([tokens[p] for p in todo], todo)]
        while len(out) < num:
            out.append(self._forward([out[-1]], [len(tokens) + len(out) - 1]))
        return out

    def rollback(self, kept: int) -> None:
        if self.num_tokens > kept:
            self.length = max(0, self.length - (self.num_tokens - kept))
            self.num_tokens = kept


def test_window_eviction_and_rollback_match_the_plain_reference(draft_model) -> None:
    """A request drafting next to others for many rounds, its rejected drafts rolled back and
    its window evicted several times, drafts what the plain reference drafts."""
    proposer = DraftModelProposer(draft_model, **WINDOW)
    ref = _PlainWindowDraft(draft_model, window=40, sinks=4)
    rng = random.Random(2)
    ctx = [[rng.randrange(128) for _ in range(n)] for n in LENGTHS]
    for _ in range(60):
        reqs = [ProposeRequest(f"r{i}", list(t), 4, GREEDY) for i, t in enumerate(ctx)]
        props = proposer.propose(reqs)
        assert props[1].token_ids == ref.propose(ctx[1], 4)
        for i, p in enumerate(props):
            accepted = rng.choice([0, 0, 1, 2, 4])
            ctx[i] = ctx[i] + list(p.token_ids[:accepted]) + [rng.randrange(128)]
            proposer.rollback(f"r{i}", len(ctx[i]) - 1)
            if i == 1:
                ref.rollback(len(ctx[i]) - 1)
        c = proposer.caches["r1"]
        assert (c.length, c.num_tokens) == (ref.length, ref.num_tokens)
    assert ref.evictions >= 2


@pytest.mark.parametrize("policy", ["window", "full"])
def test_rollback_drafts_as_a_fresh_request_fed_the_accepted_tokens(draft_model, policy) -> None:
    """Drafts whose rejected tail was rolled back leave the cache as if never fed: the next
    draft equals that of a request that only ever saw the accepted tokens (no eviction here:
    the window holds the whole context)."""
    kw = dict(WINDOW, window_tokens=512) if policy == "window" else dict(cache="full")
    drafting, fresh = DraftModelProposer(draft_model, **kw), DraftModelProposer(draft_model, **kw)
    rng = random.Random(3)
    tokens = [rng.randrange(128) for _ in range(30)]
    for _ in range(25):
        got = drafting.propose([ProposeRequest("a", list(tokens), 4, GREEDY)])[0].token_ids
        want = fresh.propose([ProposeRequest("b", list(tokens), 1, GREEDY)])[0].token_ids
        assert got[:1] == want
        # the drafting request holds the context plus its first three drafts
        assert drafting.caches["a"].length == fresh.caches["b"].length + 3 == len(tokens) + 3
        accepted = rng.choice([0, 1, 2, 4])
        tokens += got[:accepted] + [rng.randrange(128)]
        drafting.rollback("a", len(tokens) - 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_draft_steps_do_not_sync_on_cuda(tiny_draft) -> None:
    """Under CUDA's sync debug mode every draft step enqueues without a host sync, and the
    batch drafts what each request alone drafts."""
    model = load_model(tiny_draft, torch.float32, "cuda")
    params = PARAMS["mixed"]
    rng = random.Random(4)
    ctx = [[rng.randrange(128) for _ in range(n)] for n in LENGTHS]
    reqs = [ProposeRequest(f"r{i}", t, n, params[i])
            for i, (t, n) in enumerate(zip(ctx, [4, 2, 0, 3, 4]))]
    job = DraftModelProposer(model, **WINDOW).start(reqs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while job.step():
            pass
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = [p.token_ids for p in job.result()]
    alone = DraftModelProposer(model, **WINDOW)
    assert got == [alone.propose([r])[0].token_ids for r in reqs]
