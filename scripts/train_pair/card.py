"""The model card: `model_card.json` and the `MODEL_CARD.md` written from it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .common import EOS, MAX_POS, PLACEHOLDER, ROPE_THETA, SKIP_DIRS, SPECIAL_TOKENS


def dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def write_card(out: Path, card: dict):
    (out / "model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    t, d, ev = card["target"], card["draft"], card["eval"]
    lines = [
        "# SpecStream default model pair",
        "",
        "Embedded default target/draft pair (Qwen3 architecture, HF format, bf16 safetensors),",
        "trained on CPU by the project's own script on the CPython standard library source.",
        "Tiny code models: useful for exercising the engine offline, not for real quality.",
        "",
        "Reproduce (defaults; wall-time budgeted, so step counts depend on the machine):",
        "",
        "```",
        card["command"],
        "```",
        "",
        "## Models",
        "",
        "| | target | draft |",
        "|---|---|---|",
        f"| parameters | {t['params']:,} | {d['params']:,} |",
        f"| hidden / layers | {t['shape']['hidden_size']} / {t['shape']['num_hidden_layers']} "
        f"| {d['shape']['hidden_size']} / {d['shape']['num_hidden_layers']} |",
        f"| heads / kv heads / head dim | {t['shape']['num_attention_heads']} / "
        f"{t['shape']['num_key_value_heads']} / {t['shape']['head_dim']} | "
        f"{d['shape']['num_attention_heads']} / {d['shape']['num_key_value_heads']} / "
        f"{d['shape']['head_dim']} |",
        f"| intermediate | {t['shape']['intermediate_size']} | "
        f"{d['shape']['intermediate_size']} |",
        f"| training steps / tokens | {t['train']['steps']} / {t['train']['tokens'] / 1e6:.1f}M "
        f"| {d['train']['steps']} / {d['train']['tokens'] / 1e6:.1f}M |",
        f"| training wall time | {t['train']['wall_seconds'] / 60:.1f} min "
        f"| {d['train']['wall_seconds'] / 60:.1f} min |",
        "",
        f"max_position_embeddings {MAX_POS}, rope_theta {ROPE_THETA:g}, tied embeddings. "
        f"Training length {card['training']['seq']} tokens, final "
        f"{card['training']['long_frac']:.0%} of each phase at {card['training']['long_seq']}. "
        f"Draft loss: {card['training']['kl_weight']} * KL(target || draft) + "
        f"{card['training']['greedy_weight']} * CE(target greedy) + "
        f"{1 - card['training']['kl_weight'] - card['training']['greedy_weight']:.2f} * CE(data)."
        + card.get("draft_note", ""),
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE (tokenizers), vocabulary {card['tokenizer']['vocab_size']}, special "
        f"tokens {', '.join('`' + s + '`' for s in SPECIAL_TOKENS)} (bos = eos = pad = `{EOS}`); "
        "simple `<|im_start|>role ... <|im_end|>` chat template. Trained on the training files "
        f"only ({card['tokenizer']['train_seconds']:.0f} s). Same tokenizer in both folders.",
        "",
        "## Data",
        "",
        f"CPython {card['data']['python_version']} standard library "
        "(found with `sysconfig.get_paths()[\"stdlib\"]`), "
        f"`*.py`, skipping folders {', '.join(sorted(SKIP_DIRS))}: "
        f"{card['data']['train_files']} training files, {card['data']['train_tokens']:,} tokens "
        f"({card['data']['train_bytes'] / 1e6:.1f} MB). Held out (never trained on, tokenizer "
        f"included): {card['data']['held_out_tokens']:,} tokens from",
        ", ".join(f"`{m}`" for m in card["data"]["held_out"]) + ".",
        "",
        "## Held-out evaluation",
        "",
        "fp32 compute from the saved bf16 weights; loss in nats/token over evenly spread,",
        "non-overlapping windows of the held-out stream (files joined by `<|endoftext|>`).",
        "Agreement: fraction of positions where draft and target greedy next tokens are equal.",
        "",
        "| context | windows | target loss | draft loss | agreement | agreement (pos >= 512) |",
        "|---|---|---|---|---|---|",
    ]
    for k, e in ev.items():
        if not k.startswith("ctx"):
            continue
        lines.append(
            f"| {k[3:]} | {e['windows']} | {e['target_loss']:.3f} | "
            f"{e.get('draft_loss', float('nan')):.3f} | {e.get('agreement', float('nan')):.3f} | "
            f"{e.get('agreement_pos_ge_512', float('nan')):.3f} |"
        )
    u = ev["untrained"]
    lines += [
        "",
        f"Untrained baseline (same shape, same init seed {card['seed']}), ctx 1024: target "
        f"{u['target_loss_ctx1024']:.3f}, draft {u['draft_loss_ctx1024']:.3f} nats/token "
        f"(uniform over the vocabulary: {math.log(card['tokenizer']['vocab_size']):.3f}).",
        "",
        "## Speculative decoding",
        "",
        f"**PLACEHOLDER** — {PLACEHOLDER}.",
        "",
        "## Timing",
        "",
        f"Tokenizer {card['timing']['tokenizer_s']:.0f} s, target "
        f"{card['timing']['target_s'] / 60:.1f} min, draft {card['timing']['draft_s'] / 60:.1f} "
        f"min, evaluation {card['timing']['eval_s'] / 60:.1f} min, total "
        f"{card['timing']['total_s'] / 60:.1f} min on {card['machine']}.",
        "",
    ]
    (out / "MODEL_CARD.md").write_text("\n".join(lines))
