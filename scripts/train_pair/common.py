"""What the pair is: seed, tokenizer specials, held-out modules, model shapes; and the log."""

from __future__ import annotations

import random
import time

import torch

SEED = 1234
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Never trained on (tokenizer included); relative to the stdlib root.
HELD_OUT = [
    "argparse.py",
    "json/decoder.py",
    "json/encoder.py",
    "csv.py",
    "textwrap.py",
    "heapq.py",
    "bisect.py",
    "fractions.py",
    "statistics.py",
    "configparser.py",
    "shlex.py",
    "difflib.py",
    "calendar.py",
    "dataclasses.py",
    "pprint.py",
]
SKIP_DIRS = {"test", "tests", "site-packages", "dist-packages", "idlelib", "__pycache__"}

TARGET_SHAPE = dict(
    hidden_size=384,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=1024,
)
DRAFT_SHAPE = dict(
    hidden_size=192,
    num_hidden_layers=3,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=64,
    intermediate_size=448,
)
MAX_POS = 8192
ROPE_THETA = 500_000.0
PLACEHOLDER = (
    "Mean accepted tokens per round (q=4) at 1K/4K/8K contexts: measured by `specstream` "
    "speculative decoding, filled in later by the engine's bench"
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
