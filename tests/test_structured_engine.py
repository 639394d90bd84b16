"""Structured outputs on the embedded pair: every constraint kind yields what its grammar
accepts, and greedy outputs equal constrained target-only decoding in every mode, speculation
on (chains and trees) and off, with the history offloaded."""

from __future__ import annotations

import json
import re
from importlib.resources import files
from typing import Any

import pytest

from specstream import LLM, SamplingParams
from specstream.structured import Constraint, GrammarError

TARGET = str(files("specstream") / "assets" / "default-target")
DRAFT = str(files("specstream") / "assets" / "default-draft")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
        "inner": {"type": "object", "additionalProperties": False, "required": ["n"],
                  "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}},
    },
    "required": ["name", "tags", "inner"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": Constraint.json_schema(SCHEMA),
    "regex": Constraint("regex", "[0-9]{3}-[a-z]{2,4}"),
    "choice": Constraint.choice(["yes", "no", "maybe"]),
    "grammar": Constraint("grammar", 'root ::= "(" [a-z]+ ("," [a-z]+)? ")"'),
}
# long enough that the history is offloaded (offload_after_tokens below)
PROMPT = "def parse(text):\n    " + "items = [x.strip() for x in text.split(',')]\n    " * 12
OFFLOADED = dict(offload_after_tokens=64, chunk_tokens=64, block_size=16, residency="tail",
                 resident_tail_tokens=32)
MODES = {
    "resident, target only": dict(mode="resident"),
    "specstream, chains": dict(mode="specstream", draft_model=DRAFT, speculative_topk=1,
                               **OFFLOADED),
    "specstream, trees": dict(mode="specstream", draft_model=DRAFT, speculative_topk=2,
                              num_speculative_tokens=3, speculative_num_draft_tokens=6,
                              speculative_policy="fixed", **OFFLOADED),
    "offload-spec": dict(mode="offload-spec", draft_model=DRAFT, **OFFLOADED),
    "stream, no speculation": dict(mode="stream", **OFFLOADED),
}


def accepts(kind: str, text: str) -> bool:
    if kind == "json_schema":
        obj = json.loads(text)
        return (set(obj) == {"name", "tags", "inner"} and len(obj["name"]) <= 12
                and set(obj["tags"]) <= {"red", "blue"} and 0 <= obj["inner"]["n"] <= 99)
    if kind == "regex":
        return re.fullmatch("[0-9]{3}-[a-z]{2,4}", text) is not None
    if kind == "choice":
        return text in ("yes", "no", "maybe")
    return re.fullmatch(r"\([a-z]+(,[a-z]+)?\)", text) is not None


def run(kw: dict[str, Any]) -> dict[str, list[int]]:
    llm = LLM(TARGET, **kw)
    try:
        out = {}
        for kind, c in CONSTRAINTS.items():
            params = SamplingParams(temperature=0, max_tokens=64, structured=c)
            o = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
            assert o.finish_reason == "stop", (kind, o.text)
            assert accepts(kind, o.text), (kind, o.text)
            out[kind] = list(o.token_ids)
        m = llm.get_metrics()
        if kw["mode"] != "resident":
            assert m["link_bytes_h2d"] > 0  # the history streamed or was restored
        if kw.get("speculative_topk", 1) > 1:
            assert m["tree_rounds"] > 0
        return out
    finally:
        llm.close()


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return run(MODES["resident, target only"])


@pytest.mark.parametrize("name", [m for m in MODES if m != "resident, target only"])
def test_greedy_equals_constrained_target_only(reference: dict[str, list[int]],
                                               name: str) -> None:
    assert run(MODES[name]) == reference


def test_bad_constraints_are_refused_at_admission() -> None:
    llm = LLM(TARGET, mode="resident")
    try:
        with pytest.raises(GrammarError, match="invalid regex"):
            llm.generate(["x"], SamplingParams(structured=Constraint("regex", "(ab")),
                         use_tqdm=False)
        o = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert o[0].outputs[0].token_ids  # the engine still serves
    finally:
        llm.close()
