"""Errors shared by the engine and the proposers."""

from __future__ import annotations


class RequestError(Exception):
    """A failure that belongs to one request (its own seed, its own draft state): the engine
    fails that request alone and carries on with the others."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id
