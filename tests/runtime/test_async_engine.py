"""AsyncEngine over a scripted engine: how the engine thread wakes, and how events cross to the loop.

Nothing here asserts on durations: waits have generous bounds only so that a broken mechanism
fails instead of hanging.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from ninfer.runtime import async_engine
from ninfer.runtime.async_engine import AsyncEngine, EngineStopped
from ninfer.runtime.request import Request, RequestOutput, Status
from ninfer.runtime.sampling import SamplingParams

BOUND_S = 30.0


class RecordingQueue(queue.Queue):
    """The command queue, recording how the engine thread waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocking_gets: list[float | None] = []  # the timeout of each blocking get
        self.parked = threading.Event()  # set while a blocking get waits

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if block:
            self.blocking_gets.append(timeout)
            self.parked.set()
        try:
            return super().get(block, timeout)
        finally:
            self.parked.clear()


class ScriptedEngine:
    """The Engine surface AsyncEngine drives. A step admits every waiting request (``on_admit`` first),
    optionally holds until ``release`` is set (a long prefill), then finishes them all at once."""

    def __init__(self, batch: int = 1, hold: bool = False) -> None:
        self.batch = batch  # work starts once this many requests are queued
        self.waiting: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.on_admit: Any = None
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.broken = False

    @property
    def has_work(self) -> bool:
        if self.broken:
            raise RuntimeError("a bug in the engine loop")
        return len(self.waiting) >= self.batch

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)
        self.requests[req.request_id] = req

    def cancel(self, request_id: str) -> RequestOutput | None:
        return None

    def step(self) -> list[RequestOutput]:
        admitted, self.waiting = self.waiting, []
        for req in admitted:
            req.status = Status.RUNNING
            if self.on_admit is not None:
                self.on_admit(req)
        assert self.release.wait(BOUND_S)
        if self.broken:  # the step ends without events; the loop's next look at the engine raises
            return []
        for req in admitted:
            req.status = Status.FINISHED
            self.requests.pop(req.request_id)
        return [RequestOutput(r.request_id, [7], text="x", finished=True, finish_reason="stop") for r in admitted]


def _request() -> Request:
    return Request(prompt_ids=[1, 2, 3], params=SamplingParams(), max_new_tokens=1)


@pytest.fixture()
def recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Build AsyncEngines whose command queue records the engine thread's waits."""
    engines: list[AsyncEngine] = []

    def make(engine: ScriptedEngine) -> AsyncEngine:
        with monkeypatch.context() as m:
            m.setattr(async_engine.queue, "Queue", RecordingQueue)
            ae = AsyncEngine(engine)  # type: ignore[arg-type]
        engines.append(ae)
        return ae
    yield make
    for ae in engines:
        ae.shutdown()


def test_a_request_submitted_while_idle_wakes_the_engine_thread_at_once(recording: Any) -> None:
    engine = ScriptedEngine()
    ae = recording(engine)
    commands: RecordingQueue = ae._commands  # type: ignore[assignment]
    assert commands.parked.wait(BOUND_S)  # idle: the thread sleeps on the command queue

    async def run() -> list[RequestOutput]:
        return [event async for event in ae.generate(_request())]
    events = asyncio.run(asyncio.wait_for(run(), BOUND_S))

    assert [e.finished for e in events] == [True]
    # Every sleep was a blocking get without a timeout: the submission itself woke the thread, no poll did.
    assert commands.blocking_gets and all(t is None for t in commands.blocking_gets)


def test_admission_is_reported_during_the_step_not_after_it(recording: Any) -> None:
    engine = ScriptedEngine(hold=True)
    ae = recording(engine)

    async def run() -> None:
        req = _request()
        admitted = ae.admission(req)
        events = ae.generate(req)
        first = asyncio.ensure_future(events.__anext__())
        await asyncio.wait_for(admitted, BOUND_S)  # resolves while the step still holds (a long prefill)
        assert req.status is Status.RUNNING and not first.done()
        engine.release.set()
        assert (await asyncio.wait_for(first, BOUND_S)).finished
        await events.aclose()
    asyncio.run(run())
    assert not ae._admissions


def test_the_events_of_one_step_cross_to_the_loop_in_one_wake_up(recording: Any) -> None:
    n = 3
    ae = recording(ScriptedEngine(batch=n))  # the step runs once all n requests are queued

    async def run() -> tuple[list[list[RequestOutput]], int]:
        loop = asyncio.get_running_loop()
        wakes = 0
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal wakes
            wakes += 1
            return call_soon_threadsafe(*args, **kwargs)
        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]

        async def one() -> list[RequestOutput]:
            return [event async for event in ae.generate(_request())]
        streams = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(n))), BOUND_S)
        return streams, wakes
    streams, wakes = asyncio.run(run())

    assert [[e.finished for e in s] for s in streams] == [[True]] * n
    assert wakes == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's end, on purpose
def test_open_streams_fail_when_the_engine_thread_ends(recording: Any) -> None:
    engine = ScriptedEngine(hold=True)
    ae = recording(engine)

    async def run() -> None:
        events = ae.generate(_request())
        first = asyncio.ensure_future(events.__anext__())
        while not engine.waiting and not engine.requests:  # the engine thread has taken the request
            await asyncio.sleep(0.01)
        engine.broken = True  # the thread ends after this step
        engine.release.set()
        with pytest.raises(EngineStopped):
            await asyncio.wait_for(first, BOUND_S)
        with pytest.raises(EngineStopped):  # a request submitted afterwards fails at once
            await asyncio.wait_for(ae.generate(_request()).__anext__(), BOUND_S)
    asyncio.run(run())
    ae._thread.join(BOUND_S)
    assert not ae.alive
