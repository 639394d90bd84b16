"""Where a decode phase's time goes, per mode: calls and seconds of the round's main pieces.

    python bench/profile_decode_calls.py MODE [MODE ...]

The embedded pair, 4 requests x 4096-token prompts, 96 greedy tokens each, the bench's KV
settings at an emulated 4 GB/s (the compute-bound end of the sweep); prefill runs first and is
not counted. Functions are timed by wrapping them, so the figures include the wrappers' cost.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from typing import Any

import torch

import specstream.attention.waves as waves
import specstream.engine.exec.gap_filler as overlap
import specstream.engine.exec.restore as restore
import specstream.engine.exec.stream as stream
import specstream.engine.exec.worker as worker
import specstream.models.decoder as decoder
import specstream.spec.draft as draft
from specstream import LLM, SamplingParams

seconds: collections.Counter[str] = collections.Counter()
calls: collections.Counter[str] = collections.Counter()


def _wrap(owner: Any, name: str, key: str) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)
    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            seconds[key] += time.perf_counter() - t
            calls[key] += 1

    setattr(owner, name, timed)


def profile(mode: str, link_gbps: float) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (4096,), generator=g).tolist() for _ in range(4)]
    llm = LLM(mode=mode, device_kv_bytes=64 << 20, link_gbps=link_gbps, staging_buffers=2,
              wave_requests=2, resident_tail_tokens=256, offload_after_tokens=512,
              max_prefill_tokens=1024)
    eng = llm.engine
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=96, ignore_eos=True))
    while any(r.in_prefill for r in eng.scheduler.requests.values()):
        eng.step()
    seconds.clear()
    calls.clear()
    t0, n0, steps = time.perf_counter(), eng.stats.generated_tokens, 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    wall = time.perf_counter() - t0
    print(f"{mode}: decode {wall:.2f} s, {steps} steps, "
          f"{(eng.stats.generated_tokens - n0) / wall:.1f} tok/s")
    for key, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {key:12s} {s:7.2f} s {calls[key]:6d} calls {s / calls[key] * 1e3:8.3f} ms/call")
    llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modes", nargs="+")
    ap.add_argument("--link-gbps", type=float, default=4.0)
    args = ap.parse_args()
    for owner, name, key in (
        (waves.TorchWaves, "add", "attention"), (draft.DraftJob, "step", "draft_step"),
        (worker.Worker, "run", "step"), (decoder.DecoderLayer, "qkv", "layer_qkv"),
        (decoder.DecoderLayer, "finish", "layer_finish"), (stream.ChunkStream, "_fill", "copy"),
        (restore.LayerRestore, "_issue", "copy"), (overlap.GapFiller, "finish", "draft_tail"),
    ):
        _wrap(owner, name, key)
    for mode in args.modes:
        profile(mode, args.link_gbps)


if __name__ == "__main__":
    main()
