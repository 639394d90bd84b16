"""The decoder against transformers on random weights: logits, rope scaling, InternLM2, engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    hf_logits,
    llama_to_internlm2,
    make_hf_checkpoint,
    our_logits,
    random_ids,
)
from safetensors.torch import load_file

from specstream.models.config import ModelConfig, RopeConfig
from specstream.models.loader import load_model
from specstream.models.rope import compute_inv_freq

ATOL = 1e-4

# (family, overrides): every attention variant the decoder has a switch for.
VARIANTS = {
    "qwen3-gqa": ("qwen3", {}),
    "qwen3-mha-tied": ("qwen3", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "qwen2-gqa": ("qwen2", {}),
    "qwen2-mha-tied": ("qwen2", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama-gqa": ("llama", {}),
    "llama-bias-mha": ("llama", {"num_key_value_heads": 4, "attention_bias": True}),
    "llama-mlp-bias-mqa-tied": (
        "llama", {"num_key_value_heads": 1, "mlp_bias": True, "tie_word_embeddings": True},
    ),
}


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= atol, f"max abs logit diff {diff:.3g} > {atol}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tmp_path: Path, variant: str) -> None:
    family, overrides = VARIANTS[variant]
    folder, hf = make_hf_checkpoint(tmp_path, family, **overrides)
    model = load_model(folder, dtype="float32")
    cfg = model.config
    assert cfg.num_kv_heads == overrides.get("num_key_value_heads", 2)
    assert cfg.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = random_ids(40, cfg.vocab_size, seed=1)
    ref = hf_logits(hf, ids)
    assert ref.std() > 0.5  # random weights are not degenerate: a bug would show
    assert_logits_close(our_logits(model, ids), ref)


# ---- InternLM2 ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bias,dynamic", [(False, False), (True, False), (False, True)],
    ids=["nobias", "bias", "nobias-dynamic-ntk"],
)
def test_internlm2_layout_matches_llama(tmp_path: Path, bias: bool, dynamic: bool) -> None:
    # InternLM2.5 ships dynamic NTK rope ({"type": "dynamic"}); 70 tokens > 48 positions.
    rope = {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}
    src, hf = make_hf_checkpoint(
        tmp_path, "llama", attention_bias=bias, num_attention_heads=8,
        **({"max_position_embeddings": 48, **rope} if dynamic else {}),
    )
    dst = llama_to_internlm2(src, tmp_path / "internlm2")
    raw = json.loads((dst / "config.json").read_text())
    assert "model.layers.0.attention.wqkv.weight" in load_file(str(dst / "model.safetensors"))
    assert raw["rope_scaling"] == ({"type": "dynamic", "factor": 2.0} if dynamic else None)
    model = load_model(dst, dtype="float32")
    assert model.config.family == "internlm2"
    assert model.config.qkv_bias == bias and model.config.o_bias == bias
    ids = random_ids(70 if dynamic else 33, model.config.vocab_size, seed=2)
    ours = our_logits(model, ids)
    assert_logits_close(ours, our_logits(load_model(src, dtype="float32"), ids), atol=1e-5)
    assert_logits_close(ours, hf_logits(hf, ids))


# ---- RoPE scaling ---------------------------------------------------------------------------

ROPE_PARAMS: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0,
    },
}


@pytest.mark.parametrize("kind", list(ROPE_PARAMS))
def test_inv_freq_matches_transformers(kind: str) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**ROPE_PARAMS[kind], "rope_theta": 50000.0}
    hf_cfg = LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=256,
        rope_parameters=dict(params),
    )
    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    assert cfg.rope.rope_type == kind
    seq_lens = [None, 1000] if kind == "dynamic" else [None]
    for seq_len in seq_lens:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu", seq_len=seq_len)
        ours, scale = compute_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings,
                                       seq_len)
        torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
        assert scale == pytest.approx(ref_scale)
    default = compute_inv_freq(RopeConfig(theta=50000.0), 64, 256)[0]
    assert not torch.allclose(ours, default)  # the scaling did something


@pytest.mark.parametrize("kind", list(ROPE_PARAMS))
def test_scaled_rope_logits_match_transformers(tmp_path: Path, kind: str) -> None:
    # max_position_embeddings 48 < sequence 80: dynamic NTK rescales in this single forward.
    params = {**ROPE_PARAMS[kind], "rope_theta": 10000.0}
    if "original_max_position_embeddings" in params:
        params["original_max_position_embeddings"] = 24
    folder, hf = make_hf_checkpoint(
        tmp_path, "llama", max_position_embeddings=48, rope_parameters=params
    )
    model = load_model(folder, dtype="float32")
    assert model.config.rope.rope_type == kind
    ids = random_ids(80, model.config.vocab_size, seed=3)
    assert_logits_close(our_logits(model, ids), hf_logits(hf, ids))


@pytest.mark.parametrize("kind", list(ROPE_PARAMS))
def test_rope_config_dialects_agree(kind: str) -> None:
    base = dict(
        model_type="llama", vocab_size=32, hidden_size=64, num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=64, max_position_embeddings=256,
    )
    params = dict(ROPE_PARAMS[kind])
    old_scaling = {("type" if k == "rope_type" else k): v for k, v in params.items()}
    old = ModelConfig.from_dict({**base, "rope_theta": 123456.0, "rope_scaling": old_scaling})
    new = ModelConfig.from_dict({**base, "rope_parameters": {**params, "rope_theta": 123456.0}})
    assert old.rope == new.rope
    assert new.rope.theta == 123456.0 and new.rope.rope_type == kind
    assert new.rope.factor == params["factor"]
    assert old == new


def test_rope_config_default_dialects_agree() -> None:
    base = dict(
        model_type="qwen3", vocab_size=32, hidden_size=64, num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=64, max_position_embeddings=256,
    )
    old = ModelConfig.from_dict({**base, "rope_theta": 1e6, "rope_scaling": None})
    new = ModelConfig.from_dict(
        {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    )
    assert old.rope == new.rope == RopeConfig(theta=1e6)


def test_unsupported_rope_type_is_named() -> None:
    from specstream.models.config import ModelConfigError

    raw = dict(
        model_type="llama", vocab_size=32, hidden_size=64, num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4},
    )
    with pytest.raises(ModelConfigError, match="longrope"):
        ModelConfig.from_dict(raw)


# ---- dtypes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "bfloat16", "float16"])
def test_half_dtypes_close_to_fp32(tmp_path: Path, dtype: Any) -> None:
    folder, _ = make_hf_checkpoint(tmp_path, "qwen3")
    ref_model = load_model(folder, dtype="float32")
    model = load_model(folder, dtype=dtype)
    want = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    assert all(p.dtype == want for p in model.parameters())
    ids = random_ids(24, model.config.vocab_size, seed=4)
    ref = our_logits(ref_model, ids)
    ours = our_logits(model, ids)
    assert ours.dtype == torch.float32
    rel = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert rel < 0.05, f"{dtype}: relative logit error {rel:.3g}"
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9


# ---- through the engine: paged KV, chunked prefill, batching ----------------------------------


def _llm(folder: Path) -> Any:
    from specstream import LLM

    return LLM(str(folder), mode="resident", device_kv_bytes=1 << 24, block_size=16,
               max_prefill_tokens=64)


def _greedy(llm: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from specstream import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _record_logits(llm: Any) -> list[torch.Tensor]:
    """Capture every logits tensor the engine's model computes."""
    model = llm.engine.model
    rows: list[torch.Tensor] = []
    compute = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        out = compute(hidden)
        rows.append(out.detach().float().cpu())
        return out

    model.compute_logits = recording
    return rows


