"""Attention of one step in chunk waves: every query position of many requests over each
request's own keys in one call, merged exactly at the end of the layer.

A wave is one piece of every request it serves: the j-th history chunk of a group of requests
(copied as one transfer into one staging slot), one request's restored layer, or the resident
tails of all of them. Per layer the round opens one :class:`WaveAttention` per query bucket
(requests padded to the same number of query positions), adds the waves as they land, and reads
the result. Each ``add`` is one attention call returning a partial ``(out, lse)`` normalised
within the wave; ``result`` merges all of them in one pass (the online-softmax identity
``out = sum_c exp(lse_c - lse) out_c``, see ``streamed.py``), so the launch count per layer is
the number of waves, whatever the number of requests.

Backends (``attention_backend``): ``torch`` (matmuls, or the fused CPU flash kernel where torch
has it) and ``triton`` (``triton_wave.py``: one kernel launch per wave, masks computed in the
kernel from per-request lengths, no host sync). ``auto`` is Triton for CUDA tensors when it is
importable, torch otherwise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specstream.attention.reference import gqa_group
from specstream.attention.streamed import CPU_FLASH, finite_or_zero, merge_all
from specstream.attention.triton_wave import (
    triton_available,
    visible_keys,
    wave_attention_triton,
)
from specstream.backends.base import upload
from specstream.registry import Registry

NEG_INF = float("-inf")


@dataclass
class WaveShape:
    """Which of a bucket's requests a wave serves and which keys each of them sees.

    Built once per step (the same for every layer); tensors on the device.
    """

    # [W] long: the wave's requests as rows of the bucket; None = all of them, in order.
    index: Tensor | None
    # [W] int32: request w's keys are 0 .. key_len[w] - 1 of the wave's N.
    key_len: Tensor
    # [W] int32 or None: query i of request w sees keys j <= causal_offset[w] + i (the tail).
    causal_offset: Tensor | None
    # Every request sees all N keys (no mask needed).
    full: bool
    # [W, P, N] bool or None: an explicit visibility mask on top of key_len (a token tree's
    # new tokens: query i of request w sees key j iff tree[w, i, j]). Waves with one run on
    # the torch path whatever the backend (they are small: a round's new tokens).
    tree: Tensor | None = None
    # Folded additive masks of the torch path, by (group, queries, keys), and which of their
    # rows see no key at all.
    _masks: dict[tuple[int, int, int], Tensor] = field(default_factory=dict)
    _empty: dict[tuple[int, int, int], Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, index: list[int] | None, key_len: list[int], num_keys: int,
              causal_offset: list[int] | None, device: torch.device,
              tree: Tensor | None = None) -> WaveShape:
        full = tree is None and causal_offset is None and all(n == num_keys for n in key_len)
        index_t, lengths, offsets = upload([index, key_len, causal_offset], torch.int64, device)
        assert lengths is not None
        if tree is not None:
            if tree.dim() != 3 or tree.shape[0] != len(key_len) or tree.shape[2] != num_keys:
                raise ValueError(f"tree mask {tuple(tree.shape)} does not fit "
                                 f"{len(key_len)} requests x {num_keys} keys")
            tree = tree.to(device=device, dtype=torch.bool)
        return cls(index_t, lengths.int(), None if offsets is None else offsets.int(), full,
                   tree)

    def folded_mask(self, group: int, num_q: int, num_k: int) -> Tensor | None:
        """``[W, 1, group * num_q, num_k]`` float, 0 where visible and -inf elsewhere; rows
        folded as ``(g, i)``. None when every key is visible."""
        if self.full:
            return None
        key = (group, num_q, num_k)
        if key not in self._masks:
            vis = visible_keys(num_q, num_k, self.key_len, self.causal_offset)  # [W, P, N]
            if self.tree is not None:
                vis = vis & self.tree[:, :num_q, :num_k]
            vis = vis[:, None].expand(-1, group, -1, -1).reshape(-1, 1, group * num_q, num_k)
            self._masks[key] = torch.zeros(vis.shape, device=vis.device).masked_fill_(
                ~vis, NEG_INF)
            self._empty[key] = ~vis.any(dim=-1)  # [W, 1, group * num_q]
        return self._masks[key]

    def empty_rows(self, group: int, num_q: int, num_k: int) -> Tensor | None:
        """``[W, 1, group * num_q]`` bool: folded rows that see no key (None: no mask)."""
        return None if self.folded_mask(group, num_q, num_k) is None else self._empty[
            (group, num_q, num_k)]


class WaveAttention(ABC):
    """The query positions of one bucket of requests (``q`` ``[R, P, H, D]``, padded) over any
    number of waves of keys, in any order."""

    def __init__(self, q: Tensor, num_kv_heads: int, scale: float) -> None:
        self.num_rows, self.num_q, self.num_heads, self.head_dim = q.shape
        self.num_kv_heads, self.scale = num_kv_heads, scale
        self.group = gqa_group(self.num_heads, num_kv_heads)
        self.out_dtype = q.dtype
        self.outs: list[Tensor] = []
        self.lses: list[Tensor] = []

    @abstractmethod
    def add(self, k: Tensor, v: Tensor, shape: WaveShape) -> None:
        """One wave: ``k``, ``v`` ``[W, N, num_kv_heads, head_dim]`` (request w's keys first,
        padding after); ``shape`` says whose they are and which are visible."""

    @abstractmethod
    def result(self) -> Tensor:  # [R, P, H, D] in q's dtype
        """The merged attention of every wave added."""

    def fold(self) -> None:
        """Merge the partials kept so far into one with its log-sum-exp (exact: the merge is
        associative), so what comes later merges with one (the host's, while it computes)."""
        if len(self.outs) > 1:
            out, lse = merge_all(self.outs, self.lses)
            self.outs, self.lses = [out], [lse]

    def add_partial(self, out: Tensor, lse: Tensor, index: Tensor | None) -> None:
        """A partial result computed elsewhere (host attention): ``out`` ``[W, P, H, D]`` and
        ``lse`` ``[W, P, H]`` (fp32) of rows ``index`` (None: all R), over keys no wave has."""
        self._keep(out.float(), lse.float(), index)

    def _keep(self, out: Tensor, lse: Tensor, index: Tensor | None) -> None:
        """Store a partial, spread over all R rows when the wave served a subset."""
        if index is not None:
            out = out.new_zeros((self.num_rows, *out.shape[1:])).index_copy_(0, index, out)
            lse = lse.new_full((self.num_rows, *lse.shape[1:]), NEG_INF).index_copy_(
                0, index, lse)
        self.outs.append(out)
        self.lses.append(lse)


ATTENTION: Registry[type[WaveAttention]] = Registry("attention backend")


@ATTENTION.register("torch")
class TorchWaves(WaveAttention):
    """Queries folded once per layer into GQA rows ``[R, kv, group * P, D]`` (fp32, so K/V are
    never repeated); one fused flash call per wave on the CPU, else matmuls and a softmax."""

    def __init__(self, q: Tensor, num_kv_heads: int, scale: float) -> None:
        super().__init__(q, num_kv_heads, scale)
        r, p, _, d = q.shape
        qf = q.float().view(r, p, num_kv_heads, self.group, d).permute(0, 2, 3, 1, 4)
        self.q = qf.reshape(r, num_kv_heads, self.group * p, d)  # rows (g, i)

    def add(self, k: Tensor, v: Tensor, shape: WaveShape) -> None:
        q = self.q if shape.index is None else self.q.index_select(0, shape.index)
        if k.dtype != torch.float32:
            k, v = k.float(), v.float()
        kt, vt = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)  # [W, kv, N, D]
        mask = shape.folded_mask(self.group, self.num_q, k.shape[1])
        if CPU_FLASH is not None and q.device.type == "cpu":
            out, lse = CPU_FLASH(q, kt, vt, 0.0, False, attn_mask=mask, scale=self.scale)
            empty = shape.empty_rows(self.group, self.num_q, k.shape[1])
            if empty is not None:  # the kernel gives such rows lse 0: they must weigh nothing
                lse = lse.masked_fill(empty, NEG_INF)
                out = out.masked_fill(empty[..., None], 0.0)
        else:
            s = torch.matmul(q, kt.transpose(-1, -2)).mul_(self.scale)  # [W, kv, rows, N]
            if mask is not None:
                s = s.add_(mask)
            lse = torch.logsumexp(s, dim=-1)
            out = torch.matmul(torch.exp(s - finite_or_zero(lse).unsqueeze(-1)), vt)
        self._keep(out, lse, shape.index)

    def add_partial(self, out: Tensor, lse: Tensor, index: Tensor | None) -> None:
        w, p, kv, g, d = out.shape[0], self.num_q, self.num_kv_heads, self.group, self.head_dim
        out = out.float().view(w, p, kv, g, d).permute(0, 2, 3, 1, 4).reshape(w, kv, g * p, d)
        lse = lse.float().view(w, p, kv, g).permute(0, 2, 3, 1).reshape(w, kv, g * p)
        self._keep(out, lse, index)

    def result(self) -> Tensor:
        out = merge_all(self.outs, self.lses)[0]  # [R, kv, group * P, D]
        r, kv, g, p, d = self.num_rows, self.num_kv_heads, self.group, self.num_q, self.head_dim
        return out.view(r, kv, g, p, d).permute(0, 3, 1, 2, 4).reshape(
            r, p, kv * g, d).to(self.out_dtype)


