"""One-shot GPU check, step by step; `bench/gpu_check.sh` runs the steps under time limits.

Each step merges its section into one JSON file (`--out`) as soon as it has something, so a
step killed by its time limit leaves what it measured:

- `env`: versions and device;
- `bandwidth`: pinned host-to-device (and device-to-host) bandwidth of large torch copies, timed
  with CUDA events (one copy at a time, and back to back), plus the transfer backend's `h2d` at
  the engine's copy sizes (per-copy issue cost included);
- `exactness`: streamed attention (torch path and Triton kernel) vs full attention, fp32 and bf16;
- `modes`: greedy token ids of every engine mode in fp32 (they must be identical);
- `mechanics`: an 8B-shaped Qwen3 target (random bf16 weights) and a 0.6B-shaped draft at 16K-32K
  contexts under a device KV budget that forces offloading: decode throughput per mode, link GB/s
  and utilisation during decode, and round time over its floor, each mode with the engine's own
  attention (`attention_backend`: Triton, and `specstream+torch` for comparison);
- `summary`: a table of everything, and the pass/fail of the issue's targets.

The steps live in `bench/gpu_check_steps/` (`device.py`: env and bandwidth; `exactness.py`;
`modes.py`; `mechanics.py`; `results.py`: the JSON file, attach, mark and the summary); this file
is the command line that `bench/gpu_check.sh` calls once per step.

`--device cpu --tiny` runs the same code paths on the CPU with tiny shapes (a dry run).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from gpu_check_steps.device import step_bandwidth, step_env
from gpu_check_steps.exactness import step_exactness
from gpu_check_steps.mechanics import run_mechanics
from gpu_check_steps.modes import step_modes
from gpu_check_steps.results import print_summary, step_attach, step_mark, update

STEPS = {"env": step_env, "bandwidth": step_bandwidth, "exactness": step_exactness,
         "modes": step_modes, "mechanics": run_mechanics, "mark": step_mark,
         "attach": step_attach}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=[*STEPS, "summary"])
    p.add_argument("target", nargs="?", help="for mark/attach: the section to write")
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu-check.json"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU dry run)")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--rc", type=int, default=1, help="mark/attach: the exit status seen")
    p.add_argument("--file", type=Path, default=None, help="attach: the JSON file to store")
    p.add_argument("--budget-s", type=float, default=200.0, help="mechanics: time for all modes")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/specstream-gpu-check"))
    p.add_argument("--modes", default="specstream,resident,offload,specstream+torch,"
                                      "offload-spec,resident-ar,stream",
                   help="mechanics: modes in run order (resident-ar: no speculation; a +torch "
                        "or +triton suffix: that attention backend for this mode)")
    p.add_argument("--attention-backend", default="triton", choices=["auto", "torch", "triton"],
                   help="mechanics: the engine's attention_backend for modes without a suffix")
    args = p.parse_args(argv)
    if args.step == "summary":
        return print_summary(args.out)
    section = args.target if args.step in ("mark", "attach") else args.step
    t0 = time.perf_counter()
    try:
        value = STEPS[args.step](args)
        value.setdefault("status", "ok")
    except Exception as exc:  # a failed step must not stop the others: record it and go on
        traceback.print_exc()
        value = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    if args.step not in ("mark", "attach"):
        value["seconds"] = round(time.perf_counter() - t0, 2)
    update(args.out, section, value)
    print(f"[gpu_check] {section}: {value.get('status')} in {value.get('seconds', '-')} s")
    return 0 if value["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
