"""Speculative decoding: proposers draft tokens, ``accept_drafts`` verifies them losslessly.

The names below load on first use (PEP 562), so the torch-free parts of the package
(``token_tree``) import without the acceptance kernels pulling in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "AcceptOutput": "acceptance", "accept_drafts": "acceptance",
    "NgramProposer": "ngram", "ngram_lookup": "ngram",
    "Proposal": "proposer", "ProposeJob": "proposer", "Proposer": "proposer",
    "ProposeRequest": "proposer", "available_proposers": "proposer",
    "batch_proposals": "proposer", "make_proposer": "proposer",
    "register_proposer": "proposer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'specstream.spec' has no attribute {name!r}")
    return getattr(importlib.import_module(f"specstream.spec.{_WHERE[name]}"), name)
