"""Grammar-constrained speculation: masks per draft position and tree node, rollback, and a test
that constrained speculative sampling samples exactly the constrained target distribution.

The toy "language model" has a vocabulary of 8 byte-string tokens; its logits are a fixed random
function of the prefix. The grammar (``(ab|c)+`` then the end) forbids different tokens in
different states, so a mask taken from the wrong state changes the distribution."""

from __future__ import annotations

import functools
from collections import Counter

import llguidance
import pytest
import torch
from torch import Tensor

from specstream.sampling_params import SamplingParams
from specstream.spec.acceptance import accept_drafts
from specstream.structured import Constraint, GrammarError, compile_constraint
from specstream.structured.matcher import Matcher, chain_masks, mask_logits, tree_masks

TOKENS = [b"\xff[EOS]", b"a", b"b", b"c", b"ab", b"ba", b"{", b"}"]
V, EOS, Q, N_OUT = len(TOKENS), 0, 2, 3


class ToyTokens:
    eos_token_id, bos_token_id, tokens, special_token_ids = EOS, None, TOKENS, [EOS]

    def __call__(self, text: bytes | str) -> list[int]:
        raw = text.encode() if isinstance(text, str) else text
        return [TOKENS.index(bytes([c])) for c in raw if bytes([c]) in TOKENS]


@pytest.fixture(scope="module")
def toy() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ToyTokens()))


def matcher(toy: llguidance.LLTokenizer, regex: str = "(ab|c)+") -> Matcher:
    return Matcher(toy, compile_constraint(Constraint("regex", regex), toy), V)


@functools.cache
def logits_of(prefix: tuple[int, ...], salt: int) -> Tensor:
    g = torch.Generator().manual_seed(hash((prefix, salt)) % 2**31)
    return torch.randn(V, generator=g) * 1.5


def exact_joint(toy: llguidance.LLTokenizer) -> dict[tuple[int, ...], float]:
    """Target-only constrained sampling, enumerated: outcomes are the first N_OUT tokens (or
    fewer, ending with EOS)."""
    out: dict[tuple[int, ...], float] = {}
    todo: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while todo:
        prefix, prob = todo.pop()
        m = matcher(toy)
        assert m.advance(prefix) == len(prefix)
        p = torch.softmax(mask_logits(logits_of(prefix, 0), m.allowed()), -1)
        for t in range(V):
            if p[t] > 0:
                seq = prefix + (t,)
                done = t == EOS or len(seq) == N_OUT
                (out.__setitem__(seq, out.get(seq, 0.0) + prob * float(p[t])) if done
                 else todo.append((seq, prob * float(p[t]))))
    return out


def speculative_sample(base: Matcher, variant: str) -> tuple[int, ...]:
    """One output by rounds of Q masked drafts verified by ``accept_drafts``. ``variant``:
    "exact" (draft and target masked by the state after the preceding drafts), "stale" (every
    position masked by the round's first state), "draft_only" (the target unmasked)."""
    m, out = base.fork(), ()
    while len(out) < N_OUT and (not out or out[-1] != EOS):
        drafts, qs, taken, first = [], [], 0, m.allowed()
        for _ in range(Q):
            mask = first if variant == "stale" else m.allowed()
            q = torch.softmax(mask_logits(logits_of(out + tuple(drafts), 1), mask), -1)
            drafts.append(int(torch.multinomial(q, 1)))
            qs.append(q)
            if variant != "stale":
                if m.advance(drafts[-1:]) == 0:
                    break
                taken += 1
            if drafts[-1] == EOS:
                break
        m.rollback(taken)
        masks = (first.expand(len(drafts) + 1, V) if variant == "stale"
                 else chain_masks(m, drafts))
        target = torch.stack([logits_of(out + tuple(drafts[:j]), 0)
                              for j in range(len(drafts) + 1)])
        if variant != "draft_only":
            target = mask_logits(target, masks)
        res = accept_drafts(target[None], torch.tensor([drafts]), [len(drafts)],
                            torch.stack(qs)[None], [SamplingParams(temperature=1.0)])
        new = res.output_tokens[0]
        new = new[: new.index(EOS) + 1] if EOS in new else new
        assert m.advance(new) == len(new) or variant != "exact"
        out += tuple(new)
    return out[:N_OUT]


def total_variation(toy: llguidance.LLTokenizer, variant: str, n: int) -> float:
    torch.manual_seed(0)
    exact = exact_joint(toy)
    base = matcher(toy)
    seen = Counter(speculative_sample(base, variant) for _ in range(n))
    keys = set(exact) | set(seen)
    return 0.5 * sum(abs(exact.get(k, 0.0) - seen[k] / n) for k in keys)


