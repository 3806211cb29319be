"""OpenAI-style API errors: every refusal is an ``APIError`` turned into
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """A request the server refuses. ``status`` is the HTTP status; ``type`` follows
    OpenAI's names (invalid_request_error, authentication_error, not_found_error,
    server_error, service_unavailable)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str = "the server is shutting down") -> APIError:
    return APIError(503, message, type="service_unavailable", code="shutting_down")
