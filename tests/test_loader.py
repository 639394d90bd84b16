"""Checkpoint loading: sharded safetensors, and clear errors that name what is wrong."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import hf_logits, make_hf_checkpoint, our_logits, random_ids
from safetensors.torch import load_file, save_file

from specstream.models.config import ModelConfig, ModelConfigError
from specstream.models.loader import CheckpointError, load_model


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    folder, _ = make_hf_checkpoint(tmp_path, "qwen3")
    return folder


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def test_sharded_safetensors(tmp_path: Path) -> None:
    folder, hf = make_hf_checkpoint(tmp_path, "llama", max_shard_size="50KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (folder / "model.safetensors").exists()
    model = load_model(folder, dtype="float32")
    ids = random_ids(30, model.config.vocab_size, seed=7)
    diff = (our_logits(model, ids) - hf_logits(hf, ids)).abs().max().item()
    assert diff <= 1e-4
    (folder / sorted(shards)[0]).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(sorted(shards)[0])):
        load_model(folder)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_missing_config(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(ckpt)


def test_invalid_config_json(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        load_model(ckpt)


def test_missing_weights(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no .*safetensors weights"):
        load_model(ckpt)
    (ckpt / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"only PyTorch \.bin"):
        load_model(ckpt)


def test_unknown_architecture(ckpt: Path) -> None:
    _edit_config(ckpt, model_type="gpt_bigcode", architectures=["GPTBigCodeForCausalLM"])
    with pytest.raises(ModelConfigError, match="unknown architecture.*gpt_bigcode"):
        load_model(ckpt)


def test_architecture_without_model_type(ckpt: Path) -> None:
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["model_type"]
    assert ModelConfig.from_dict(raw).family == "qwen3"  # from architectures


def test_config_missing_field_is_named(ckpt: Path) -> None:
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["hidden_size"]
    with pytest.raises(ModelConfigError, match="hidden_size"):
        ModelConfig.from_dict(raw)


def test_heads_not_multiple_of_kv_heads(ckpt: Path) -> None:
    _edit_config(ckpt, num_key_value_heads=3)
    with pytest.raises(ModelConfigError, match=r"num_attention_heads \(4\).*\(3\)"):
        load_model(ckpt)


def test_sliding_window_refused(tmp_path: Path) -> None:
    folder, _ = make_hf_checkpoint(tmp_path, "llama")
    _edit_config(folder, model_type="mistral", sliding_window=16)
    with pytest.raises(ModelConfigError, match="sliding"):
        load_model(folder)
    _edit_config(folder, sliding_window=None)  # Mistral v0.2+: full attention
    assert load_model(folder).config.family == "llama"


def test_tensor_missing_is_named(ckpt: Path) -> None:
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj"):
        load_model(ckpt)


def test_tensor_wrong_shape_is_named(ckpt: Path) -> None:
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.0.self_attn.k_proj.weight"
    assert tuple(tensors[name].shape) == (32, 64)
    tensors[name] = torch.zeros(48, 64)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert name in str(err.value)
    assert "(48, 64)" in str(err.value) and "(32, 64)" in str(err.value)


def test_unexpected_tensor_is_named(ckpt: Path) -> None:
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"self_attn\.extra\.weight"):
        load_model(ckpt)


def test_bad_dtype(ckpt: Path) -> None:
    with pytest.raises(ValueError, match="float64"):
        load_model(ckpt, dtype="float64")


def test_generation_config_eos_merged(ckpt: Path) -> None:
    assert ModelConfig.from_dir(ckpt).eos_token_ids == (2,)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelConfig.from_dir(ckpt).eos_token_ids == (2, 7)


def test_folder_without_tokenizer(ckpt: Path) -> None:
    from specstream import LLM, SamplingParams

    assert not (ckpt / "tokenizer.json").exists()
    llm = LLM(str(ckpt), mode="resident", device_kv_bytes=1 << 22, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("a string prompt", params, use_tqdm=False)


def test_internlm2_config_defaults() -> None:
    raw = dict(
        architectures=["InternLM2ForCausalLM"], vocab_size=32, hidden_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        rope_scaling={"type": "dynamic", "factor": 2.5}, rope_theta=1e6,
    )
    cfg = ModelConfig.from_dict(raw)
    assert cfg.family == "internlm2"
    assert cfg.qkv_bias and cfg.o_bias and not cfg.mlp_bias  # InternLM2Config: bias=True
    assert cfg.rope.rope_type == "dynamic" and cfg.rope.factor == 2.5 and cfg.rope.theta == 1e6
    assert not ModelConfig.from_dict({**raw, "bias": False}).qkv_bias


def test_partial_rotary_refused(ckpt: Path) -> None:
    _edit_config(ckpt, partial_rotary_factor=0.5)
    with pytest.raises(ModelConfigError, match="partial_rotary_factor"):
        load_model(ckpt)


@pytest.mark.parametrize(
    "rope,expected",
    [
        (None, 4096),
        ({"rope_type": "linear", "factor": 4.0}, 16384),
        ({"rope_type": "dynamic", "factor": 2.0}, 8192),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}, 8192),
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024}, 4096),
    ],
)
def test_context_length_follows_rope_scaling(rope: dict | None, expected: int) -> None:
    raw = dict(
        model_type="llama", vocab_size=32, hidden_size=64, num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=64, max_position_embeddings=4096,
        rope_parameters={**(rope or {"rope_type": "default"}), "rope_theta": 1e4},
    )
    assert ModelConfig.from_dict(raw).context_length == expected


def test_llm_on_broken_folder_names_the_problem(ckpt: Path) -> None:
    from specstream import LLM

    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(ckpt), mode="resident", device_kv_bytes=1 << 22, block_size=16)
