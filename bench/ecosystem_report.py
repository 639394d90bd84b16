"""What bench/ecosystem_clients.py reads off the server and writes: the server's histograms and
counters gained during a client's run (from two /metrics scrapes), and the Markdown table of
client's figures against the server's."""

from __future__ import annotations

import json
import math
from typing import Any

# The server's series for each figure: vLLM's name first, this project's older name second.
HISTOGRAMS = {
    "ttft": ["vllm:time_to_first_token_seconds", "specstream_time_to_first_token_seconds"],
    "itl": ["vllm:inter_token_latency_seconds", "specstream_inter_token_latency_seconds"],
    "tpot": ["vllm:request_time_per_output_token_seconds",
             "specstream_time_per_output_token_seconds"],
    "e2e": ["vllm:e2e_request_latency_seconds", "specstream_e2e_request_latency_seconds"],
}
COUNTERS = {
    "requests": ["vllm:request_success", "specstream_requests_finished"],
    "prompt_tokens": ["vllm:prompt_tokens", "specstream_prompt_tokens"],
    "generation_tokens": ["vllm:generation_tokens", "specstream_generation_tokens"],
    "draft_tokens": ["vllm:spec_decode_num_draft_tokens",
                     "specstream_spec_decode_num_draft_tokens"],
    "accepted_tokens": ["vllm:spec_decode_num_accepted_tokens",
                        "specstream_spec_decode_num_accepted_tokens"],
}


def series(samples: dict[str, float], name: str) -> dict[str, float]:
    """Samples whose metric name is exactly ``name``, keyed by their labels."""
    return {k[len(name):]: v for k, v in samples.items() if k.split("{", 1)[0] == name}


def histogram_delta(before: dict[str, float], after: dict[str, float],
                    names: list[str]) -> dict[str, Any] | None:
    """Mean and interpolated median (seconds) of what one histogram gained between scrapes."""
    for name in names:
        if not series(after, name + "_count"):
            continue
        count = sum(series(after, name + "_count").values()) - sum(
            series(before, name + "_count").values())
        total = sum(series(after, name + "_sum").values()) - sum(
            series(before, name + "_sum").values())
        buckets: dict[float, float] = {}
        for labels, v in series(after, name + "_bucket").items():
            le = float(labels.split("le=", 1)[1].split(",", 1)[0].rstrip("}"))
            buckets[le] = buckets.get(le, 0.0) + v - series(before, name + "_bucket").get(
                labels, 0.0)
        return {"series": name, "count": count,
                "mean_s": total / count if count else None,
                "median_s": bucket_quantile(buckets, 0.5)}
    return None


def bucket_quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket the rank falls in."""
    edges = sorted(buckets)
    if not edges or buckets[edges[-1]] <= 0:
        return None
    rank = q * buckets[edges[-1]]
    lo, below = 0.0, 0.0
    for le in edges:
        if buckets[le] >= rank:
            if math.isinf(le):
                return lo
            return lo + (le - lo) * (rank - below) / max(buckets[le] - below, 1e-12)
        lo, below = le, buckets[le]
    return None


def counter_delta(before: dict[str, float], after: dict[str, float],
                  names: list[str]) -> dict[str, Any] | None:
    for name in names:
        for sample in (name + "_total", name):
            now = series(after, sample)
            if now:
                return {"series": name,
                        "value": sum(now.values()) - sum(series(before, sample).values())}
    return None


def fmt(v: Any, scale: float = 1.0, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, str):
        return v
    return f"{v * scale:.{digits}f}"


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| client | endpoint | success | figure | client's | server's /metrics |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        c, m = r["client_figures"], r["server_metrics"]

        def hist(key: str, stat: str, m: dict[str, Any] = m) -> str:
            h = m.get(key)
            return fmt(h and h[f"{stat}_s"], 1000) + (f" (`{h['series']}`)" if h else "")

        gen = m.get("generation_tokens")
        dur = c.get("duration_s")
        rows = [("mean TTFT (ms)", fmt(c.get("mean_ttft_ms")), hist("ttft", "mean")),
                ("median TTFT (ms)", fmt(c.get("median_ttft_ms")), hist("ttft", "median")),
                ("mean ITL (ms)", fmt(c.get("mean_itl_ms")), hist("itl", "mean")),
                ("median ITL (ms)", fmt(c.get("median_itl_ms")), hist("itl", "median")),
                ("mean TPOT (ms)", fmt(c.get("mean_tpot_ms")), hist("tpot", "mean")),
                ("mean e2e latency (ms)", fmt(c.get("mean_e2e_ms")), hist("e2e", "mean")),
                ("output tokens", fmt(c.get("output_tokens"), digits=0),
                 fmt(gen and gen["value"], digits=0)),
                ("output throughput (tok/s)", fmt(c.get("output_throughput")),
                 fmt(gen and dur and gen["value"] / dur)),
                ("requests finished", f"{r['succeeded']} of {r['requests']}",
                 fmt(m.get("requests") and m["requests"]["value"], digits=0))]
        drafts, accepted = m.get("draft_tokens"), m.get("accepted_tokens")
        if drafts and accepted and drafts["value"]:
            rows.append(("draft tokens accepted", "-", f"{accepted['value']:.0f} of "
                         f"{drafts['value']:.0f} ({accepted['value'] / drafts['value']:.0%})"))
        rows += [(k, fmt(v, digits=3), "") for k, v in c.items()
                 if k.startswith("specstream_") or k == "tokenizer"]
        rows = [row for row in rows if row[1] != "-" or row[2] not in ("", "-")]
        for i, (name, ours, theirs) in enumerate(rows):
            lead = (f"| {r['client']} | `{r['endpoint']}` | {r['success_pct']:.0f}% |" if i == 0
                    else "| | | |")
            lines.append(f"{lead} {name} | {ours} | {theirs} |")
    return "\n".join(lines)


def report(rec: dict[str, Any], num_docs: int) -> str:
    """The Markdown of one run's record (``num_docs``: the lm-eval tasks' documents)."""
    runs = rec["runs"]
    md = (f"# Ecosystem clients against specstream serve\n\n`{rec['command']}`\n\n"
          f"Server: {rec['server']}, revision {rec['revision']}. "
          f"Workload: {json.dumps(rec['workload'])}; lm-eval: "
          f"{num_docs} documents of two local tasks. Machine: {rec['machine']}.\n\n"
          "The server's figures are what its histograms and counters gained during that "
          "client's run (means: sum over count; medians: interpolated within buckets, as "
          "Prometheus' histogram_quantile); its throughput is its generation tokens over the "
          "client's duration.\n\n"
          f"{table(runs)}\n")
    for r in runs:
        if r["first_errors"]:
            md += f"\n{r['client']}: first errors:\n\n```\n" + "\n".join(
                e[:400] for e in r["first_errors"]) + "\n```\n"
    return md
