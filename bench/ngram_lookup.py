"""Speed of prompt-lookup drafting (`ngram_lookup`) as the history grows.

Two cases per history length: a batch of 8 requests whose random history ends with a 4-gram
that occurred once before (`NgramProposer.propose`, the engine's call), and the worst case for
candidate filtering, one token repeated (every position is a candidate). Prints the best of
`--repeats` timings per case; the figures the unit tests used to assert (8 lookups over 32K
tokens well under 0.5 s, the worst case under 0.1 s) are the 32768 row.

    python bench/ngram_lookup.py [--lengths 4096,32768,131072] [--repeats 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from specstream.sampling_params import SamplingParams
from specstream.spec import NgramProposer, ProposeRequest, ngram_lookup

BATCH = 8


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of `repeats` calls, in milliseconds (the first call is a warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def measure(length: int, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32_000, (length,), generator=gen).tolist()
    at = length // 4
    tokens[-4:] = tokens[at : at + 4]  # the suffix occurred once before: drafts follow it
    proposer = NgramProposer(min_n=1, max_n=4)
    requests = [ProposeRequest(str(i), tokens, 5, SamplingParams()) for i in range(BATCH)]
    proposals = proposer.propose(requests)
    assert all(p.token_ids == tokens[at + 4 : at + 9] for p in proposals)  # timing the right thing
    repeated = [7] * length
    assert ngram_lookup(repeated, 4) == [7]
    batch_ms = best_ms(lambda: proposer.propose(requests), repeats)
    return {"history_tokens": length, "batch": BATCH, "batch_ms": batch_ms,
            "per_lookup_ms": batch_ms / BATCH,
            "repeated_token_ms": best_ms(lambda: ngram_lookup(repeated, 4), repeats)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,32768,131072",
                    help="history lengths in tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per case (best kept)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",") if n]
    if min(lengths) < 64:
        ap.error("history lengths start at 64 tokens")
    rows = [measure(n, args.repeats) for n in lengths]
    print(f"{'history':>9} {f'{BATCH} lookups ms':>15} {'per lookup ms':>14} "
          f"{'one token repeated ms':>22}")
    for r in rows:
        print(f"{r['history_tokens']:>9} {r['batch_ms']:>15.3f} {r['per_lookup_ms']:>14.3f} "
              f"{r['repeated_token_ms']:>22.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
