"""Server-sent events through sse-starlette, with ``: keep-alive`` comments while nothing is produced.

A client disconnect makes sse-starlette cancel the body iterator; each protocol's iterator closes
its :class:`~ninfer.api.service.Run` in a ``finally``, which cancels the request in the engine.
The response also calls ``on_close`` when it ends for any reason, so a stream cancelled before
its iterator ever ran still frees its request.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from sse_starlette.event import ServerSentEvent
from sse_starlette.sse import EventSourceResponse
from starlette.types import Receive, Scope, Send


def _keepalive() -> ServerSentEvent:
    return ServerSentEvent(comment="keep-alive")


class _EventStream(EventSourceResponse):
    def __init__(self, events: AsyncIterator[Any], keepalive_s: float, on_close: Callable[[], None]) -> None:
        super().__init__(events, ping=keepalive_s, ping_message_factory=_keepalive, sep="\n")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse_response(events: AsyncIterator[Any], keepalive_s: float, on_close: Callable[[], None]) -> EventSourceResponse:
    return _EventStream(events, keepalive_s, on_close)
