"""Graceful shutdown of ``ninfer serve``: drain on SIGTERM / SIGINT, end open streams well, exit 0.

On the first signal :class:`GracefulServer` starts the :class:`Drain` of the app: the app answers new
requests 503 (with ``Retry-After``) and uvicorn closes its listener and idle connections, while the
requests already accepted keep running. At the deadline (``--shutdown-timeout``), or on a second
signal, every request still open is interrupted: the engine cancels it and its response ends as a
truncated one in its own protocol (OpenAI ``finish_reason: "length"`` and ``[DONE]``, Anthropic
``message_delta`` with ``max_tokens`` and ``message_stop``, Responses ``response.incomplete``), so every
chunked body is terminated. Requests still waiting for a lane then are answered 503. A third SIGINT
quits at once (uvicorn's force exit). The process exits 0 after a signalled shutdown.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any, Protocol

import uvicorn

log = logging.getLogger("ninfer.api")
# Past the drain deadline, uvicorn gets this long for the interrupted responses to be written before it
# cancels what is left (a backstop: an interrupted stream normally ends within one engine step).
_BACKSTOP_S = 10.0


class Interruptible(Protocol):
    def interrupt(self) -> None: ...


class Drain:
    """The open runs of one app, and whether the server is draining."""

    def __init__(self) -> None:
        self.draining = False
        self.interrupted = False
        self.runs: set[Interruptible] = set()

    def opened(self, run: Interruptible) -> None:
        self.runs.add(run)

    def closed(self, run: Interruptible) -> None:
        self.runs.discard(run)

    def begin(self) -> None:
        """Stop taking new requests; the open ones go on."""
        if not self.draining:
            self.draining = True
            log.info("shutting down: %d request(s) in flight", len(self.runs))

    def interrupt_all(self) -> None:
        """End every open request now (each one's response still ends with its protocol's terminal events)."""
        self.begin()
        if not self.interrupted:
            self.interrupted = True
            if self.runs:
                log.warning("shutdown deadline: interrupting %d request(s)", len(self.runs))
        for run in list(self.runs):
            run.interrupt()


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose exit signals drain the app (``drain()`` returns its :class:`Drain`, or None
    before the app has started) for up to ``shutdown_timeout`` seconds."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Drain | None], shutdown_timeout: float) -> None:
        config.timeout_graceful_shutdown = shutdown_timeout + _BACKSTOP_S  # type: ignore[assignment]
        super().__init__(config)
        self._drain = drain
        self._shutdown_timeout = shutdown_timeout
        self._signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals == 1 or (self._signals > 2 and sig == signal.SIGINT):
            super().handle_exit(sig, frame)  # first: should_exit; third SIGINT: force exit
        if self._loop is not None:  # a signal handler runs between bytecodes: hand the work to the loop
            self._loop.call_soon_threadsafe(self._on_signal, self._signals)

    def _on_signal(self, count: int) -> None:
        drain = self._drain()
        if drain is None:
            return
        if count == 1:
            drain.begin()
            assert self._loop is not None
            self._loop.call_later(self._shutdown_timeout, drain.interrupt_all)
        else:
            drain.interrupt_all()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn re-raises the signals it caught once it has shut down (the process would then die of
        SIGTERM, or exit 130 on SIGINT); a drained shutdown is a clean one, so it exits 0."""
        with super().capture_signals():
            yield
            self._captured_signals.clear()
