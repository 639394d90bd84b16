"""Tree acceptance: tree shape, greedy paths against brute force, chains against
``accept_drafts``; the chi-square tests that tree sampling is lossless are in
``test_tree_sampling.py``.

The statistical tests (there) run the whole speculative loop (draft a tree, verify it, continue
from the last output token) on the first-order Markov "language model" of ``test_acceptance``,
for many independent rows at once, and compare the empirical joint of the first three generated
tokens with the target's exact joint p(a) p(b | a) p(c | b): the first token follows the target
after the prompt, and each next one the target given the one before, whichever tree node
produced it. They pass for ``accept_tree`` and fail for deliberately wrong samplers: the real
module with a broken step monkeypatched in, and a plain reference sampler with a tree-specific
bug switched on.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from specstream.sampling import logits_to_probs, make_generator
from specstream.sampling_params import SamplingParams
from specstream.spec.acceptance import accept_drafts
from specstream.spec.tree import (
    DraftTree,
    accept_tree,
    accept_tree_on_device,
    positions,
    tree_mask,
)

N_OUT = 3  # tokens compared with the exact joint: V**3 = 125 cells
N_ROWS = 20_000

DEFAULT = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
GREEDY = SamplingParams(temperature=0.0)


# ---------------------------------------------------------------------------------------------
# Tree shape

#   root
#   |- 0 (5)
#   |  |- 2 (7)
#   |  '- 3 (8)
#   |     '- 5 (9)
#   '- 1 (6)
#      '- 4 (1)
HAND = DraftTree(tokens=(5, 6, 7, 8, 1, 9), parents=(-1, -1, 0, 0, 1, 3))


def test_tree_structure() -> None:
    assert len(HAND) == 6
    assert HAND.depths == (1, 1, 2, 2, 2, 3)
    assert HAND.depth == 3
    assert [HAND.children(i) for i in range(-1, 6)] == [(0, 1), (2, 3), (4,), (), (5,), (), ()]
    assert HAND.path(-1) == ()
    assert HAND.path(5) == (0, 3, 5)
    assert HAND.path(4) == (1, 4)
    with pytest.raises(IndexError):
        HAND.path(6)
    with pytest.raises(IndexError):
        HAND.children(-2)
    chain = DraftTree.chain([4, 4, 2])
    assert chain == DraftTree((4, 4, 2), (-1, 0, 1))
    assert chain.depths == (1, 2, 3) and chain.path(2) == (0, 1, 2)
    empty = DraftTree.chain([])
    assert len(empty) == 0 and empty.depth == 0 and empty.children(-1) == ()


def test_tree_validation() -> None:
    with pytest.raises(ValueError, match="must come before"):
        DraftTree((1, 2, 3), (-1, 2, 0))  # node 1's parent is node 2
    with pytest.raises(ValueError, match="must come before"):
        DraftTree((1, 2), (-1, 1))  # its own parent
    with pytest.raises(ValueError, match="out of range"):
        DraftTree((1, 2), (-1, 5))
    with pytest.raises(ValueError, match="out of range"):
        DraftTree((1, 2), (-2, 0))
    with pytest.raises(ValueError, match="2 tokens but 1 parents"):
        DraftTree((1, 2), (-1,))
    with pytest.raises(ValueError, match="token"):
        DraftTree((1, -3), (-1, 0))
    with pytest.raises(TypeError, match="tuples"):
        DraftTree([1, 2], [-1, 0])  # type: ignore[arg-type]


def test_tree_mask_and_positions() -> None:
    # rows: query positions [root, 0, 1, 2, 3, 4, 5]; row a sees column b iff b is an ancestor
    # of a or a itself
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0, 0],  # 0
        [1, 0, 1, 0, 0, 0, 0],  # 1
        [1, 1, 0, 1, 0, 0, 0],  # 2 <- 0
        [1, 1, 0, 0, 1, 0, 0],  # 3 <- 0
        [1, 0, 1, 0, 0, 1, 0],  # 4 <- 1
        [1, 1, 0, 0, 1, 0, 1],  # 5 <- 3 <- 0
    ], dtype=torch.bool)
    assert torch.equal(tree_mask(HAND), expected)
    assert torch.equal(positions(HAND, 100), torch.tensor([100, 101, 101, 102, 102, 102, 103]))
    chain = DraftTree.chain([3, 1, 4])
    assert torch.equal(tree_mask(chain), torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(positions(chain, 7), torch.tensor([7, 8, 9, 10]))
    assert torch.equal(tree_mask(DraftTree.chain([])), torch.ones(1, 1, dtype=torch.bool))


def test_rejects_bad_inputs() -> None:
    tree = DraftTree.chain([1, 2])
    logits = torch.randn(3, 4)
    with pytest.raises(ValueError, match="want"):
        accept_tree(torch.randn(4, 4), [tree], None, [DEFAULT])
    with pytest.raises(ValueError, match="want"):
        accept_tree([torch.randn(2, 4)], [tree], None, [DEFAULT])
    with pytest.raises(ValueError, match="vocabulary"):
        accept_tree(logits, [DraftTree.chain([1, 7])], None, [DEFAULT])
    with pytest.raises(ValueError, match="draft_probs"):
        accept_tree(logits, [tree], [torch.rand(2, 4)], [DEFAULT])
    with pytest.raises(ValueError, match="params"):
        accept_tree(logits, [tree], None, [DEFAULT, DEFAULT])
    last, extra = accept_tree_on_device([], [], None, [])
    assert last.shape == extra.shape == (0,)


# ---------------------------------------------------------------------------------------------
# Greedy


def random_tree(rng: random.Random, vocab: int, top: list[int], max_nodes: int = 12) -> DraftTree:
    """A random tree whose tokens often equal the argmax (``top``, by query position) of their
    parent, so that long matching paths and duplicate siblings both occur."""
    tokens: list[int] = []
    parents: list[int] = []
    for i in range(rng.randint(0, max_nodes)):
        par = rng.randint(-1, i - 1) if rng.random() < 0.5 else min(i - 1, rng.randint(-1, 1))
        tok = top[par + 1] if rng.random() < 0.6 else rng.randrange(vocab)
        tokens.append(tok)
        parents.append(par)
    return DraftTree(tuple(tokens), tuple(parents))


def brute_force_greedy(tree: DraftTree, top: list[int]) -> tuple[tuple[int, ...], int]:
    """The longest path whose every token is the argmax at its parent (the lowest node index
    among the longest), and the argmax at its end."""
    best: tuple[int, ...] = ()
    for i in range(len(tree)):
        path = tree.path(i)
        if all(tree.tokens[j] == top[tree.parents[j] + 1] for j in path) and len(path) > len(best):
            best = path
    return best, top[best[-1] + 1 if best else 0]


def test_greedy_is_longest_matching_path() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    vocab = 4
    logits, trees, expected = [], [], []
    walk_checked = 0
    for _ in range(400):
        rows = torch.randn(13, vocab)
        top = rows.argmax(-1).tolist()
        tree = random_tree(rng, vocab, top)
        logits.append(rows[: len(tree) + 1])
        trees.append(tree)
        expected.append(brute_force_greedy(tree, top))
        siblings = [tree.children(i) for i in range(-1, len(tree))]
        if all(len({tree.tokens[c] for c in k}) == len(k) for k in siblings):
            # distinct siblings: the longest path is the walk that follows the argmax child
            node = -1
            while (nxt := [c for c in tree.children(node) if tree.tokens[c] == top[node + 1]]):
                node = nxt[0]
            assert tree.path(node) == expected[-1][0]
            walk_checked += 1
    assert walk_checked > 100
    assert sum(len(path) >= 3 for path, _ in expected) > 40  # the test sees long paths
    params = [GREEDY if b % 2 else SamplingParams(temperature=0.7, top_k=1, seed=b)
              for b in range(len(trees))]
    probs = [torch.softmax(torch.randn(len(t) + 1, vocab), -1) for t in trees]  # ignored
    for dp in (None, probs):
        got = accept_tree(logits, trees, dp, params)
        for tree, v, (path, extra) in zip(trees, got, expected, strict=True):
            assert v.path == path
            assert v.tokens == tuple(tree.tokens[i] for i in path) + (extra,)
            assert v.num_accepted == len(path)


def test_greedy_draws_nothing() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 5)
    state, global_state = gen.get_state(), torch.get_rng_state()
    accept_tree(logits, [DraftTree((1,) * 6, HAND.parents)], None, [GREEDY], [gen])
    assert torch.equal(gen.get_state(), state)
    assert torch.equal(torch.get_rng_state(), global_state)


def random_chains(
    seed: int, bsz: int, q: int, vocab: int, params: Sequence[SamplingParams]
) -> tuple[Tensor, Tensor, list[int], Tensor]:
    """Chain inputs for ``accept_drafts``: logits [B, Q+1, V], drafts [B, Q] matching the argmax
    often, counts, draft probs [B, Q, V]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bsz, q + 1, vocab, generator=g) * 2
    top = logits.argmax(-1)[:, :q]
    noise = torch.randint(0, vocab, (bsz, q), generator=g)
    drafts = torch.where(torch.rand(bsz, q, generator=g) < 0.7, top, noise)
    counts = torch.randint(0, q + 1, (bsz,), generator=g).tolist()
    dprobs = logits_to_probs((torch.randn(bsz * q, vocab, generator=g) + logits[:, :q].reshape(
        -1, vocab)), [p.temperature for p in params for _ in range(q)],
        [p.top_k for p in params for _ in range(q)], [p.top_p for p in params for _ in range(q)])
    return logits, drafts, counts, dprobs.view(bsz, q, vocab)


