"""Server-sent events through sse-starlette, with ``: keep-alive`` comments while nothing is produced.

A client disconnect makes sse-starlette cancel the body iterator; each protocol's iterator closes
its :class:`~ninfer.api.service.Run` in a ``finally``, which cancels the request in the engine.
The response also calls ``on_close`` when it ends for any reason, so a stream cancelled before
its iterator ever ran still frees its request.

The protocol iterators yield ready frames (:func:`sse_frame`, bytes), which sse-starlette writes
as they are: its generic path (a ``ServerSentEvent`` per frame, a regex split of the data, a
``StringIO``) would run for every token.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from sse_starlette.event import ServerSentEvent, ensure_bytes
from sse_starlette.sse import EventSourceResponse
from starlette.types import Message, Receive, Scope, Send

_SEP = "\n"
# json.dumps(obj, ensure_ascii=False) builds a new JSONEncoder on every call; this one is made once (same text).
json_text: Callable[[Any], str] = json.JSONEncoder(ensure_ascii=False).encode


def sse_frame(data: str, event: str | None = None) -> bytes:
    """One SSE frame, byte for byte what sse-starlette writes for ``{"event": event, "data": data}``."""
    if "\n" in data or "\r" in data:  # never JSON text: multi-line data takes sse-starlette's own framing
        return ensure_bytes({"data": data, "event": event}, _SEP)
    if event is None:
        return f"data: {data}{_SEP}{_SEP}".encode()
    return f"event: {event}{_SEP}data: {data}{_SEP}{_SEP}".encode()


def _keepalive() -> ServerSentEvent:
    return ServerSentEvent(comment="keep-alive")


class _EventStream(EventSourceResponse):
    def __init__(self, events: AsyncIterator[Any], keepalive_s: float, on_close: Callable[[], None]) -> None:
        super().__init__(events, ping=keepalive_s, ping_message_factory=_keepalive, sep=_SEP)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

    @staticmethod
    async def _listen_for_exit_signal() -> None:
        """sse-starlette (2.x and 3.x) cuts every open stream mid-body when uvicorn is told to exit; ours end
        on their own with their protocol's terminal events (``ninfer.api.shutdown``: drained, or interrupted
        at the deadline)."""
        await anyio.sleep_forever()

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        """sse-starlette (3.x) wraps every send, one per token, in ``anyio.move_on_after(send_timeout)``;
        without a timeout (ours: none) that cancel scope never fires but costs as much as building the
        frame. Versions without this method stream through their own path, unaffected."""
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def sse_response(events: AsyncIterator[Any], keepalive_s: float, on_close: Callable[[], None]) -> EventSourceResponse:
    return _EventStream(events, keepalive_s, on_close)
