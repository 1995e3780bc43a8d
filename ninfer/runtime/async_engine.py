"""An engine on its own thread, driven from asyncio: submit a request, read its events, cancel it.

The HTTP layer never blocks the engine: commands cross into the engine thread through a queue,
and events come back to each caller's event loop with ``call_soon_threadsafe``.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from ninfer.runtime.engine import Engine
from ninfer.runtime.request import Request, RequestOutput


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        self.last_error: Exception | None = None
        self._thread = threading.Thread(target=self._loop, name="ninfer-engine", daemon=True)
        self._thread.start()

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Submit ``req`` and yield its events until the finished one; cancels it if the caller stops early."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        self._streams[req.request_id] = (loop, events)
        self._commands.put(("add", req))
        finished = False
        try:
            while True:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if event.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.cancel(req.request_id)
            self._streams.pop(req.request_id, None)

    def cancel(self, request_id: str) -> None:
        self._commands.put(("cancel", request_id))

    def call(self, fn: Any) -> None:
        """Run ``fn(engine)`` on the engine thread between steps (for metrics snapshots and the like)."""
        self._commands.put(("call", fn))

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(("stop", None))
        self._thread.join(timeout=10)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, events = target
            loop.call_soon_threadsafe(events.put_nowait, item)

    def _handle(self, kind: str, arg: Any) -> None:
        if kind == "add":
            try:
                self.engine.add_request(arg)
            except Exception as err:  # admission errors go back to the submitter, the engine keeps running
                self._deliver(arg.request_id, err)
        elif kind == "cancel":
            event = self.engine.cancel(arg)
            if event is not None:
                self._deliver(arg, event)
        elif kind == "call":
            arg(self.engine)

    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                kind, arg = self._commands.get(block=not self.engine.has_work, timeout=None)
                self._handle(kind, arg)
                while True:  # drain everything queued before the next step
                    kind, arg = self._commands.get_nowait()
                    self._handle(kind, arg)
            except queue.Empty:
                pass
            if self.engine.has_work:
                try:
                    events = self.engine.step()
                except Exception as err:  # a failed step ends every resident request; serving goes on
                    events = self._fail_all(err)
                for event in events:
                    self._deliver(event.request_id, event)

    def _fail_all(self, err: Exception) -> list[RequestOutput]:
        self.last_error = err
        events = []
        for request_id in list(self.engine.requests):
            event = self.engine.cancel(request_id)
            if event is not None:
                event.finish_reason, event.error = "error", f"{type(err).__name__}: {err}"
                events.append(event)
        return events

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
