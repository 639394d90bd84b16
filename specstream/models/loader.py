"""Load HF checkpoints from a local folder: config, single or sharded safetensors, dtype.

InternLM2 checkpoints are renamed and their fused, grouped ``wqkv`` split into q/k/v here, so the
decoder has one layout. Errors name the folder, the tensor and the shapes involved.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from specstream.models.config import ModelConfig
from specstream.models.decoder import CausalLM
from specstream.models.tensor_parallel import Shard, parallelize, rank_config, shard_tensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match its config."""


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of {list(DTYPES)}")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use 'auto' or one of {list(DTYPES)}")
    return DTYPES[dtype]


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards named in the index are missing: {missing}")
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise FileNotFoundError(
            f"model folder {folder} has only PyTorch .bin/.pt weights; this engine reads "
            "safetensors (convert with save_pretrained(..., safe_serialization=True))"
        )
    raise FileNotFoundError(f"no *.safetensors weights in model folder {folder}")


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in _weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


_INTERNLM2_RENAMES = [
    (r"^model\.tok_embeddings\.", "model.embed_tokens."),
    (r"\.attention\.wo\.", ".self_attn.o_proj."),
    (r"\.feed_forward\.w1\.", ".mlp.gate_proj."),
    (r"\.feed_forward\.w3\.", ".mlp.up_proj."),
    (r"\.feed_forward\.w2\.", ".mlp.down_proj."),
    (r"\.attention_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"^output\.", "lm_head."),
]


def internlm2_to_decoder(
    name: str, tensor: torch.Tensor, cfg: ModelConfig
) -> list[tuple[str, torch.Tensor]]:
    """Map one InternLM2 tensor to decoder names; ``wqkv`` becomes three tensors.

    wqkv rows are grouped per kv head: the q rows of the group, then its k rows, then its v rows.
    """
    if ".attention.wqkv." in name:
        group, d = cfg.group_size, cfg.head_dim
        expected = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
        if tensor.shape[0] != expected:
            raise CheckpointError(
                f"tensor {name} has shape {tuple(tensor.shape)}, expected first dim {expected}"
            )
        grouped = tensor.reshape(cfg.num_kv_heads, group + 2, d, *tensor.shape[1:])
        q = grouped[:, :group].reshape(cfg.num_heads * d, *tensor.shape[1:])
        k = grouped[:, group].reshape(cfg.num_kv_heads * d, *tensor.shape[1:])
        v = grouped[:, group + 1].reshape(cfg.num_kv_heads * d, *tensor.shape[1:])
        prefix, suffix = name.split(".attention.wqkv.")
        return [
            (f"{prefix}.self_attn.{p}_proj.{suffix}", t) for p, t in (("q", q), ("k", k), ("v", v))
        ]
    for pattern, repl in _INTERNLM2_RENAMES:
        name = re.sub(pattern, repl, name)
    return [(name, tensor)]


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    """An uninitialised model (weights to be loaded or filled by the caller)."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    # Cast on meta first: allocating fp32 and then converting would need 1.5x the memory.
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def load_model(
    folder: str | Path, dtype: str | torch.dtype = "auto", device: str = "cpu",
    shard: Shard | None = None,
) -> CausalLM:
    """Load a HF checkpoint folder into the decoder. Raises with the problem named. With
    ``shard``, only that tensor-parallel rank's part (``models.tensor_parallel``), each tensor
    cut to it as it is read; the model's config is then the rank's (its heads, its KV heads,
    its slice of the MLP)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    cfg = ModelConfig.from_dir(folder)
    torch_dtype = resolve_dtype(dtype, device)
    _weight_files(folder)  # fail on missing weights before allocating anything
    shard = shard or Shard(0, 1)
    model = build_model(rank_config(cfg, shard.size), torch_dtype, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for raw_name, raw_tensor in iter_checkpoint(folder):
        if raw_name.endswith("rotary_emb.inv_freq"):
            continue
        pairs = (
            internlm2_to_decoder(raw_name, raw_tensor, cfg)
            if cfg.family == "internlm2"
            else [(raw_name, raw_tensor)]
        )
        for name, tensor in pairs:
            tensor = shard_tensor(name, tensor, cfg, shard)
            if name not in params:
                raise CheckpointError(f"{folder}: unexpected tensor {raw_name} in the checkpoint")
            target = params[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"{folder}: tensor {raw_name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)} from config.json"
                )
            target.data.copy_(tensor.to(target.dtype))
            loaded.add(name)
    tied = {"lm_head.weight", "model.embed_tokens.weight"}
    if cfg.tie_word_embeddings and loaded & tied:
        loaded |= tied
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"{folder}: checkpoint is missing {len(missing)} tensor(s): {shown}")
    parallelize(model, shard)
    return model.fuse()
