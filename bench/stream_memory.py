"""Device memory of streamed vs whole-layer-restore attention as the history grows.

Runs the engine in `stream` mode (chunks through a fixed staging ring) and `offload` mode
(whole-layer restore) on a small random Qwen3 model built on the fly, with histories from 4K to
64K tokens, and prints the device KV peak: fixed for `stream`, growing for `offload`.

    python bench/stream_memory.py [--max-context 65536] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from specstream import LLM, SamplingParams


def make_model(folder: str) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128,
                      max_position_embeddings=131072)
    Qwen3ForCausalLM(cfg).save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-context", type=int, default=65536)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="specstream-mem-")
    make_model(folder)
    token_bytes = 4 * 2 * 2 * 16 * 4  # layers x kv heads x dims x (K,V) x fp32
    rows = []
    ctx = 4096
    print(f"{'history':>8} {'mode':>8} {'device KV peak MB':>18} {'host KV peak MB':>16} "
          f"{'history MB':>11} {'s/decode token':>15}")
    while ctx <= args.max_context:
        prompt = torch.randint(0, 256, (ctx,), generator=torch.Generator().manual_seed(ctx))
        for mode in ("stream", "offload"):
            llm = LLM(folder, mode=mode, device_kv_bytes=64 << 20, block_size=128,
                      chunk_tokens=2048, resident_tail_tokens=512, offload_after_tokens=1024,
                      max_prefill_tokens=2048)
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            try:
                llm.generate([prompt.tolist()], params, use_tqdm=False)
            except ValueError as exc:  # the whole-layer restore no longer fits the budget
                print(f"{ctx:>8} {mode:>8}  refused: {exc}", flush=True)
                rows.append({"history": ctx, "mode": mode, "refused": str(exc)})
                llm.close()
                continue
            m = llm.get_metrics()
            t = m["decode_time_s"] / max(1, m["decode_steps"])
            row = {"history": ctx, "mode": mode, "device_kv_peak_bytes": m["device_kv_peak_bytes"],
                   "host_kv_peak_bytes": m["host_kv_peak_bytes"],
                   "history_bytes": ctx * token_bytes, "s_per_decode_step": t}
            rows.append(row)
            print(f"{ctx:>8} {mode:>8} {row['device_kv_peak_bytes'] / 1e6:>18.2f} "
                  f"{row['host_kv_peak_bytes'] / 1e6:>16.2f} {row['history_bytes'] / 1e6:>11.2f} "
                  f"{t:>15.4f}", flush=True)
            llm.close()
        ctx *= 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python bench/stream_memory.py", "rows": rows,
                       "time": time.time()}, f, indent=1)


if __name__ == "__main__":
    main()
