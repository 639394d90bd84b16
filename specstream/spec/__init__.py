"""Speculative decoding: proposers draft tokens, ``accept_drafts`` verifies them losslessly."""

from __future__ import annotations

from specstream.spec.acceptance import AcceptOutput, accept_drafts
from specstream.spec.ngram import NgramProposer, ngram_lookup
from specstream.spec.proposer import (
    Proposal,
    ProposeJob,
    Proposer,
    ProposeRequest,
    available_proposers,
    batch_proposals,
    make_proposer,
    register_proposer,
)

__all__ = [
    "AcceptOutput",
    "NgramProposer",
    "Proposal",
    "ProposeJob",
    "ProposeRequest",
    "Proposer",
    "accept_drafts",
    "available_proposers",
    "batch_proposals",
    "make_proposer",
    "ngram_lookup",
    "register_proposer",
]
