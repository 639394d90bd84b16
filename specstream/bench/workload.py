"""The bench workload: long-context requests built from local text.

Prompts are cut from the CPython standard library modules that the embedded model pair never
trained on (its held-out set), so every machine has them and the drafts are honest.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from specstream.tokenizer import Tokenizer

# Held out from the embedded pair's training (scripts/train_pair/common.py HELD_OUT).
HELD_OUT = (
    "argparse.py", "json/decoder.py", "json/encoder.py", "csv.py", "textwrap.py", "heapq.py",
    "bisect.py", "fractions.py", "statistics.py", "configparser.py", "shlex.py", "difflib.py",
    "calendar.py", "dataclasses.py", "pprint.py",
)


@dataclass(frozen=True)
class Workload:
    context_lengths: tuple[int, ...]  # prompt tokens per request
    output_len: int

    @property
    def num_requests(self) -> int:
        return len(self.context_lengths)


def held_out_text() -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [(root / m).read_text(encoding="utf-8", errors="replace")
             for m in HELD_OUT if (root / m).is_file()]
    if not parts:
        raise FileNotFoundError(f"no held-out standard library modules under {root}")
    return "\n\n".join(parts)


def build_prompts(
    workload: Workload, tokenizer: Tokenizer | None, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """One token-id prompt per request, each starting at a different offset of the text."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab_size, (n,), generator=g).tolist()
                for n in workload.context_lengths]
    need = max(workload.context_lengths)
    ids = held_out_ids(tokenizer, 2 * need)
    prompts = []
    stride = max(1, (len(ids) - need) // max(1, workload.num_requests))
    for i, n in enumerate(workload.context_lengths):
        start = (i * stride + seed * 997) % (len(ids) - n)
        prompts.append(ids[start : start + n])
    return prompts


def held_out_ids(tokenizer: Tokenizer, min_len: int = 0) -> list[int]:
    """The held-out text as token ids (no special tokens), repeated to at least ``min_len``."""
    ids = tokenizer.encode(held_out_text(), add_special_tokens=False)
    while len(ids) < min_len:
        ids = ids + ids
    return ids
