"""The Qwen3 models: config from a shape, fresh init, save as bf16 HF folders, load in fp32."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .common import CHAT_TEMPLATE, EOS, MAX_POS, ROPE_THETA, SPECIAL_TOKENS


def make_config(shape, tok):
    from transformers import Qwen3Config

    eos_id = tok.token_to_id(EOS)
    cfg = Qwen3Config(
        vocab_size=tok.get_vocab_size(),
        max_position_embeddings=MAX_POS,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        rms_norm_eps=1e-6,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_sliding_window=False,
        attention_dropout=0.0,
        **shape,
    )
    cfg.rope_theta = ROPE_THETA  # plain key too, for loaders that predate rope_parameters
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def new_model(cfg, seed):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(cfg).float()


def n_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def save_model(model, hf_tok, out_dir: Path):
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    sd.pop("lm_head.weight", None)  # tied
    from safetensors.torch import save_file

    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["dtype"] = "bfloat16"
    for k in ("_attn_implementation_autoset", "_name_or_path", "id2label", "label2id"):
        cfg.pop(k, None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
        do_sample=False,
    )
    gen.save_pretrained(tmp)
    save_tokenizer(hf_tok, tmp)
    for f in tmp.iterdir():
        f.chmod(0o644)
        os.replace(f, out_dir / f.name)
    tmp.rmdir()


def save_tokenizer(hf_tok, out_dir: Path):
    hf_tok.save_pretrained(out_dir)
    # Keep the chat template inside tokenizer_config.json (not only chat_template.jinja).
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    tc["bos_token"] = tc["eos_token"] = tc["pad_token"] = EOS
    tc["additional_special_tokens"] = SPECIAL_TOKENS[1:]  # key used by transformers 4.x
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # loadable by 4.x and 5.x
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    jinja = out_dir / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()
    stm = {
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")


def load_model(path: Path):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return m.eval()
