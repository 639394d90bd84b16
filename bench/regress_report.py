"""bench/regress.py's workloads (a size tier each), its figures (which way is better, what each
is) and how its reports are read: one figure's repeats summarised, several reports of one
revision merged, two revisions compared figure by figure against the spread of their
repeats.

A figure of B is worse when it is worse beyond the spread of the repeats: B's median worse than
every repeat of A and A's median better than every repeat of B. With three repeats a side and
no change that happens to a figure about one time in ten; with five, one in forty; rerun a
flagged figure before believing it."""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sizes:
    """The workloads of one size tier: (prompt tokens, requests, output tokens) and links."""

    # the link-bound preset's workload and link: with 2K prompts (1,792 tokens of each
    # streaming every round), 4 requests (two groups of two, one chunk wave each) and 0.05
    # GB/s, a round streams as long per request as the preset's 4K prompts at 0.1 GB/s
    link_bound: tuple[int, int, int]
    link_bound_gbps: float
    # the balanced bench's workload, link and device budget. The README's is 8 x 4K prompts,
    # 128 tokens, 1 GB/s, 64 MiB: residency fill keeps about a third of the history, the
    # restore modes run 5 of the 8 requests at once and specstream all. Here 6 x 2K prompts
    # and 48 tokens (as --quick), half the link (half the history a round), and 36 MiB, where
    # the restore modes run 4 of the 6 and specstream all (64 MiB, --quick's, holds nearly all
    # of this workload's 77 MB under fill: rounds then stream almost nothing)
    balanced: tuple[int, int, int]
    balanced_gbps: float
    balanced_device_kv_bytes: int
    # residency fill at half the KV runs on the balanced workload over a link-bound link
    residency_gbps: float
    chunk_tokens: int  # tokens per streamed chunk (a staging slot holds a wave of them)
    host_overhead_argv: tuple[str, ...]
    repeats: int
    # prefix sharing (issue 31): (requests, shared document, own tokens, output tokens) under
    # fill, on a budget that holds the document once beside the requests' own KV but not a
    # copy per request, and its link
    shared_doc: tuple[int, int, int, int] = (4, 1536, 128, 24)
    shared_doc_gbps: float = 0.25
    shared_doc_device_kv_bytes: int = 24 << 20


SIZES = {
    "full": Sizes(link_bound=(2048, 4, 32), link_bound_gbps=0.05,
                  balanced=(2048, 6, 48), balanced_gbps=0.5, balanced_device_kv_bytes=36 << 20,
                  residency_gbps=0.25, chunk_tokens=2048, host_overhead_argv=("--rounds", "10"),
                  repeats=3),
    "quick": Sizes(link_bound=(1024, 4, 16), link_bound_gbps=0.05,
                   balanced=(1024, 4, 24), balanced_gbps=0.5, balanced_device_kv_bytes=16 << 20,
                   residency_gbps=0.25, chunk_tokens=1024, host_overhead_argv=("--rounds", "4"),
                   repeats=2, shared_doc=(4, 1024, 128, 12)),
    # for the tests: the plumbing, not the figures
    "smoke": Sizes(link_bound=(640, 4, 8), link_bound_gbps=1.0,
                   balanced=(768, 4, 6), balanced_gbps=4.0, balanced_device_kv_bytes=12 << 20,
                   residency_gbps=2.0, chunk_tokens=256,
                   host_overhead_argv=("--layers", "2", "--draft-layers", "1", "--requests",
                                       "2", "--chunks", "3", "--rounds", "2"),
                   repeats=2, shared_doc=(3, 512, 64, 6), shared_doc_device_kv_bytes=12 << 20),
}


HIGHER, LOWER, TRUE = "higher", "lower", "true"
# figure -> (which way is better, what it is)
FIGURES: dict[str, tuple[str, str]] = {
    "host_over_link": (LOWER, "host time of a GPU-shaped specstream round / its H200 link time"),
    "link_bound.chain_over_offload_spec": (
        HIGHER, "output tok/s, specstream chains (auto, q <= 4) / offload-spec fixed q = 4"),
    "link_bound.chain_over_offload_spec_decode_only": (
        HIGHER, "decode-only tok/s, specstream chains (auto, q <= 4) / offload-spec q = 4"),
    "link_bound.trees_over_offload_spec": (
        HIGHER, "output tok/s, specstream trees (auto, top-4, <= 32 nodes) / offload-spec q = 4"),
    "link_bound.trees_over_offload_spec_decode_only": (
        HIGHER, "decode-only tok/s, specstream trees / offload-spec q = 4"),
    "link_bound.trees_accepted_over_offload_spec": (
        HIGHER, "mean accepted tokens per round, specstream trees / offload-spec q = 4"),
    "host_attention.speedup": (
        HIGHER, "output tok/s, specstream chains with host attention auto (host at 8x the "
                "link) / without"),
    "host_attention.speedup_decode_only": (
        HIGHER, "decode-only tok/s, specstream chains with host attention auto / without"),
    "residency.fill_bytes_over_floor": (
        LOWER, "specstream fill at half the KV: link bytes per round / the floor's"),
    "balanced.specstream_over_offload_spec_decode_only": (
        HIGHER, "decode-only tok/s, specstream / offload-spec (both fixed q = 4)"),
    "balanced.specstream_over_offload_decode_only": (
        HIGHER, "decode-only tok/s, specstream (fixed q = 4) / offload"),
    "sharing.specstream_on_over_off": (
        HIGHER, "output tok/s, specstream under fill over one shared document, prefix sharing "
                "on / off"),
    "sharing.bytes_on_over_off": (
        LOWER, "the same runs' history bytes a decode round, prefix sharing on / off"),
    "outputs_match_reference": (TRUE, "every run's greedy outputs equal resident's"),
}


