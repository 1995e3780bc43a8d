"""One submitted request: admission, its engine events, and cancellation when it is closed early.

:meth:`Run.admit` waits until the engine admits the request (429/503/400 can still be HTTP
statuses then); :meth:`Run.events` yields the engine's events; :meth:`Run.close` cancels the
request if it still runs (client gone, error), freeing its lane, pages and slot; :meth:`Run.interrupt`
(server shutdown) cancels it too but lets its stream end normally, as a truncated answer.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request as HTTPRequest

from ninfer.api.convert import engine_failure
from ninfer.api.errors import APIError
from ninfer.api.output import OutputStream
from ninfer.runtime.async_engine import EngineStopped
from ninfer.runtime.request import Request, RequestOutput, Status
from ninfer.runtime.scheduler import AdmissionError, QueueFull

if TYPE_CHECKING:
    from ninfer.api.service import Service

log = logging.getLogger("ninfer.api")
_POLL_S = 0.02  # admission polling interval, for engines that cannot report admissions


class ClientGone(Exception):
    """The client disconnected while its request waited or ran; nothing is answered."""


class Run:
    """One submitted request: its event stream, admission, and cancellation on early close."""

    def __init__(self, service: Service, req: Request) -> None:
        self.service, self.req = service, req
        self._events = service.engine.generate(req)
        self._next: asyncio.Future | None = None
        self.finished = False  # the engine sent the finished event
        self.closed = False  # accounted for (in-flight count, metrics)
        self.generated = 0
        self.interrupted = False  # ended by the server's shutdown: reported as truncated ("length")
        self.log_id = req.request_id  # the HTTP request id once admission knows the HTTP request
        self._start = time.perf_counter()
        self._last_token: float | None = None  # when the last token was delivered (inter-token latency)
        service.in_flight += 1
        service.drain.opened(self)

    async def admit(self, http: HTTPRequest | None) -> None:
        """Wait for admission; a client that disconnects meanwhile withdraws its request (ClientGone)."""
        svc = self.service
        self.log_id = getattr(getattr(http, "state", None), "request_id", None) or self.log_id
        if svc.drain.interrupted:  # accepted just before the shutdown deadline: it cannot run any more
            self.finished = True
            self._account("rejected", count=False)
            svc.metrics.rejected("shutdown")
            raise _shutting_down()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + svc.config.pending_timeout_ms / 1000
        self._next = asyncio.ensure_future(self._events.__anext__())
        watch = watch_disconnect(http)
        # The engine tells when the scheduler takes the request (headers go out then); an engine that
        # cannot is polled for the request's status.
        hook = getattr(svc.engine, "admission", None)
        admitted: asyncio.Future | None = hook(self.req) if hook is not None else None
        waits = {f for f in (self._next, watch, admitted) if f is not None}
        try:
            while True:
                timeout = _POLL_S if admitted is None else max(0.0, deadline - loop.time())
                await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if self._next.done():
                    self._check_first()
                    break
                if watch is not None and watch.done():
                    self.close()
                    raise ClientGone()
                if self.req.status is not Status.WAITING:
                    break
                if loop.time() >= deadline:
                    self.close("queue_timeout", count=False)
                    svc.metrics.rejected("queue_timeout")
                    raise APIError(503, f"the request waited {svc.config.pending_timeout_ms} ms without "
                                        f"being admitted (pending timeout)", code="request_queue_timeout")
        finally:
            if watch is not None:
                watch.cancel()
            if admitted is not None:
                admitted.cancel()
        svc.metrics.admitted(len(self.req.prompt_ids), int(getattr(self.req, "cached_tokens", 0) or 0),
                             time.perf_counter() - self._start)

    def _check_first(self) -> None:
        """Turn an admission failure delivered as the first event into an HTTP error."""
        assert self._next is not None
        err = self._next.exception()
        if err is None:
            if self.interrupted and self._next.result().finished:  # interrupted before it produced anything
                self._next = None
                self.finished = True
                self._account("rejected", count=False)
                self.service.metrics.rejected("shutdown")
                raise _shutting_down()
            return
        self._next = None
        self.finished = True  # the stream is over: nothing to cancel
        self._account("rejected", count=False)
        if isinstance(err, QueueFull):
            self.service.metrics.rejected("overloaded")
            raise APIError(429, f"the server is overloaded: {err}; retry later", code="server_overloaded")
        if isinstance(err, EngineStopped):
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        self.service.metrics.rejected("invalid")
        if isinstance(err, AdmissionError):
            raise APIError(400, str(err), code="context_length_exceeded", param="messages")
        if isinstance(err, StopAsyncIteration):
            raise APIError(500, "the engine closed the request without an event", code="engine_error")
        raise APIError(500, f"the engine rejected the request: {type(err).__name__}", code="engine_error")

    async def events(self, http: HTTPRequest | None = None) -> AsyncIterator[RequestOutput]:
        """Engine events until the finished one; with ``http``, a disconnect cancels (ClientGone)."""
        watch = watch_disconnect(http)
        try:
            while not self.finished:
                try:
                    event = await (self._next_event() if watch is None else self._next_watched(watch))
                except StopAsyncIteration:
                    self.finished = True
                    self._account("error")
                    raise APIError(500, "the engine ended the stream without a finished event",
                                   code="engine_error") from None
                except EngineStopped:
                    self.close("error")
                    raise APIError(500, "the engine stopped while the request ran", code="engine_error") from None
                self.generated += len(event.token_ids)
                if event.token_ids:
                    now = time.perf_counter()
                    if self._last_token is not None:  # the gap shared by the tokens this event delivers
                        gap = (now - self._last_token) / len(event.token_ids)
                        for _ in event.token_ids:
                            self.service.metrics.itl.observe(gap)
                    self._last_token = now
                if event.finished:
                    self.finished = True
                    await self._events.aclose()
                    outcome = event.finish_reason or "stop"
                    if self.interrupted and outcome == "cancelled":
                        event.finish_reason, outcome = "length", "interrupted"
                    self._account(outcome)
                yield event
        finally:
            if watch is not None:
                watch.cancel()

    async def _next_event(self) -> RequestOutput:
        """The next event, awaited directly: one wake-up per event, no task, no timer. A dead engine
        thread is not polled for: the AsyncEngine fails its open streams with EngineStopped."""
        if self._next is None:
            return await self._events.__anext__()
        try:  # the read that admission started; cancelling this await cancels it too
            return await self._next
        finally:
            self._next = None

    async def _next_watched(self, watch: asyncio.Task) -> RequestOutput:
        """The next event, raced against the client's disconnect; the engine thread's liveness is checked
        every second (for engines that do not fail their streams when they stop)."""
        if self._next is None:
            self._next = asyncio.ensure_future(self._events.__anext__())
        while not self._next.done():
            await asyncio.wait({self._next, watch}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            if watch.done():
                self.close()
                raise ClientGone()
            if not self._next.done() and not self.service.alive:
                self.close("error")
                raise APIError(500, "the engine stopped while the request ran", code="engine_error")
        task, self._next = self._next, None
        return task.result()

    async def collect(self, out: OutputStream, http: HTTPRequest | None = None) -> Any:
        """Run a non-streaming request to its end and return the collected output; an engine failure raises."""
        try:
            async for event in self.events(http):
                out.push(event)
        finally:
            self.close()
        if (err := engine_failure(out.finish_reason, out.error)) is not None:
            raise err
        return out.collected()

    def interrupt(self) -> None:
        """End the request early for a shutdown: the engine cancels it and its final event, which the
        response still renders with its protocol's terminal events, reports a truncated answer."""
        if not self.finished and not self.interrupted:
            self.interrupted = True
            self.service.engine.cancel(self.req.request_id)

    def close(self, outcome: str = "cancelled", count: bool = True) -> None:
        """Cancel the request if it still runs. Idempotent, and never awaits: safe while being cancelled."""
        if not self.finished:
            self.finished = True
            self.service.engine.cancel(self.req.request_id)
            if self._next is not None and not self._next.done():
                self._next.cancel()  # the engine stream's own cleanup runs in its task
            else:
                _close_soon(self._events)
        self._account(outcome, count)

    def _account(self, outcome: str, count: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        self.service.in_flight -= 1
        self.service.drain.closed(self)
        if not count:
            return
        req, elapsed = self.req, time.perf_counter() - self._start
        ttft = req.first_token_time - req.arrival if req.first_token_time is not None else None
        self.service.metrics.finished(outcome, self.generated, ttft, elapsed)
        log.info("request %s %s: prompt %d tok, generated %d tok, %.3f s", self.log_id, outcome,
                 len(req.prompt_ids), self.generated, elapsed)


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry the request", code="server_shutting_down")


def _close_soon(agen: Any) -> None:
    try:
        asyncio.get_running_loop().create_task(agen.aclose())
    except RuntimeError:  # no running loop: the generator is finalized when collected
        pass


def watch_disconnect(http: HTTPRequest | None) -> asyncio.Task | None:
    """A task that ends when the client disconnects (the body must already have been read)."""
    if http is None:
        return None

    async def wait() -> None:
        while True:
            message = await http.receive()
            if message["type"] == "http.disconnect":
                return
    return asyncio.ensure_future(wait())
