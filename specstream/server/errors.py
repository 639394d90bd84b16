"""Errors answered with an HTTP status and an OpenAI-style body."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered with an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = status if code is None else code

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends it."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def server_error(message: str) -> APIError:
    """A 500 for failures inside the engine (a failed KV transfer, a crashed loop)."""
    return APIError(500, message, type="server_error")