@ATTENTION.register("triton")
class TritonWaves(WaveAttention):
    """One ``wave_attention_triton`` launch per wave; lengths and offsets stay on the device."""

    def __init__(self, q: Tensor, num_kv_heads: int, scale: float) -> None:
        super().__init__(q, num_kv_heads, scale)
        self.q = q

    def add(self, k: Tensor, v: Tensor, shape: WaveShape) -> None:
        q = self.q if shape.index is None else self.q.index_select(0, shape.index)
        if shape.tree is not None:  # an explicit mask: the torch reference (a few keys)
            out, lse = _masked_torch(q, k, v, self.scale, shape)
            self._keep(out, lse, shape.index)
            return
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        out, lse = wave_attention_triton(q, k, v, self.scale, shape.key_len, shape.causal_offset)
        self._keep(out, lse, shape.index)

    def result(self) -> Tensor:
        return merge_all(self.outs, self.lses)[0].to(self.out_dtype)


def _masked_torch(q: Tensor, k: Tensor, v: Tensor, scale: float,
                  shape: WaveShape) -> tuple[Tensor, Tensor]:
    """One wave with an explicit mask, in fp32 matmuls: out ``[W, P, H, D]``, lse
    ``[W, P, H]`` (rows that see no key: lse -inf, out 0)."""
    w, p, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    qf = q.float().view(w, p, kv, g, d).permute(0, 2, 3, 1, 4).reshape(w, kv, g * p, d)
    kt, vt = k.float().permute(0, 2, 1, 3), v.float().permute(0, 2, 1, 3)  # [W, kv, N, D]
    s = torch.matmul(qf, kt.transpose(-1, -2)).mul_(scale)  # [W, kv, g * P, N]
    mask = shape.folded_mask(g, p, k.shape[1])
    if mask is not None:
        s = s.add_(mask.view(w, 1, g * p, -1))
    lse = torch.logsumexp(s, dim=-1)  # [W, kv, g * P]
    out = torch.matmul(torch.exp(s - finite_or_zero(lse).unsqueeze(-1)), vt)
    out = out.view(w, kv, g, p, d).permute(0, 3, 1, 2, 4).reshape(w, p, h, d)
    return out, lse.view(w, kv, g, p).permute(0, 3, 1, 2).reshape(w, p, h)


def resolve_backend(name: str, device: str) -> str:
    """``auto``: Triton on CUDA when it is importable, torch otherwise. An explicit ``triton``
    without Triton is an error (on the CPU it runs under ``TRITON_INTERPRET=1``)."""
    if name == "auto":
        return "triton" if device.startswith("cuda") and triton_available() else "torch"
    if name == "triton" and not triton_available():
        raise ValueError(
            "attention_backend='triton' needs Triton: pip install 'specstream[triton]'")
    ATTENTION.get(name)  # raises with the known names
    return name
