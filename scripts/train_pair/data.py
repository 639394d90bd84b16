"""Training data: the stdlib source split into training and held-out files, the byte-level BPE
tokenizer trained on the training files, and endless seeded batches of packed windows."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

import torch

from .common import CHAT_TEMPLATE, EOS, HELD_OUT, MAX_POS, SKIP_DIRS, SPECIAL_TOKENS, log


def stdlib_files() -> tuple[Path, list[str], list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if any(part in SKIP_DIRS for part in rel.split("/")[:-1]):
            continue
        (held if rel in HELD_OUT else train).append(rel)
    missing = [m for m in HELD_OUT if m not in held]
    if missing:
        log(f"warning: held-out modules missing from this stdlib: {missing}")
    held.sort(key=HELD_OUT.index)
    return root, train, held


def read_text(root: Path, rel: str) -> str:
    return (root / rel).read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def hf_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POS,
        clean_up_tokenization_spaces=False,
    )


def encode_docs(tok, texts: list[str]) -> list[torch.Tensor]:
    encs = tok.encode_batch(texts, add_special_tokens=False)
    return [torch.tensor(e.ids, dtype=torch.int32) for e in encs]


def stream(docs: list[torch.Tensor], eos_id: int, order: list[int] | None = None) -> torch.Tensor:
    sep = torch.tensor([eos_id], dtype=torch.int32)
    parts = []
    for i in order if order is not None else range(len(docs)):
        parts += [docs[i], sep]
    return torch.cat(parts)


class Batches:
    """Endless seeded batches of packed windows: each epoch reshuffles file order and windows."""

    def __init__(self, docs, eos_id, seed):
        self.docs, self.eos_id = docs, eos_id
        self.rng = random.Random(seed)
        self.epoch = 0
        self.tokens_seen = 0
        self._queue: list[torch.Tensor] = []
        self._seq = None

    def _refill(self, seq):
        order = list(range(len(self.docs)))
        self.rng.shuffle(order)
        s = stream(self.docs, self.eos_id, order)
        off = self.rng.randrange(seq)
        n = (len(s) - off) // seq
        wins = list(s[off : off + n * seq].view(n, seq).unbind(0))
        self.rng.shuffle(wins)
        self._queue, self._seq = wins, seq
        self.epoch += 1

    def next(self, bs, seq):
        if self._seq != seq:
            self._queue = []
        while len(self._queue) < bs:
            self._refill(seq)
        out = torch.stack(self._queue[:bs]).long()
        del self._queue[:bs]
        self.tokens_seen += out.numel()
        return out