def chain_outputs(
    logits: Tensor, drafts: Tensor, counts: list[int], dprobs: Tensor | None,
    point: list[bool], params: Sequence[SamplingParams],
) -> list[tuple[int, ...]]:
    """The same batch as chains through ``accept_tree``: draft probs per request (None for the
    point-mass ones), the leaf row NaN to show it is never used; fresh seeded generators."""
    trees = [DraftTree.chain(drafts[b, :n].tolist()) for b, n in enumerate(counts)]
    rows = [logits[b, : n + 1] for b, n in enumerate(counts)]
    probs = None if dprobs is None else [
        None if pm else torch.cat([dprobs[b, :n], torch.full((1, logits.shape[-1]), torch.nan)])
        for b, (n, pm) in enumerate(zip(counts, point, strict=True))]
    gens = [make_generator(p) for p in params]
    return [v.tokens for v in accept_tree(rows, trees, probs, params, gens)]


def test_greedy_chain_equals_accept_drafts() -> None:
    bsz, q, vocab = 300, 5, 6
    params = [GREEDY] * bsz
    logits, drafts, counts, dprobs = random_chains(0, bsz, q, vocab, params)
    want = accept_drafts(logits, drafts, counts, None, params)
    assert 0 < sum(want.num_accepted.tolist()) and max(want.num_accepted.tolist()) == q
    got = chain_outputs(logits, drafts, counts, None, [True] * bsz, params)
    assert got == [tuple(o) for o in want.output_tokens]
    got = chain_outputs(logits, drafts, counts, dprobs, [False] * bsz, params)
    assert got == [tuple(o) for o in want.output_tokens]


