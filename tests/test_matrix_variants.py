"""bench/matrix_variants.py's --variant parsing: fields as Python literals, clear errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "matrix_variants.py"
spec = importlib.util.spec_from_file_location("matrix_variants", SCRIPT)
assert spec is not None and spec.loader is not None
variants = importlib.util.module_from_spec(spec)
spec.loader.exec_module(variants)


def test_a_variant_parses_to_engine_fields():
    assert variants.parse_variant("tail128:resident_tail_tokens=128") == (
        "tail128", {"resident_tail_tokens": 128})
    name, fields = variants.parse_variant("x:host_attention=off, num_speculative_tokens=None")
    assert name == "x" and fields == {"host_attention": "off", "num_speculative_tokens": None}


@pytest.mark.parametrize("bad", ["tail128", ":a=1", "x:a", "x:"])
def test_a_malformed_variant_is_refused_with_its_text(bad):
    with pytest.raises(ValueError, match="--variant"):
        variants.parse_variant(bad)
