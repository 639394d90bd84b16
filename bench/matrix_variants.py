"""A matrix cell's default against variants of it (EngineConfig fields changed), alternating
in one process: what a lever the default lacks would give, before it is built.

    PYTHONPATH=. python bench/matrix_variants.py --cells c11,c03 \\
        --variant tail128:resident_tail_tokens=128 --variant tail256:resident_tail_tokens=256

Per run: output tok/s, decode-only tok/s, requests at once, mean accepted tokens a round,
history MB a round, and a hash of the greedy outputs (every variant must give the default's).
Values parse as Python literals (``128``, ``"off"``, ``None``)."""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
from typing import Any


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``name:field=value,field=value`` -> (name, {field: value})."""
    name, _, body = text.partition(":")
    if not name or not body:
        raise ValueError(f"--variant {text!r}: expected NAME:FIELD=VALUE[,FIELD=VALUE]")
    fields = {}
    for item in body.split(","):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--variant {text!r}: {item!r} is not FIELD=VALUE")
        try:
            fields[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            fields[key.strip()] = value.strip()
    return name, fields


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", required=True)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args(argv)
    variants = [("default", {})] + [parse_variant(v) for v in args.variant]
    from bench import matrix as m  # the checkout's (PYTHONPATH=.)

    cells = {c.name: c for c in m.DESIGN}
    unknown = [n for n in args.cells.split(",") if n not in cells]
    if unknown:
        ap.error(f"no cell {', '.join(unknown)}; the matrix's cells: {', '.join(cells)}")
    for name in args.cells.split(","):
        cell = cells[name]
        work, _, budget, prompts = m.cell_inputs(cell, args.output_len)
        base = m.configs(budget, cell.link_gbps, ())["default"]
        for rep in range(args.repeats):
            for label, extra in variants:
                res, tokens, _ = m.run_one({**base, **extra}, work, prompts, cell.link_gbps)
                sha = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:12]
                print(f"{name} {label} run {rep + 1}: {res['output_tokens_per_s']:.1f} tok/s, "
                      f"decode-only {res['decode_only_tokens_per_s']:.1f}, "
                      f"{res['max_concurrency']} at once, accepted "
                      f"{res['mean_accepted_len']:.2f}, "
                      f"{res['link_bytes_per_round'] / 1e6:.1f} MB a round, outputs {sha}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