def summary(name: str, values: list[Any]) -> dict[str, Any]:
    better, what = FIGURES[name]
    if better == TRUE:
        return {"better": better, "what": what, "values": values, "all": all(values)}
    return {"better": better, "what": what, **spread(values)}


def spread(values: list[Any]) -> dict[str, Any]:
    return {"values": values, "min": min(values), "median": statistics.median(values),
            "max": max(values)}


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Several reports of one revision as one: every figure's and run's repeats together."""
    out = copy.deepcopy(reports[0])
    for r in reports[1:]:
        for name, fig in r["figures"].items():
            if name in out["figures"]:
                out["figures"][name]["values"] += fig["values"]
            else:
                out["figures"][name] = copy.deepcopy(fig)
        for name, keys in r["runs"].items():
            for k, v in keys.items():
                out["runs"].setdefault(name, {}).setdefault(k, {"values": []})["values"] += \
                    v["values"]
        out["warnings"] += r["warnings"]
    for name, fig in out["figures"].items():
        out["figures"][name] = summary(name, fig["values"])
    out["runs"] = {n: {k: spread(v["values"]) for k, v in keys.items()}
                   for n, keys in out["runs"].items()}
    out["repeats"] = sum(r["repeats"] for r in reports)
    out["wall_s"] = [r["wall_s"] for r in reports]
    out["merged_from"] = len(reports)
    return out


# --- comparing ---------------------------------------------------------------------------

def verdict(better: str, a: list[Any], b: list[Any]) -> str:
    """'worse', 'better' or 'within' (the spread of the repeats); booleans: 'worse' when B
    has a False."""
    if better == TRUE:
        return "within" if all(b) else "worse"
    sign = 1.0 if better == HIGHER else -1.0
    a_s, b_s = [sign * x for x in a], [sign * x for x in b]
    ma, mb = statistics.median(a_s), statistics.median(b_s)
    if mb < min(a_s) and ma > max(b_s):
        return "worse"
    if mb > max(a_s) and ma < min(b_s):
        return "better"
    return "within"


def compare(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Each figure's verdict (B against A), and notes on what differs between the runs."""
    notes = []
    if a.get("sizes") != b.get("sizes"):
        notes.append("the two reports ran different workloads (sizes differ): figures are "
                     "not comparable")
    rows = []
    for name in dict.fromkeys([*a["figures"], *b["figures"]]):
        fa, fb = a["figures"].get(name), b["figures"].get(name)
        if fa is None or fb is None:
            rows.append({"figure": name, "verdict": "missing in " + ("A" if fa is None else "B")})
            continue
        rows.append({"figure": name, "better": fa["better"],
                     "a": fa["values"], "b": fb["values"],
                     "verdict": verdict(fa["better"], fa["values"], fb["values"])})
    return rows, notes


def ratio_of(a: list[float], b: list[float]) -> str:
    """B's median over A's, or what it is where A's median is 0 (a figure that can be 0, such
    as bytes a round with nothing to move)."""
    ma, mb = statistics.median(a), statistics.median(b)
    if ma == 0:
        return "equal (0)" if mb == 0 else "from 0"
    return f"{mb / ma:.3f}"


def format_comparison(rows: list[dict[str, Any]], notes: list[str]) -> str:
    def cell(values: list[Any]) -> str:
        if isinstance(values[0], bool):
            return "all True" if all(values) else f"{values.count(False)} False"
        return (f"{statistics.median(values):.4g} [{min(values):.4g}-{max(values):.4g}] "
                f"n={len(values)}")

    lines = ["| figure | better | A median [min-max] | B median [min-max] | B / A | verdict |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "a" not in r:
            lines.append(f"| {r['figure']} | | | | | {r['verdict']} |")
            continue
        ratio = "" if r["better"] == TRUE else ratio_of(r["a"], r["b"])
        mark = "**WORSE**" if r["verdict"] == "worse" else r["verdict"]
        lines.append(f"| {r['figure']} | {r['better']} | {cell(r['a'])} | {cell(r['b'])} | "
                     f"{ratio} | {mark} |")
    return "\n".join(lines + [f"note: {n}" for n in notes])


def run_shared_doc(sizes: Sizes, balanced: Any, log: Any) -> dict[bool, tuple[dict[str, Any], Any]]:
    """The sharing group's runs (bench/regress.py): `specstream` under fill over
    ``sizes.shared_doc``, prefix sharing off then on; {on: (results, tokens)}."""
    from dataclasses import replace

    from specstream.bench.runner import measure, open_llm
    from specstream.bench.shared import SharedDocWorkload

    d = SharedDocWorkload(*sizes.shared_doc)
    s = replace(balanced, residency="fill", link_gbps=sizes.shared_doc_gbps,
                device_kv_bytes=sizes.shared_doc_device_kv_bytes)
    runs = {}
    for on in (False, True):
        rs = replace(s, extra={**s.extra, "prefix_sharing": on})
        llm = open_llm("specstream", rs)
        try:
            prompts = d.prompts(llm.tokenizer, llm.engine.model_config.vocab_size, s.seed)
            runs[on] = measure(llm, "specstream", d.kv_workload(), rs, prompts)
        finally:
            llm.close()
        r = runs[on][0]
        log(f"  shared_doc, sharing {'on' if on else 'off'}: {r['output_tokens_per_s']:.2f} "
            f"tok/s, {r.get('link_bytes_per_round', 0) / 1e6:.2f} MB a round")
    return runs

