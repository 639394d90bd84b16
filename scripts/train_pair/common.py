"""What the pair is: seed, tokenizer specials, held-out modules, model shapes; and the log."""

from __future__ import annotations

import random
import time

import torch

SEED = 1234
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = "<|endoftext|>"
CHAT_TEMPLATE = (  # ChatML; with tools, the Hermes / Qwen layout of tools and calls
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{{ '\\n\\n' }}"
    "{% endif %}# Tools\n"
    "\n"
    "You may call one or more functions to assist with the user query.\n"
    "\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}"
    "</tools>\n"
    "\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>{{ '\\n' }}{% endif %}{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "<|im_start|>assistant{{ '\\n' }}{% if message['content'] %}{{ message['content'] }}"
    "{{ '\\n' }}{% endif %}{% for call in message['tool_calls'] %}{% if not loop.first %}"
    "{{ '\\n' }}{% endif %}<tool_call>{{ '\\n' }}"
    "{\"name\": {{ call['function']['name'] | tojson }}"
    ", \"arguments\": {% if call['function']['arguments'] is string %}"
    "{{ call['function']['arguments'] }}{% else %}"
    "{{ call['function']['arguments'] | tojson }}{% endif %}}{{ '\\n' }}"
    "</tool_call>{% endfor %}<|im_end|>{{ '\\n' }}{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "<|im_start|>user{% endif %}{{ '\\n' }}<tool_response>{{ '\\n' }}{{ message['content'] }}"
    "{{ '\\n' }}"
    "</tool_response>{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "<|im_end|>{{ '\\n' }}{% endif %}{% else %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
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
