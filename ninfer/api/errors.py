"""API errors and their wire shapes: OpenAI ``{"error": {...}}`` and Anthropic ``{"type": "error", ...}``.

Handlers raise :class:`APIError`; the app renders it in the shape of the protocol the route
belongs to. The Anthropic protocol reports overload as 529 and queue timeouts as 504.
"""
from __future__ import annotations

from typing import Any, Literal

Protocol = Literal["openai", "anthropic"]

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                 500: "server_error", 503: "service_unavailable_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 504: "timeout_error", 529: "overloaded_error"}
# Codes whose HTTP status differs in the Anthropic protocol.
_ANTHROPIC_STATUS = {"server_overloaded": 529, "request_queue_timeout": 504}


class APIError(Exception):
    """An error answered to the client: HTTP status, a message naming the problem, and a stable code."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def status_for(self, protocol: Protocol) -> int:
        if protocol == "anthropic":
            return _ANTHROPIC_STATUS.get(self.code or "", self.status)
        return self.status

    def body(self, protocol: Protocol) -> dict[str, Any]:
        status = self.status_for(protocol)
        if protocol == "anthropic":
            return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"),
                                               "message": self.message}}
        return {"error": {"message": self.message, "type": _OPENAI_TYPES.get(status, "server_error"),
                          "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 naming the offending field."""
    return APIError(400, message, code=code or "invalid_request_error", param=param)


def unsupported(param: str, what: str | None = None) -> APIError:
    return invalid(f"'{param}' is not supported by this server" + (f": {what}" if what else ""), param,
                   code="unsupported_parameter")
