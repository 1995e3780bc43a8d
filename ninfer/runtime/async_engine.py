"""An engine on its own thread, driven from asyncio: submit a request, read its events, cancel it.

The HTTP layer never blocks the engine: commands cross into the engine thread through a queue, on
which the thread sleeps while it has no work (a new request wakes it at once, no polling), and
events come back to each caller's event loop through a :class:`_Mailbox`: one
``call_soon_threadsafe`` per step and loop, not per event. Every wake-up of the event loop is a
self-pipe write on the engine thread and a chance for the loop thread to take the GIL from it, so
the events of one step (a token for each running request) travel together, and a batch posted
while the previous one is still undelivered rides on its wake-up.

On a device that runs a step asynchronously (CUDA: the host queues the forward, then waits for its
tokens), the hand-over is timed so that the event loop's work overlaps the device rather than the
host's launches: a decode step's events and the admissions made during a step are held until the
engine reports the next forward queued (``Engine.on_launched``), i.e. until the engine thread is
about to wait on the device with the GIL released. Otherwise the loop thread, woken just as the
engine thread starts building the next step, takes the GIL at the engine's first released op and
keeps it for its whole burst (chunk, SSE frame, socket write) while the device idles: on an H200 at
batch 1 that cost ~0.2 ms per 11 ms token, and the response start during a prefill's launches
delayed the first token by milliseconds. A request's first token and finished events are not held
(the client waits on them), nor is anything when the engine goes idle after the step, nor the events of a step
that ended with a decode step left in flight (``Engine.ahead``, :mod:`~ninfer.runtime.run_ahead`): the device
then has a whole step queued, which the loop's work overlaps however long the next launch waits for the GIL.

A first token posted on such a device is also handed over: the engine thread waits, with the GIL released and for
at most ``HANDOVER_TIMEOUT_S``, until the request's consumer asks for its next event, i.e. until the loop has
written the token to its client. Otherwise the engine thread goes on to build and launch the next steps, and the
loop thread, woken from its selector, waits for the GIL through them: with the step left in flight the host
does two steps' work before it first waits on the device, and a first token reached its client ~1.1 ms late
(``perf/trace_server.py --simulate-device``: 1.75 ms from sampled to parsed, 0.68 ms with the hand-over). The wait
costs the device at most that long once per request, when nothing else is queued.

When the thread ends for any reason, every open stream gets :class:`EngineStopped`, so that
readers can wait on their events without polling the thread's liveness.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from ninfer.runtime.engine import Engine
from ninfer.runtime.request import Request, RequestOutput, Status

_Item = tuple[Callable[[Any], object], Any]  # a call to make on the event loop: fn(arg)
# The longest the engine thread waits for a first token's consumer (module docstring): a few times the loop's
# work for one token (~0.3 ms on a slow CPU), so a busy or absent consumer costs the device little.
HANDOVER_TIMEOUT_S = 1e-3


class EngineStopped(RuntimeError):
    """The engine thread ended while the request was open."""


class _Mailbox:
    """Calls for one event loop, posted by the engine thread and run on the loop in posting order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[_Item] = []
        self._lock = threading.Lock()

    def post(self, items: Iterable[_Item]) -> None:
        """Engine thread: queue ``items``; wake the loop only if no earlier batch is still waiting for it."""
        with self._lock:
            wake = not self._items
            self._items.extend(items)
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody is left to read these
                with self._lock:
                    self._items.clear()

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for fn, arg in items:
            fn(arg)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}  # one per loop that submits (the server's)
        self._streams: dict[str, tuple[_Mailbox, asyncio.Queue]] = {}
        self._admissions: dict[str, tuple[_Mailbox, Request, asyncio.Future]] = {}
        self._stopped = threading.Event()
        self._ended = False  # the thread has left its loop; set before open streams are failed
        self.last_error: Exception | None = None
        # Posts waiting for the engine's next launch (see the module docstring), per loop, in order.
        self._held: dict[_Mailbox, list[_Item]] = {}
        self._overlap = bool(getattr(engine, "launches_async", False))
        self._handover = threading.Condition()
        self._awaiting: set[str] = set()  # requests whose first token the engine thread waits to see consumed
        engine.on_admit = self._admitted
        if self._overlap:
            engine.on_launched = self._flush
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)
        self._thread.start()

    def _mailbox(self) -> _Mailbox:
        loop = asyncio.get_running_loop()
        box = self._mailboxes.get(loop)
        if box is None:
            box = self._mailboxes[loop] = _Mailbox(loop)
        return box

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Submit ``req`` and yield its events until the finished one; cancels it if the caller stops early."""
        events: asyncio.Queue = asyncio.Queue()
        self._streams[req.request_id] = (self._mailbox(), events)
        if self._ended:  # registered too late for the thread's farewell
            self._streams.pop(req.request_id, None)
            raise EngineStopped("the engine thread has stopped")
        self._commands.put(("add", req))
        finished = False
        try:
            while True:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                self._consumed(req.request_id)
                if event.finished:
                    finished = True
                    return
        finally:
            self._consumed(req.request_id)
            if not finished:
                self.cancel(req.request_id)
            self._streams.pop(req.request_id, None)

    def _consumed(self, request_id: str) -> None:
        """Loop thread: the consumer of ``request_id``'s events asked for the next one (or closed the stream)."""
        if self._awaiting:
            with self._handover:
                self._awaiting.discard(request_id)
                if not self._awaiting:
                    self._handover.notify()

    def _hand_over(self) -> None:
        """Engine thread: wait (bounded) until the first tokens just posted have been consumed."""
        with self._handover:
            self._handover.wait_for(lambda: not self._awaiting, timeout=HANDOVER_TIMEOUT_S)
            self._awaiting.clear()

    def admission(self, req: Request) -> asyncio.Future:
        """A future set once the scheduler has taken ``req`` off its wait queue (or it ended there), so
        that the HTTP layer learns of the admission without polling the request's status. Cancel it
        when no longer wanted."""
        future = asyncio.get_running_loop().create_future()
        self._admissions[req.request_id] = (self._mailbox(), req, future)
        return future

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
            box, events = target
            self._flush({box: [(events.put_nowait, item)]})

    def _flush(self, batches: dict[_Mailbox, list[_Item]] | None = None) -> None:
        """Post what is held, then ``batches`` after it (a stream's events keep their order); one post per loop.
        Also ``Engine.on_launched``: the step's forward is queued, the engine thread is about to wait on it."""
        held, self._held = self._held, {}
        for box, items in (batches or {}).items():
            held.setdefault(box, []).extend(items)
        for box, items in held.items():
            box.post(items)

    def _admitted(self, req: Request) -> None:
        """Engine thread, mid-step: the scheduler has taken ``req``; tell its waiter during this step, not after
        it (at the step's launch when overlapping)."""
        entry = self._admissions.pop(req.request_id, None)
        if entry is not None:
            if self._overlap:
                self._held.setdefault(entry[0], []).append((_resolve, entry[2]))
            else:
                entry[0].post([(_resolve, entry[2])])

    def _publish(self, events: list[RequestOutput]) -> None:
        """A step's events, one post per event loop; the admission waits of requests that ended unadmitted go too.
        When overlapping, a step of plain decode tokens is held for the next step's launch; anything still held
        here was not flushed by a launch (the step ran no forward) and goes now."""
        batches: dict[_Mailbox, list[_Item]] = {}
        for request_id, (box, req, future) in list(self._admissions.items()):
            if req.status is not Status.WAITING:
                self._admissions.pop(request_id, None)
                batches.setdefault(box, []).append((_resolve, future))
        urgent = bool(batches)
        firsts = []
        for event in events:
            target = self._streams.get(event.request_id)
            if target is not None:
                box, stream = target
                batches.setdefault(box, []).append((stream.put_nowait, event))
                if self._overlap and self._urgent(event):
                    urgent = True
                    if not event.finished and self._first(event):  # a finished stream's consumer comes back early
                        firsts.append(event.request_id)
        in_flight = getattr(self.engine, "ahead", None) is not None
        if self._held or urgent or in_flight or not self._overlap or not self.engine.has_work:
            if firsts:
                with self._handover:  # before the post: the loop may consume at once
                    self._awaiting.update(firsts)
            self._flush(batches)
            if firsts:
                self._hand_over()
        else:
            self._held = batches

    def _urgent(self, event: RequestOutput) -> bool:
        """A finished event or a request's first tokens: a client is waiting on exactly this one."""
        return event.finished or self._first(event)

    def _first(self, event: RequestOutput) -> bool:
        """The event carries the request's first tokens (or the request has already left the engine)."""
        req = self.engine.requests.get(event.request_id)
        return req is None or len(req.output_ids) <= len(event.token_ids)

    def _handle(self, kind: str, arg: Any) -> None:
        if kind == "add":
            try:
                self.engine.add_request(arg)
            except Exception as err:  # admission errors go back to the submitter, the engine keeps running
                self._admissions.pop(arg.request_id, None)
                self._deliver(arg.request_id, err)
        elif kind == "cancel":
            event = self.engine.cancel(arg)
            if event is not None:
                self._deliver(arg, event)
        elif kind == "call":
            arg(self.engine)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._ended = True
            for request_id in list(self._streams):
                self._deliver(request_id, EngineStopped("the engine thread has stopped"))

    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                # Idle: sleep on the queue itself, without a timeout, so a new request wakes the thread at once.
                kind, arg = self._commands.get(block=not self.engine.has_work, timeout=None)
                self._handle(kind, arg)
                while True:  # drain everything queued before the next step
                    kind, arg = self._commands.get_nowait()
                    self._handle(kind, arg)
            except queue.Empty:
                pass
            events: list[RequestOutput] = []
            if self.engine.has_work:
                try:
                    events = self.engine.step()
                except Exception as err:  # Engine.step isolates faults itself; this nets any step that still raises
                    events = self._fail_all(err)
            self._publish(events)

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
