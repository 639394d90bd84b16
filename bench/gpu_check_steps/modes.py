"""`modes`: greedy token ids of every engine mode on the embedded pair (identical or not)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from .results import update


def step_modes(args: argparse.Namespace) -> dict[str, Any]:
    """Greedy token ids of every mode, fp32, on the embedded pair; all must be identical."""
    from specstream import LLM, SamplingParams
    from specstream.config import MODES
    from specstream.llm import default_model_dir
    from specstream.models.config import ModelConfig

    torch.backends.cuda.matmul.allow_tf32 = False
    target = default_model_dir("target")
    draft = default_model_dir("draft")
    draft = draft if (draft / "config.json").is_file() else target  # same vocabulary either way
    cfg = ModelConfig.from_dir(target)
    bs, chunk, after, tail = 16, 64, 64, 32
    lens = (300, 520) if args.tiny else (700, 1500)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
    layer_tok = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32
    block_bytes = bs * cfg.num_layers * layer_tok
    ctx = sum(lens) + 64
    budget = 2 * 48 * block_bytes + 8 * ctx * layer_tok  # fits tails, staging and restores
    # the whole history twice over, as a power of 2 (pinned memory on CUDA is allocated whole
    # and rounded up anyway): not the 8 GiB default, pinned again for every mode
    host_kv = 1 << (2 * ctx * cfg.num_layers * layer_tok).bit_length()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    res: dict[str, Any] = {"target": str(target), "draft": str(draft), "prompt_lens": lens,
                           "token_ids": {}, "metrics": {}}
    for mode in ("resident", "offload", "stream", "offload-spec", "specstream"):
        kv_bytes = budget if mode != "resident" else 4 * ctx * cfg.num_layers * layer_tok
        spec = MODES[mode].speculative  # offload and stream take no proposer
        llm = LLM(str(target), draft_model=str(draft) if spec else None, mode=mode,
                  device=args.device, dtype="float32", device_kv_bytes=kv_bytes,
                  host_kv_bytes=host_kv, block_size=bs,
                  chunk_tokens=chunk, resident_tail_tokens=tail, offload_after_tokens=after,
                  max_prefill_tokens=128, num_speculative_tokens=3 if spec else 0)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            m = llm.get_metrics()
        finally:
            llm.close()
        res["token_ids"][mode] = [o.outputs[0].token_ids for o in outs]
        res["metrics"][mode] = {k: m[k] for k in ("link_bytes_h2d", "mean_accepted_len")}
        update(args.out, "modes", res)
    first = res["token_ids"]["resident"]
    res["identical"] = all(ids == first for ids in res["token_ids"].values())
    res["offloaded"] = all(res["metrics"][m]["link_bytes_h2d"] > 0 for m in res["metrics"]
                           if m != "resident")
    res["passed"] = res["identical"] and res["offloaded"]
    return res

