"""Read timeouts of the HTTP connection: requests whose headers or body do not arrive in time are dropped.

uvicorn bounds only the idle time between requests (``timeout_keep_alive``): a client that opens a
connection and sends part of its headers, or stops in the middle of a body, holds the connection
(and its request task) forever. :func:`guarded_h11` returns uvicorn's h11 protocol with two timers:

- headers: from the connection's start, or the first byte of a later request on a kept-alive
  connection, the whole header block must arrive within ``header_timeout_s``;
- body: while a request body is being received, no gap between its bytes may exceed ``body_timeout_s``
  (a total bound would cut large uploads over slow links; a stalled one is what to catch).

Past either, the client gets ``408 Request Timeout`` (unless its request was already answered, as a body
over the size limit is) and the connection is closed; an application still waiting for the body then
sees the client's disconnect.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("ninfer.api")
_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class _GuardedH11(H11Protocol):
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._reading: str | None = None  # "headers", "body", or None (nothing owed by the client)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._expect("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._expect(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._reading == "body":
            self._expect(None)  # re-armed below: the body timeout bounds the gap between its bytes
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def _follow(self) -> None:
        """Arm the timer that the client's side of the h11 state machine calls for now."""
        if self.transport.is_closing():
            self._expect(None)
        elif self.conn.their_state is h11.SEND_BODY:
            self._expect("body")
        elif self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._expect("headers")  # part of a request's head is buffered
        elif self._reading != "headers" or self.conn.their_state is not h11.IDLE:
            self._expect(None)  # idle between requests: uvicorn's keep-alive timeout applies

    def _expect(self, what: str | None) -> None:
        if what == self._reading and what != "body":
            return  # the header timer runs from the first byte, it is not re-armed
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._reading = what
        if what is not None:
            delay = self.header_timeout_s if what == "headers" else self.body_timeout_s
            self._read_timer = self.loop.call_later(delay, self._timed_out, what)

    def _timed_out(self, what: str) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        log.info("closing a connection from %s: its request %s did not arrive in time",
                 "%s:%d" % self.client if self.client else "?", "headers" if what == "headers" else "body")
        # A new request's head never has a response yet; a body may already have one (a 413 sent early).
        if what == "headers" or self.cycle is None or not self.cycle.response_started:
            self.transport.write(_REQUEST_TIMEOUT)
        self.transport.close()


def guarded_h11(header_timeout_s: float, body_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with these read timeouts (pass it as ``uvicorn.Config(http=...)``)."""
    return type("GuardedH11Protocol", (_GuardedH11,), {"header_timeout_s": header_timeout_s,
                                                        "body_timeout_s": body_timeout_s})
