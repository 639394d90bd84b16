"""Token trees in a round: the attention mask and positions of a tree round, and lossless
acceptance of a whole batch of trees (the trees themselves: ``spec/token_tree.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specstream.backends.base import upload
from specstream.sampling import logits_to_probs, sample, uniform
from specstream.sampling_params import SamplingParams
from specstream.spec.acceptance import accept_mask, residual
from specstream.spec.token_tree import DraftTree


def tree_mask(tree: DraftTree) -> Tensor:  # [N+1, N+1] bool
    """Which query positions of the round see which: positions are [root, node 0, ...,
    node N-1]; position a sees position b iff b is an ancestor of a or a itself (the root is
    everyone's ancestor). A chain gives the causal (lower-triangular) mask."""
    n = len(tree)
    mask = torch.eye(n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, par in enumerate(tree.parents):
        mask[i + 1] |= mask[par + 1]
    return mask


def positions(tree: DraftTree, start_pos: int) -> Tensor:  # [N+1] int64
    """The absolute position of each query position: the root at ``start_pos``, node i at
    ``start_pos + depth(i)`` (siblings share a position, as they are alternatives)."""
    return torch.tensor([start_pos] + [start_pos + d for d in tree.depths], dtype=torch.int64)


@dataclass(frozen=True)
class TreeVerdict:
    """What one request's tree gave this round."""

    # The accepted nodes, root -> leaf (possibly empty); a path of the tree.
    path: tuple[int, ...]
    # The accepted nodes' tokens followed by exactly one target token (recovered or bonus).
    tokens: tuple[int, ...]

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def accept_tree(
    target_logits: Tensor | Sequence[Tensor],  # [sum_b (N_b + 1), V] packed, or [N_b + 1, V] each
    trees: Sequence[DraftTree],
    draft_probs: Tensor | Sequence[Tensor | None] | None,  # like target_logits; None = point mass
    params: Sequence[SamplingParams],  # one per request
    generators: Sequence[torch.Generator | None] | None = None,
) -> list[TreeVerdict]:
    """Verify a batch of draft trees losslessly: multi-draft speculative sampling.

    SpecInfer: Miao et al. 2023, "SpecInfer: Accelerating Generative LLM Serving with
    Tree-based Speculative Inference and Verification" (multi-step speculative sampling);
    Yang et al. 2024, "Multi-Candidate Speculative Decoding" (the same recursive rejection
    sampling for i.i.d. candidates). Each step is the single-draft test of Leviathan et al. 2023
    and Chen et al. 2023, as in ``accept_drafts``, which this reduces to for a chain.

    Rows of request b (its block of ``target_logits``, N_b + 1 rows): row 0 is the target's
    prediction after the root, row 1 + i after node i. ``draft_probs`` rows likewise: row 0 the
    draft distribution the root's children were drawn from, row 1 + i the one node i's children
    were drawn from (leaf rows are never used, any value will do). For a chain, draft j sits at
    row j, as in ``accept_drafts``. The target logits come processed by
    ``sampling.process_logits`` where a request has a bias, a penalty or min_tokens (row 1 + i
    as if the nodes from the root to node i had been generated); temperature, min-p, top-k and
    top-p are applied here. ``draft_probs`` are what the children were drawn from. A tensor
    for ``draft_probs`` holds every request's rows; a sequence may have None for point-mass
    requests; None means point masses for all.

    Starting at the root with p, q the distributions there, try its children in index order:

    - accepted tokens: child x is accepted with probability min(1, p(x)/q(x)) (u * q(x) < p(x),
      u ~ U[0, 1)); the walk moves to x, where p and q become the distributions at x;
    - after a rejected child, p <- norm(max(0, p - q)) (q unchanged) and the next sibling is tried;
    - recovered token: when every child of the current node is rejected, one token drawn from the
      current p, i.e. the residual after all the rejections;
    - bonus token: when the walk reaches a leaf (no child to try), one token drawn from p there.

    Precondition, for sampled requests with ``draft_probs``, which the caller must guarantee:
    the children of every node are i.i.d. draws from q at that node (duplicates allowed), each
    subtree drawn independently of its siblings. Then each sibling test is a single-draft step
    against the residual the earlier rejections left, so by induction from the last sibling the
    token emitted at each node is distributed as p there. Top-k children of a draft model are
    not i.i.d. draws: verified against their q the output would be biased; pass them as point
    masses instead.

    Point masses (``draft_probs`` None for the request): q is the one-hot of the child being
    tried, so child x_i is accepted with probability p_i(x_i), p_i being p with x_1..x_{i-1}
    removed and renormalised, and a rejection removes x_i. For any children fixed before
    verification (distinct or not: a repeated token has p_i(x) = 0), x_j comes out with
    probability prod_{i<j} (1 - p_i(x_i)) p_j(x_j) = p(x_j), and the recovered token from what
    is left of p: lossless for greedy top-k trees, n-gram chains, even i.i.d. children, only
    accepted less often than with a matching q. A residual that sums to 0 (a rejection of
    probability 0, from rounding) leaves p as it was, as in the chain.

    Greedy rows (temperature 0 or top_k 1; ``draft_probs`` ignored, nothing drawn): the longest
    path whose every token equals the target argmax at its parent, ties (duplicate siblings)
    going to the lowest node index, and the argmax at its end as the bonus/recovered token.
    With distinct siblings this is the walk that follows the child equal to the argmax.

    Randomness: a request with a generator draws exactly N_b uniforms (node i is tested with the
    i-th), then V exponentials for the extra token (``sampling.sample``), so a seeded chain gives
    the same tokens as ``accept_drafts`` and a seeded request does not depend on its batch; the
    others share the global generator.

    Host reads: one, of [last node, extra token] per request at the end (see
    ``accept_tree_on_device`` for the version that leaves them on the device).
    """
    last, extra = accept_tree_on_device(target_logits, trees, draft_probs, params, generators)
    rows = torch.stack([last, extra], dim=1).tolist()  # the one host read (sync)
    out = []
    for tree, (node, tok) in zip(trees, rows, strict=True):
        path = tree.path(node)
        out.append(TreeVerdict(path, tuple(tree.tokens[i] for i in path) + (tok,)))
    return out


def accept_tree_on_device(
    target_logits: Tensor | Sequence[Tensor],  # [sum_b (N_b + 1), V] packed, or [N_b + 1, V] each
    trees: Sequence[DraftTree],
    draft_probs: Tensor | Sequence[Tensor | None] | None,  # like target_logits; None = point mass
    params: Sequence[SamplingParams],  # one per request
    generators: Sequence[torch.Generator | None] | None = None,
) -> tuple[Tensor, Tensor]:  # last [B] int64, extra [B] int64, on the device
    """``accept_tree`` without reading anything back: ``last[b]`` is the deepest accepted node
    of request b (-1: none; the path is ``trees[b].path(last[b])``), ``extra[b]`` the recovered
    or bonus token. Nothing is read back from the device: tree shapes, greedy rows and sampling
    parameters are host values, and the walk takes max N_b vectorised steps, a fixed count (each
    step tests at most one child per request; a request whose walk has ended idles). Draft
    probabilities on another device than the logits are copied over."""
    bsz = len(trees)
    if len(params) != bsz or (generators is not None and len(generators) != bsz):
        raise ValueError(f"{bsz} trees need {bsz} params and generators")
    if bsz == 0:
        dev = target_logits.device if isinstance(target_logits, Tensor) else None
        return (torch.zeros(0, dtype=torch.int64, device=dev),
                torch.zeros(0, dtype=torch.int64, device=dev))
    sizes = [len(t) + 1 for t in trees]
    logits = _packed(target_logits, sizes, "target_logits")  # [R, V]
    dev, vocab = logits.device, logits.shape[-1]
    greedy = [s.greedy for s in params]
    p = logits_to_probs(  # [R, V]
        logits, [s.temperature for s, n in zip(params, sizes) for _ in range(n)],
        [s.top_k for s, n in zip(params, sizes) for _ in range(n)],
        [s.top_p for s, n in zip(params, sizes) for _ in range(n)],
        min_p=[s.min_p for s, n in zip(params, sizes) for _ in range(n)])
    top = p.argmax(-1)  # [R]; p is one-hot on greedy rows
    t = _Tables.build(trees, greedy, draft_probs, vocab, dev)

    last = torch.full((bsz,), -1, dtype=torch.int64, device=dev)
    extra = torch.zeros(bsz, dtype=torch.int64, device=dev)
    if any(greedy):
        g_last = _greedy_last(top, t, max(tr.depth for tr, g in zip(trees, greedy) if g))
        last = torch.where(t.greedy, g_last, last)
        extra = torch.where(t.greedy, top[t.off + 1 + last], extra)
    if not all(greedy):
        gens = [None] * bsz if generators is None else list(generators)
        gens = [None if g else gen for g, gen in zip(greedy, gens, strict=True)]
        counts = [len(tr) for tr in trees]
        u = uniform(counts, t.width, gens, dev)  # [B, W]: node i of request b tests u[b, i]
        s_last, dist = _walk(p, t, u, max(counts))
        last = torch.where(t.greedy, last, s_last)
        drawn = sample(dist[t.sampled], [gens[b] for b in range(bsz) if not greedy[b]])  # [S]
        extra = extra.index_copy(0, t.sampled, drawn)
    return last, extra


def _packed(x: Tensor | Sequence[Tensor], sizes: list[int], name: str) -> Tensor:  # [R, V]
    if not isinstance(x, Tensor):
        x = list(x)
        if len(x) != len(sizes):
            raise ValueError(f"{name}: {len(x)} tensors for {len(sizes)} trees")
        for b, (rows, n) in enumerate(zip(x, sizes, strict=True)):
            if rows.dim() != 2 or rows.shape[0] != n:
                raise ValueError(f"{name}[{b}] shape {tuple(rows.shape)}: want [{n}, V]")
        x = torch.cat(x)
    if x.dim() != 2 or x.shape[0] != sum(sizes):
        raise ValueError(f"{name} shape {tuple(x.shape)}: want [{sum(sizes)}, V] (N_b + 1 rows "
                         "per tree)")
    return x


@dataclass(frozen=True)
class _Tables:
    """The batch's trees as padded device tables: W = max(max N_b, 1) node slots per request
    (padding slots: token, parent, first child and sibling -1, depth 0)."""

    width: int  # W
    off: Tensor  # [B] packed row of each request's root (its node i is at off + 1 + i)
    tok: Tensor  # [B, W] node tokens
    par: Tensor  # [B, W] parent node, -1 = the root
    dep: Tensor  # [B, W] node depths
    first: Tensor  # [B, W+1] first child of the root (column 0) and of node i (column 1 + i)
    sib: Tensor  # [B, W] next sibling, -1 = none
    greedy: Tensor  # [B] bool
    sampled: Tensor  # [S] int64: the sampled (non-greedy) requests
    dp: Tensor | None  # [R', V] fp32 packed draft rows of the requests that have them
    dp_off: Tensor  # [B] packed draft row of each request's root (0 for point masses)
    point: Tensor  # [B] bool: point-mass drafts
    any_point: bool
    all_point: bool

    @classmethod
    def build(cls, trees: Sequence[DraftTree], greedy: list[bool],
              draft_probs: Tensor | Sequence[Tensor | None] | None, vocab: int,
              dev: torch.device) -> _Tables:
        width = max(max((len(t) for t in trees), default=0), 1)
        off, tok, par, dep, first, sib = [], [], [], [], [], []
        at = 0
        for b, t in enumerate(trees):
            n = len(t)
            if t.tokens and max(t.tokens) >= vocab:
                raise ValueError(f"tree {b}: token {max(t.tokens)} out of vocabulary {vocab}")
            head, nxt, tail = [-1] * (n + 1), [-1] * n, [-1] * (n + 1)  # by parent + 1
            for i, a in enumerate(t.parents):
                if head[a + 1] < 0:
                    head[a + 1] = i
                else:
                    nxt[tail[a + 1]] = i
                tail[a + 1] = i
            pad = [-1] * (width - n)
            off.append(at)
            tok += list(t.tokens) + pad
            par += list(t.parents) + pad
            dep += list(t.depths) + [0] * (width - n)
            first += head + pad
            sib += nxt + pad
            at += n + 1

        sizes = [len(t) + 1 for t in trees]
        dp: Tensor | None = None
        point = [True] * len(trees)
        dp_off = [0] * len(trees)
        if isinstance(draft_probs, Tensor):
            dp = _packed(draft_probs, sizes, "draft_probs")
            point, dp_off = [False] * len(trees), off
        elif draft_probs is not None:
            probs = list(draft_probs)
            if len(probs) != len(trees):
                raise ValueError(f"draft_probs: {len(probs)} entries for {len(trees)} trees")
            have = [b for b, x in enumerate(probs) if x is not None]
            if have:
                parts = [x for x in probs if x is not None]
                dp = _packed(parts, [sizes[b] for b in have], "draft_probs")
                at = 0
                for b in have:
                    point[b], dp_off[b] = False, at
                    at += sizes[b]
        if dp is not None:
            if dp.shape[1] != vocab:
                raise ValueError(f"draft_probs vocabulary {dp.shape[1]} != {vocab}")
            dp = dp.to(dev, torch.float32)
        sampled = [b for b, g in enumerate(greedy) if not g]
        ints = upload([off, tok, par, dep, first, sib, dp_off, sampled,
                       [int(g) for g in greedy], [int(x) for x in point]], torch.int64, dev)
        off_t, tok_t, par_t, dep_t, first_t, sib_t, dp_off_t, sampled_t, g_t, point_t = (
            x for x in ints if x is not None)
        bsz = len(trees)
        return cls(
            width=width, off=off_t, tok=tok_t.view(bsz, width), par=par_t.view(bsz, width),
            dep=dep_t.view(bsz, width), first=first_t.view(bsz, width + 1),
            sib=sib_t.view(bsz, width), greedy=g_t != 0, sampled=sampled_t, dp=dp,
            dp_off=dp_off_t, point=point_t != 0,
            any_point=any(point[b] for b in sampled), all_point=all(point[b] for b in sampled))


def _greedy_last(
    top: Tensor,  # [R] target argmax at every packed row
    t: _Tables,
    max_depth: int,
) -> Tensor:  # [B] the deepest node whose whole path matches the argmax, -1 = none
    match = t.tok == top[t.off[:, None] + 1 + t.par]  # [B, W]; padding (-1) never matches
    good = match
    for _ in range(max_depth - 1):  # after k rounds, right for every node of depth <= k + 1
        above = torch.where(t.par >= 0, good.gather(1, t.par.clamp(min=0)), True)
        good = match & above
    depth, node = torch.where(good, t.dep, 0).max(dim=1)  # ties: the first (lowest) node
    return torch.where(depth > 0, node, -1)


def _walk(
    p: Tensor,  # [R, V] processed target distributions, packed
    t: _Tables,
    u: Tensor,  # [B, W] uniforms, one per node
    steps: int,  # max N_b: every step tests one node per request, each node at most once
) -> tuple[Tensor, Tensor]:  # last accepted node [B] (-1 = none), extra-token weights [B, V]
    """The recursive rejection sampling of every sampled request, one child test per step."""
    bsz = t.off.shape[0]
    rows = torch.arange(bsz, device=p.device)
    pos = torch.full((bsz,), -1, dtype=torch.int64, device=p.device)  # current node, -1 = root
    cand = torch.where(t.greedy, -1, t.first[:, 0])  # the child to test next, -1 = walk over
    # The current target distribution is w / scale: w is p itself at a fresh node (scale exactly
    # 1, so a chain computes bit for bit what accept_drafts does), else the unnormalised
    # residual left by the rejected siblings, from which the extra token is drawn as it stands.
    w = p[t.off]  # [B, V]
    scale = torch.ones(bsz, device=p.device)  # [B]
    for _ in range(steps):
        active = cand >= 0
        c = cand.clamp(min=0)
        x = t.tok[rows, c].clamp(min=0)  # [B] the token tested
        p_cur = w / scale[:, None]  # [B, V]
        one_hot = None
        if t.any_point:
            one_hot = torch.zeros_like(w).scatter_(1, x[:, None], 1.0)
        if t.dp is None or t.all_point:
            assert one_hot is not None
            q = one_hot
        else:
            q = t.dp[torch.where(t.point, 0, t.dp_off + 1 + pos)]  # [B, V] draft at the node
            if one_hot is not None:
                q = torch.where(t.point[:, None], one_hot, q)
        p_x = p_cur.gather(1, x[:, None]).squeeze(1)
        q_x = q.gather(1, x[:, None]).squeeze(1)
        ok = active & accept_mask(u[rows, c], p_x, q_x)
        rejected = active & ~ok
        res = residual(p_cur, q)  # [B, V]
        mass = res.sum(-1)
        # A residual of mass 0 comes from a rejection of probability 0 (rounding): keep p.
        update = rejected & (mass > 0)
        child_row = torch.where(ok, t.off + 1 + c, t.off)
        w = torch.where(ok[:, None], p[child_row], torch.where(update[:, None], res, w))
        scale = torch.where(ok, 1.0, torch.where(update, mass, scale))
        pos = torch.where(ok, c, pos)
        cand = torch.where(ok, t.first[rows, c + 1], torch.where(rejected, t.sib[rows, c], cand))
    return pos, w