def test_constrained_speculative_sampling_is_exact(toy: llguidance.LLTokenizer) -> None:
    # 3,000 draws over ~20 outcomes: sampling noise alone gives a TV near 0.02; the wrong
    # variants below measured 0.33 and 0.90
    assert total_variation(toy, "exact", 3000) < 0.05


@pytest.mark.parametrize("variant", ["stale", "draft_only"])
def test_wrong_masks_change_the_distribution(toy: llguidance.LLTokenizer, variant: str) -> None:
    assert total_variation(toy, variant, 800) > 0.15


def test_chain_masks_follow_the_drafts_and_roll_back(toy: llguidance.LLTokenizer) -> None:
    m = matcher(toy)
    before = m.allowed()
    masks = chain_masks(m, [1, 2, 3])  # a, b, c
    assert torch.equal(m.allowed(), before)
    assert before.nonzero().flatten().tolist() == [1, 3, 4]  # a, c, ab
    assert masks[1].nonzero().flatten().tolist() == [2, 5]  # after "a": "b", "ba"
    assert masks[2][EOS] and masks[3][EOS]  # after "ab", "abc": the end is allowed
    refused = chain_masks(m, [2, 1])  # "b" is refused first: later rows repeat row 0
    assert torch.equal(refused[1], before) and torch.equal(refused[2], before)


def test_rollback_leaves_the_accepted_prefix(toy: llguidance.LLTokenizer) -> None:
    m, fresh = matcher(toy), matcher(toy)
    chain_masks(m, [4, 3, 1])
    m.advance([4, 3])  # the round accepted "ab", "c"
    fresh.advance([4, 3])
    assert torch.equal(m.allowed(), fresh.allowed())


def test_tree_masks_give_each_node_its_path_state(toy: llguidance.LLTokenizer) -> None:
    m = matcher(toy)
    tokens, parents = [1, 3, 2, 4, 5], [-1, -1, 0, 1, 1]  # a, c, a>b, c>ab, c>ba (refused)
    masks = tree_masks(m, tokens, parents)
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.insert(0, tokens[j])
            j = parents[j]
        ref = matcher(toy)
        want = (ref.allowed() if ref.advance(path) == len(path) else
                torch.equal(masks[i + 1], masks[parents[i] + 1]) and masks[i + 1])
        assert torch.equal(masks[i + 1], want), f"node {i}"
    assert torch.equal(m.allowed(), masks[0])
    with pytest.raises(ValueError, match="parent"):
        tree_masks(m, [1, 2], [1, -1])


@pytest.mark.parametrize("constraint, good, bad", [
    (Constraint.json_schema({"type": "object", "properties": {"k": {"type": "string"}},
                             "required": ["k"]}), b'{"k": "ab"}', b'{"j": 1}'),
    (Constraint("json_object"), b'{"a": [1, 2]}', b'[1]'),
    (Constraint("regex", "[0-9]{3}-x"), b"123-x", b"12-x"),
    (Constraint.choice(["yes", "no"]), b"no", b"nope"),
    (Constraint("grammar", 'root ::= "a" root | "b"'), b"aab", b"aba"),
    (Constraint("lark", 'start: "x"+ "y"'), b"xxy", b"xyx"),
])
def test_every_constraint_kind_compiles_and_decides(constraint: Constraint, good: bytes,
                                                    bad: bytes) -> None:
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokens()))
    grammar = compile_constraint(constraint, tok)
    assert compile_constraint(constraint, tok) is grammar  # cached
    for text, ok in ((good, True), (bad, False)):
        m = Matcher(tok, grammar, 257)
        ids = list(text)
        assert (m.advance(ids) == len(ids) and m.allowed()[256]) == ok, text


class ByteTokens:
    """One token per byte, and EOS (256)."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([b]) for b in range(256)] + [b"\xff[EOS]"]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@pytest.mark.parametrize("constraint", [
    Constraint("regex", "(ab"),
    Constraint("json_schema", "{not json"),
    Constraint("grammar", "root ::= undefined_rule"),
])
def test_a_grammar_the_library_rejects_is_a_clear_error(toy: llguidance.LLTokenizer,
                                                        constraint: Constraint) -> None:
    with pytest.raises(GrammarError, match=f"invalid {constraint.kind}"):
        compile_constraint(constraint, toy)


def test_unknown_kinds_and_empty_choices_are_refused() -> None:
    with pytest.raises(GrammarError, match="unknown constraint kind"):
        Constraint("xml")
    with pytest.raises(GrammarError, match="non-empty"):
        Constraint.choice([])
