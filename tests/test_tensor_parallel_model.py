"""The decoder sharded over two gloo ranks (issue 33, the model part): every rank's logits
equal the unsharded model's within 1e-4 in fp32, for the four families (Qwen3 with q/k norms,
Qwen2 with q/k/v biases, Llama, InternLM2's fused wqkv), with KV heads split and with a KV head
replicated (fewer KV heads than ranks); each rank holds its share of the weights and KV heads;
shapes that do not split are refused with what does not split."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import llama_to_internlm2, make_hf_checkpoint, our_logits, random_ids

from specstream.engine.exec.ranks import leave_cleanly
from specstream.models.config import ModelConfig
from specstream.models.loader import load_model
from specstream.models.tensor_parallel import Shard, check_shardable, rank_config

TP = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, folder: str, ids: list[int], port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    try:
        model = load_model(folder, torch.float32, "cpu", shard=Shard(rank, TP))
        params = sum(p.numel() for p in model.parameters())
        torch.save({"logits": our_logits(model, ids), "params": params,
                    "kv_heads": model.config.num_kv_heads}, f"{out}.{rank}")
        # both ranks done before either tears its group down: a rank destroying the group
        # while the other's gloo threads still talk to it aborted one of them, now and then
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_cleanly()  # as the engine's ranks do


def _sharded(folder: Path, ids: list[int], tmp_path: Path) -> list[dict[str, Any]]:
    out = str(tmp_path / "rank")
    mp.start_processes(_rank, args=(str(folder), ids, _free_port(), out), nprocs=TP,
                       start_method="spawn", join=True)
    return [torch.load(f"{out}.{r}") for r in range(TP)]


CASES = {
    "qwen3": ("qwen3", {}),
    "qwen2-bias": ("qwen2", {}),
    "llama": ("llama", {}),
    "qwen3-one-kv-head": ("qwen3", {"num_key_value_heads": 1}),
}


@pytest.mark.parametrize("case", [*CASES, "internlm2"])
def test_two_ranks_equal_one(tmp_path: Path, case: str) -> None:
    family, overrides = CASES.get(case, ("llama", {}))
    folder, _ = make_hf_checkpoint(tmp_path, family, **overrides)
    if case == "internlm2":
        folder = llama_to_internlm2(folder, tmp_path / "internlm2")
    full = load_model(folder, torch.float32, "cpu")
    ids = random_ids(24, full.config.vocab_size, seed=3)
    want = our_logits(full, ids)
    ranks = _sharded(folder, ids, tmp_path)
    kv = full.config.num_kv_heads
    for got in ranks:
        assert (got["logits"] - want).abs().max().item() <= 1e-4
        assert got["kv_heads"] == max(1, kv // TP)
    # each rank holds the replicated embeddings, norms and head, and half of every layer
    layers = sum(p.numel() for n, p in full.named_parameters() if ".layers." in n)
    replicated = sum(p.numel() for p in full.parameters()) - layers
    kv_params = sum(p.numel() for n, p in full.named_parameters()
                    if ".k_proj." in n or ".v_proj." in n)
    extra_kv = kv_params // 2 if kv < TP else 0  # a replicated KV head is held by both ranks
    norms = sum(p.numel() for n, p in full.named_parameters() if ".layers." in n and "norm" in n)
    biases = sum(p.numel() for n, p in full.named_parameters()
                 if n.endswith(("o_proj.bias", "down_proj.bias")))
    for got in ranks:
        assert got["params"] == replicated + (layers - norms - biases) // TP + norms + biases \
            + extra_kv


def test_shapes_that_do_not_split() -> None:
    cfg = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64,
                                 "hidden_size": 48, "num_hidden_layers": 1,
                                 "num_attention_heads": 6, "num_key_value_heads": 3,
                                 "head_dim": 8, "intermediate_size": 96,
                                 "max_position_embeddings": 64})
    with pytest.raises(ValueError, match="attention heads"):
        check_shardable(cfg, 4)
    with pytest.raises(ValueError, match="KV heads"):
        check_shardable(cfg, 2)
    assert rank_config(cfg, 3).num_heads == 2 and rank_config(cfg, 3).num_kv_heads == 1
    assert rank_config(cfg, 6).num_kv_heads == 1  # replicated: 3 heads over 6 ranks
    with pytest.raises(ValueError, match="rank 2"):
        Shard(2, 2)
