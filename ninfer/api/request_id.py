"""The request id: the client's ``X-Request-Id`` (checked) or a fresh one, one id for header, body and log.

The response echoes it in ``x-request-id`` (Anthropic routes: ``request-id`` as well), a body id is it
behind its protocol's prefix (``chatcmpl-<id>``, ``msg_<id>``, ``resp_<id>``), and the request's log line
names it.
"""
from __future__ import annotations

import re
import secrets

from starlette.requests import Request

from ninfer.api.errors import APIError

HEADER = "x-request-id"
MAX_CHARS = 128
_SAFE = re.compile(r"[A-Za-z0-9._:-]+")


def new() -> str:
    """A fresh request id (24 hex digits)."""
    return secrets.token_hex(12)


def read(request: Request) -> str:
    """The client's id if it sent one (400 naming the header if it is not 1..128 of ``A-Za-z0-9._:-``),
    else a new random one."""
    offered = request.headers.get(HEADER)
    if offered is None:
        return new()
    if not 0 < len(offered) <= MAX_CHARS or not _SAFE.fullmatch(offered):
        raise APIError(400, f"the '{HEADER}' header must be 1 to {MAX_CHARS} characters of letters, digits "
                            f"and '.', '_', ':', '-'", code="invalid_request_id", param=HEADER)
    return offered


def body_id(request: Request, prefix: str) -> str:
    """The protocol's body id of this request: ``prefix`` + its request id."""
    return prefix + (getattr(request.state, "request_id", None) or new())
