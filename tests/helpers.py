"""Small random HuggingFace checkpoints for tests, built in a tmp folder.

Weights use a large ``initializer_range`` and perturbed norms and biases, so greedy margins are
not near-ties and every parameter (bias, q/k norm) changes the logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specstream.attention import causal_mask, full_attention

BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def hf_config(family: str = "qwen3", **overrides: Any) -> Any:
    """A transformers config for ``family`` ("qwen3", "qwen2" or "llama")."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}
    kwargs = {**BASE_CONFIG, **overrides}
    if family == "qwen3":
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    return classes[family](**kwargs)


def make_hf_model(family: str = "qwen3", seed: int = 0, **overrides: Any) -> Any:
    """A random fp32 transformers model in eval mode (eager attention, the plain reference)."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # RMSNorm weights start at 1; make them matter
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):  # biases start at 0
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model.float().eval()


def make_hf_checkpoint(
    tmp_path: Path, family: str = "qwen3", name: str | None = None, seed: int = 0,
    max_shard_size: str | None = None, **overrides: Any,
) -> tuple[Path, Any]:
    """Save a random model as a HF folder (config.json + safetensors); returns (folder, model)."""
    model = make_hf_model(family, seed=seed, **overrides)
    folder = Path(tmp_path) / (name or f"{family}-{seed}")
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder, model


def llama_to_internlm2(src: Path, dst: Path) -> Path:
    """Rewrite a Llama checkpoint folder into the InternLM2 layout (fused, grouped ``wqkv``)."""
    raw = json.loads((Path(src) / "config.json").read_text())
    heads, kv = raw["num_attention_heads"], raw["num_key_value_heads"]
    d = raw.get("head_dim") or raw["hidden_size"] // heads
    group = heads // kv
    bias = bool(raw.get("attention_bias", False))
    if raw.get("mlp_bias"):
        raise ValueError("InternLM2 has no MLP bias")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(src).glob("*.safetensors")):  # single file or shards
        tensors.update(load_file(str(shard)))
    if raw.get("tie_word_embeddings") and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    out: dict[str, torch.Tensor] = {}
    renames = [
        ("model.embed_tokens.", "model.tok_embeddings."),
        (".self_attn.o_proj.", ".attention.wo."),
        (".mlp.gate_proj.", ".feed_forward.w1."),
        (".mlp.up_proj.", ".feed_forward.w3."),
        (".mlp.down_proj.", ".feed_forward.w2."),
        (".input_layernorm.", ".attention_norm."),
        (".post_attention_layernorm.", ".ffn_norm."),
        ("lm_head.", "output."),
    ]
    for name, t in tensors.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            k = tensors[name.replace("q_proj", "k_proj")]
            v = tensors[name.replace("q_proj", "v_proj")]
            rest = t.shape[1:]
            fused = torch.cat(
                [
                    t.reshape(kv, group, d, *rest),
                    k.reshape(kv, 1, d, *rest),
                    v.reshape(kv, 1, d, *rest),
                ],
                dim=1,
            ).reshape((heads + 2 * kv) * d, *rest)
            out[name.replace(".self_attn.q_proj.", ".attention.wqkv.")] = fused.contiguous()
            continue
        for old, new in renames:
            name = name.replace(old, new, 1)
        out[name] = t.contiguous()
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    config = {
        "architectures": ["InternLM2ForCausalLM"],
        "model_type": "internlm2",
        "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config"},
        "vocab_size": raw["vocab_size"],
        "hidden_size": raw["hidden_size"],
        "intermediate_size": raw["intermediate_size"],
        "num_hidden_layers": raw["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "max_position_embeddings": raw["max_position_embeddings"],
        "rms_norm_eps": raw["rms_norm_eps"],
        "bias": bias,
        "rope_theta": _rope_theta(raw),
        "rope_scaling": _rope_scaling(raw),
        "tie_word_embeddings": False,
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_id": raw.get("eos_token_id"),
        "torch_dtype": "float32",
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    """The older ``rope_scaling`` form InternLM2 configs use ({"type": "dynamic", ...})."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    kind = params.pop("rope_type", params.pop("type", "default"))
    params.pop("rope_theta", None)
    return None if kind == "default" else {"type": kind, **params}


class FullAttentionContext:
    """Attention over one sequence given whole in one forward (no KV cache)."""

    def __init__(self, head_dim: int) -> None:
        self.scale = head_dim**-0.5

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KV, D] -> [T, H, D]
        n = q.shape[0]
        return full_attention(q, k, v, self.scale, causal_mask(n, n, device=q.device))


@torch.no_grad()
def our_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, vocab] of our decoder over one sequence, positions 0..T-1."""
    input_ids = torch.tensor(ids, dtype=torch.long)
    positions = torch.arange(len(ids))
    hidden = model(input_ids, positions, FullAttentionContext(model.config.head_dim))
    return model.compute_logits(hidden).float()


@torch.no_grad()
def hf_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, vocab] of the transformers model over one sequence."""
    out = hf_model(torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].float()


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    """Token ids avoiding the special ids 0..2."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def reads_per_round(engine: Any, monkeypatch: Any, counts: Any, max_steps: int = 200) -> list[int]:
    """Run ``engine`` to the end counting reads of tensor values (.tolist/.item/.cpu/int()/
    bool()/...) inside each ``Worker.run``; returns the count of every round ``counts(plan)``
    selects."""
    reads: list[str] = []
    counted: list[int] = []
    real_run = engine.worker.run

    def run(plan: Any, *args: Any) -> Any:
        reads.clear()
        out = real_run(plan, *args)
        if counts(plan):
            counted.append(len(reads))
        return out

    for name in ("tolist", "item", "cpu", "__int__", "__bool__", "__index__", "numpy"):
        real = getattr(torch.Tensor, name)

        def spy(self: Any, *a: Any, _name: str = name, _real: Any = real, **k: Any) -> Any:
            reads.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    monkeypatch.setattr(engine.worker, "run", run)
    try:
        for _ in range(max_steps):
            if not engine.has_unfinished():
                break
            engine.step()
    finally:
        monkeypatch.undo()
    return counted


def capture_plans(eng, monkeypatch) -> list:  # type: ignore[no-untyped-def]
    """The plans the engine's scheduler hands out from now on, in order (a spy on
    ``schedule``)."""
    plans: list = []
    schedule = eng.scheduler.schedule

    def spy(*args):  # type: ignore[no-untyped-def]
        plans.append(schedule(*args))
        return plans[-1]

    monkeypatch.setattr(eng.scheduler, "schedule", spy)
    return plans