def _assert_teacher_forced_greedy(hf: Any, prompt: list[int], gen: list[int]) -> None:
    """Each generated token is transformers' argmax given the same prefix (up to 1e-4)."""
    logits = hf_logits(hf, prompt + gen)  # [len(prompt) + len(gen), V]
    for i, tok in enumerate(gen):
        row = logits[len(prompt) - 1 + i]
        top = row.max().item()
        assert row[tok].item() >= top - ATOL, (
            f"step {i}: engine chose {tok} ({row[tok].item():.5f}), "
            f"transformers' argmax {row.argmax().item()} ({top:.5f})"
        )


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_engine_batch_unequal_lengths_chunked_prefill(tmp_path: Path, family: str) -> None:
    # 150 and 100 tokens span three and two prefill chunks of 64; blocks of 16 are partly filled.
    folder, hf = make_hf_checkpoint(tmp_path, family)
    vocab = hf.config.vocab_size
    prompts = [random_ids(n, vocab, seed=10 + n) for n in (150, 5, 100, 37)]
    llm = _llm(folder)
    rows = _record_logits(llm)
    batched = _greedy(llm, prompts, 12)
    reference = []
    for prompt, gen in zip(prompts, batched):
        assert len(gen) == 12
        _assert_teacher_forced_greedy(hf, prompt, gen)
        reference.append(hf_logits(hf, prompt + gen)[len(prompt) - 1:])
    # Every logits row the engine computed is one of transformers' rows at the same position
    # (random rows differ by O(1), so a 1e-4 match pins the request and the position).
    ref = torch.cat(reference)  # [sum of (len(gen) + 1), V]
    engine_rows = torch.cat(rows)
    assert engine_rows.shape[0] >= sum(len(g) for g in batched)
    nearest = torch.cdist(engine_rows, ref, p=float("inf")).min(dim=1).values
    assert nearest.max().item() <= ATOL, f"engine logits off by {nearest.max().item():.3g}"
    assert _greedy(llm, [prompts[0]], 12) == [batched[0]]  # alone == in the batch


def test_engine_greedy_equals_transformers_generate(tmp_path: Path) -> None:
    folder, hf = make_hf_checkpoint(tmp_path, "qwen3", seed=5)
    vocab = hf.config.vocab_size
    prompts = [random_ids(n, vocab, seed=20 + n) for n in (70, 9, 23)]
    n_new = 16
    expected = []
    for p in prompts:
        out = hf.generate(
            torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
            do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=0,
        )
        expected.append(out[0, len(p):].tolist())
    llm = _llm(folder)
    assert _greedy(llm, [prompts[0]], n_new) == [expected[0]]  # alone
    assert _greedy(llm, prompts, n_new) == expected  # in a batch of mixed lengths
    assert len({tuple(e) for e in expected}) == len(expected)  # not a degenerate constant output
