"""The prefix sharing table of docs/simulator.md (``specstream simulate --sharing-table``).

One H200 (PCIe 5) serving Qwen3-8B + Qwen3-0.6B to N requests over one shared D-token document,
each with S tokens of its own (a question): the steady-state round of each offloading mode with
prefix sharing off (every request holds and moves its own copy of the document) and on (the
document once, ``Batch.shared``: its cold blocks cross the link once per verification, for all
the requests verified together, as the engine's shared waves and shared restores move them).
Residency ``tail`` (the paper's configuration, the bench's link-bound preset): everything past
a request's resident tail streams every round, so the document is cold and the round is
link-bound. Roofline costs; predicted, untested on a GPU.

What sharing changes here: the history bytes per round (a group of g requests moves
D + g (cold - D) instead of g cold) and the host's KV (the document once). What it does not:
every request still attends its whole context (no cascade-attention saving on the device is
assumed), and the device's tails, draft KV and staging are per request as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from specstream.sim.api import Scenario
from specstream.sim.hardware import GB
from specstream.sim.memory import plan
from specstream.sim.rounds import RoundResult, best_round

SHARING_MODES = ("offload", "offload-spec", "specstream", "parallel-spec")


@dataclass(frozen=True)
class SharedDoc:
    """N requests over one document: D shared tokens, S own, ``output_len`` generated."""

    num_requests: int = 32
    doc_len: int = 32768
    own_len: int = 512
    output_len: int = 512

    @property
    def context(self) -> float:
        """A request's mean context over its decode: the prompt and half its output."""
        return self.doc_len + self.own_len + self.output_len / 2

    @property
    def sharing_factor(self) -> float:
        """N (D + S) / (D + N S): the bytes one round moves without sharing over with it,
        every request's whole prompt cold and verified together."""
        n, d, s = self.num_requests, self.doc_len, self.own_len
        return n * (d + s) / (d + n * s)

    def cold_factor(self, cold: float) -> float:
        """The same for ``cold`` tokens of each request's history crossing the link (its
        resident tail aside): N c / (D + N (c - D)), the most sharing can save a round."""
        n, d = self.num_requests, min(float(self.doc_len), cold)
        return n * cold / (d + n * (cold - d)) if cold else 1.0


@dataclass(frozen=True)
class SharingRow:
    mode: str
    sharing: bool
    round: RoundResult
    fits: bool  # the batch fits the device and the host
    host_kv_bytes: float  # the batch's cold history on the host (the document once: on)
    max_requests: int  # the most such requests the device and the host hold (up to LIMIT)

    @property
    def tpot_s(self) -> float:
        """Seconds per output token of one request: the round period over its tokens."""
        r = self.round
        return r.period_s / r.tokens_per_round if r.tokens_per_round else 0.0


LIMIT = 4096  # requests: where max_requests stops looking


def max_requests(mode: str, sc: Scenario, context: float, shared: float = 0.0) -> int:
    """The most requests of ``context`` tokens (the first ``shared`` of them shared) whose KV
    fits the device and the host (``memory.plan``), at most LIMIT."""
    def fits(n: int) -> bool:
        return plan(mode, sc.costs, sc.policy, [context] * n, shared).fits

    lo, hi = 0, 1
    while hi <= LIMIT and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, LIMIT + 1)
    while hi - lo > 1:  # lo fits, hi does not (or is past the limit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def sharing_rows(sc: Scenario, doc: SharedDoc, modes: Sequence[str] = SHARING_MODES
                 ) -> list[SharingRow]:
    """Per mode, sharing off then on: the best round (q from the policy's candidates) of
    ``doc.num_requests`` requests of ``doc.context`` tokens."""
    contexts = [doc.context] * doc.num_requests
    rows = []
    for mode in modes:
        for sharing in (False, True):
            shared = float(doc.doc_len) if sharing else 0.0
            r = best_round(mode, sc.costs, sc.policy, contexts, sc.acceptance, shared=shared)
            memory = plan(mode, sc.costs, sc.policy, contexts, shared)
            rows.append(SharingRow(mode, sharing, r, memory.fits, memory.host_bytes,
                                   max_requests(mode, sc, doc.context, shared)))
    return rows


def sharing_table(doc: SharedDoc | None = None, alpha: float = 0.75) -> str:
    """The table, its setting first."""
    doc = doc or SharedDoc()
    sc = Scenario.from_names("H200", "Qwen3-8B", "Qwen3-0.6B", (int(doc.context),),
                             doc.num_requests, alpha, doc.output_len, pcie_gen=5)
    sc = replace(sc, policy=replace(sc.policy, residency="tail"))
    hw = sc.hardware
    link = f"{hw.link_bw / GB:.0f} GB/s link" if hw is not None else "link"
    cold = sc.policy.cold_tokens("offload", doc.context)
    head = (
        f"H200 PCIe 5 ({link}), Qwen3-8B + Qwen3-0.6B, {doc.num_requests} requests over one "
        f"{doc.doc_len}-token document + {doc.own_len} own tokens each, {doc.output_len} "
        f"output tokens, alpha {alpha}, residency tail (resident tail "
        f"{sc.policy.resident_tail}), steady-state rounds at the mean decode context "
        f"({doc.context:.0f} tokens, {cold:.0f} of them cold), q chosen per mode; roofline, "
        f"untested on a GPU. Sharing factor of the prompt N(D+S)/(D+NS) = "
        f"{doc.sharing_factor:.1f}x, of the cold history N c/(D+N(c-D)) = "
        f"{doc.cold_factor(cold):.1f}x.\n\n"
        "| mode | sharing | q | requests per verification | history MB / round | round ms "
        "| tok/s | TPOT ms | host KV GB | requests that fit | sharing gain |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    rows = sharing_rows(sc, doc)
    off: dict[str, float] = {}
    for row in rows:
        r = row.round
        if not row.sharing:
            off[row.mode] = r.tokens_per_s
        gain = f"{r.tokens_per_s / off[row.mode]:.2f}x" if row.sharing else "1.00x"
        grouped = row.mode in ("specstream", "parallel-spec")
        per = doc.num_requests // (sc.policy.groups if grouped else 1)
        lines.append(
            f"| {row.mode} | {'on' if row.sharing else 'off'} | {r.q} | {per} "
            f"| {r.link_bytes / 1e6:.0f} | {r.period_s * 1e3:.1f} | {r.tokens_per_s:.0f} "
            f"| {row.tpot_s * 1e3:.1f} | {row.host_kv_bytes / GB:.1f} "
            f"| {row.max_requests if row.fits else 'no fit'} | {gain} |")
    return "\n".join(lines)
