"""The round-shape policy's decisions in one run of a matrix cell's default, one line each.

    PYTHONPATH=. python bench/policy_trace.py --cell c01 [--output-len 32] [--decisions 45]

Wraps ``RoundShaper.shape`` for the run and prints, per decision: the requests a round
verifies, the catch-up share it was handed (unseen tokens over tokens left, summed over the
requests, per group), their history tokens, the shape picked (depth, top-k, nodes), the
verification fit (fixed ms, ms per query position, ms per request), the catch-up charge per
token a request gets (ms), a draft level's fixed ms, the link ms, whether it probed, the
first candidate's acceptance (pooled over depths) and the draft's catch-up time a token (ms). The
first line is the run's tok/s and mean accepted tokens a round."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cell", default="c01")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--decisions", type=int, default=45, help="lines printed at most")
    args = ap.parse_args(argv)

    spec = importlib.util.spec_from_file_location("matrix", HERE / "matrix.py")
    assert spec is not None and spec.loader is not None
    matrix = importlib.util.module_from_spec(spec)
    sys.modules["matrix"] = matrix
    spec.loader.exec_module(matrix)
    from specstream.engine.policy import shaping

    cells = {c.name: c for c in matrix.DESIGN}
    if args.cell not in cells:
        ap.error(f"no cell {args.cell!r}; the matrix's cells: {', '.join(cells)}")
    cell = cells[args.cell]
    work, _, budget, prompts = matrix.cell_inputs(cell, args.output_len)

    original = shaping.RoundShaper.shape
    lines: list[tuple[Any, ...]] = []

    def shape(self: Any, num_requests: int, catch_up: float = 0.0, **kw: Any) -> Any:
        pick = original(self, num_requests, catch_up=catch_up, **kw)
        c = self.costs(catch_up)
        lines.append((num_requests, round(catch_up, 2), kw.get("history_tokens"),
                      (pick.depth, pick.topk, pick.num_nodes), round(c.verify_base_s * 1e3, 1),
                      round(c.verify_per_position_s * 1e3, 3),
                      round(c.verify_per_request_s * 1e3, 2), round(c.draft_setup_s * 1e3, 2),
                      round(c.draft_level_s * 1e3, 2), round(c.link_s * 1e3, 1), self.probing,
                      round(self.acceptance.pooled(0), 3), round(self.catch_up.token_s * 1e3, 4)))
        return pick

    shaping.RoundShaper.shape = shape  # type: ignore[method-assign]
    try:
        kwargs = matrix.configs(budget, cell.link_gbps, ())["default"]
        res, _, _ = matrix.run_one(kwargs, work, prompts, cell.link_gbps)
    finally:
        shaping.RoundShaper.shape = original  # type: ignore[method-assign]
    print(f"{cell.name}: {res['output_tokens_per_s']:.2f} tok/s, "
          f"accepted {res['mean_accepted_len']:.2f} a round")
    print("# (requests, catch-up share, history tokens, (depth, topk, nodes), verify ms fixed, "
          "ms/position, ms/request, catch-up ms per token, draft level ms, link ms, probing, "
          "acceptance a token, catch-up ms a token)")
    for i, line in enumerate(lines[: args.decisions]):
        print(i, line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
