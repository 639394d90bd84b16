"""The embedded default pair: loadable by transformers, logits equal to transformers'."""

from __future__ import annotations

import pytest
import torch

from specstream.attention import causal_mask, full_attention
from specstream.bench.workload import held_out_text
from specstream.llm import default_model_dir
from specstream.models.loader import load_model
from specstream.tokenizer import Tokenizer


class _Full:
    def attend(self, layer, q, k, v):
        return full_attention(q, k, v, q.shape[-1] ** -0.5, causal_mask(q.shape[0], k.shape[0]))


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_shipped_weights_match_transformers(kind):
    from transformers import AutoModelForCausalLM

    folder = default_model_dir(kind)
    ids = Tokenizer(folder).encode(held_out_text())[:384]
    x = torch.tensor(ids)
    ours = load_model(folder, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        got = ours.compute_logits(ours(x, torch.arange(len(ids)), _Full()))
        want = hf(x[None]).logits[0].float()
    assert (got - want).abs().max().item() <= 1e-4


def test_pair_shares_tokenizer_and_fits_the_size_budget():
    from transformers import AutoTokenizer

    t, d = default_model_dir("target"), default_model_dir("draft")
    assert (t / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()
    size = sum(f.stat().st_size for folder in (t, d) for f in folder.iterdir())
    assert size <= 40 * 2**20
    text = "def main(argv=None):\n    return 0\n"
    ours = Tokenizer(t)
    theirs = AutoTokenizer.from_pretrained(t)
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        theirs.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True))