def test_seeded_chain_equals_accept_drafts() -> None:
    """Seeded requests draw the same uniforms and exponentials as ``accept_drafts``, so a chain
    gives the very same tokens, in a batch mixing greedy, filtered, model and point-mass rows."""
    bsz, q, vocab = 300, 4, 6
    choices = [DEFAULT, FILTERED, GREEDY, SamplingParams(temperature=1.3, top_p=0.8)]
    params = [SamplingParams(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, seed=b)
              for b, c in enumerate(choices[b % 4] for b in range(bsz))]
    logits, drafts, counts, dprobs = random_chains(1, bsz, q, vocab, params)
    point = [b % 3 == 0 for b in range(bsz)]
    chain_probs = dprobs.clone()
    for b in range(bsz):  # point-mass rows of a mixed chain batch are one-hot
        if point[b]:
            chain_probs[b] = torch.nn.functional.one_hot(drafts[b], vocab).float()
    want = accept_drafts(logits, drafts, counts, chain_probs, params,
                         [make_generator(p) for p in params])
    accepted = want.num_accepted.tolist()
    assert 0 < sum(accepted) < sum(counts)  # both accepted and rejected drafts occur
    got = chain_outputs(logits, drafts, counts, dprobs, point, params)
    assert got == [tuple(o) for o in want.output_tokens]
    # and the seeded requests do not depend on their batch
    alone = [chain_outputs(logits[b : b + 1], drafts[b : b + 1], counts[b : b + 1],
                           dprobs[b : b + 1], point[b : b + 1], params[b : b + 1])[0]
             for b in range(0, bsz, 37)]
    assert alone == got[::37]
