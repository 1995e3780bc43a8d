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


class FakeEngineBase:
    """What every fake engine shares: the queue of waiting requests, the request table, no-op cancels."""

    waiting: list[Request]
    requests: dict[str, Request]

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)
        self.requests[req.request_id] = req

    def cancel(self, request_id: str) -> RequestOutput | None:
        return None


class ScriptedEngine(FakeEngineBase):
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


class LaunchingEngine(FakeEngineBase):
    """A decoding engine on an 'asynchronous device': each step admits what waits, queues its forward once
    ``gate`` allows (then reports it: ``on_launched``), and ends once ``gate`` allows again (the device is
    done), with one token per request; a request finishes after ``tokens`` tokens."""

    launches_async = True

    def __init__(self, tokens: int = 3) -> None:
        self.tokens = tokens
        self.waiting: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.on_admit: Any = None
        self.on_launched: Any = None
        self.gate = threading.Semaphore(0)  # two releases per step: its launch, then its end
        self.steps = 0  # steps begun

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        for req in self.waiting:
            req.status = Status.RUNNING
            self.on_admit(req)
        self.running += self.waiting
        self.waiting = []
        assert self.gate.acquire(timeout=BOUND_S)
        self.on_launched()
        assert self.gate.acquire(timeout=BOUND_S)
        events = []
        for req in list(self.running):
            req.output_ids.append(len(req.output_ids))
            done = len(req.output_ids) == self.tokens
            events.append(RequestOutput(req.request_id, [req.output_ids[-1]], text=f"t{len(req.output_ids)}",
                                        finished=done, finish_reason="length" if done else None))
            if done:
                self.running.remove(req)
                self.requests.pop(req.request_id)
        return events


async def _pending(future: asyncio.Future, wait_s: float = 0.2) -> bool:
    """True if ``future`` is still pending after ``wait_s`` (a hand-over that is held)."""
    await asyncio.wait({future}, timeout=wait_s)
    return not future.done()


def test_overlap_holds_decode_tokens_until_the_next_launch_but_not_first_or_last(recording: Any) -> None:
    engine = LaunchingEngine(tokens=3)
    ae = recording(engine)

    async def run() -> list[str]:
        req = _request()
        admitted = ae.admission(req)
        events = ae.generate(req)
        first = asyncio.ensure_future(events.__anext__())  # submits the request
        assert await _pending(admitted)  # admitted, but its forward is not queued yet
        engine.gate.release()  # step 1 launches: the admission goes with it, before the step ends
        await asyncio.wait_for(admitted, BOUND_S)
        assert await _pending(first)
        engine.gate.release()  # step 1 ends: the request's first token is handed over at once
        texts = [(await asyncio.wait_for(first, BOUND_S)).text]
        second = asyncio.ensure_future(events.__anext__())
        engine.gate.release()
        engine.gate.release()  # step 2 launches and ends: a decode token, held for the next launch
        assert await _pending(second)
        engine.gate.release()  # step 3 launches: step 2's token goes with it
        texts.append((await asyncio.wait_for(second, BOUND_S)).text)
        third = asyncio.ensure_future(events.__anext__())
        engine.gate.release()  # step 3 ends: the finished event goes at once
        last = await asyncio.wait_for(third, BOUND_S)
        assert last.finished
        return texts + [last.text]
    assert asyncio.run(run()) == ["t1", "t2", "t3"]
    assert not ae._held and not ae._admissions


def test_tokens_go_at_once_while_a_decode_step_is_left_in_flight(recording: Any) -> None:
    """With a step in flight the device stays busy whatever the loop does: a decode token is not held."""
    engine = LaunchingEngine(tokens=3)
    engine.ahead = object()
    ae = recording(engine)

    async def run() -> str:
        events = ae.generate(_request())
        first = asyncio.ensure_future(events.__anext__())
        engine.gate.release()
        engine.gate.release()
        await asyncio.wait_for(first, BOUND_S)
        second = asyncio.ensure_future(events.__anext__())
        engine.gate.release()
        engine.gate.release()  # step 2 ends: its token goes now, not at step 3's launch
        token = (await asyncio.wait_for(second, BOUND_S)).text
        engine.gate.release()
        engine.gate.release()
        async for _ in events:
            pass
        return token
    assert asyncio.run(asyncio.wait_for(run(), BOUND_S)) == "t2"


def test_a_step_without_launch_still_hands_its_held_tokens_over(recording: Any) -> None:
    engine = LaunchingEngine(tokens=4)
    ae = recording(engine)
    launched = engine.on_launched
    launches = iter([True, True, False, True])  # step 3 runs no forward (reports no launch)
    engine.on_launched = lambda: launched() if next(launches) else None

    async def run() -> list[str]:
        events = ae.generate(_request())
        texts = [(await anext_after(events, 2)).text]
        texts.append((await anext_after(events, 4)).text)  # step 2's token: posted at step 3's end
        texts += [e.text async for e in _released(events, engine)]
        return texts

    async def anext_after(events: Any, releases: int) -> RequestOutput:
        nxt = asyncio.ensure_future(events.__anext__())
        for _ in range(releases):
            engine.gate.release()
        return await asyncio.wait_for(nxt, BOUND_S)

    async def _released(events: Any, engine: LaunchingEngine) -> Any:
        engine.gate.release()
        engine.gate.release()
        async for e in events:
            yield e
    assert asyncio.run(asyncio.wait_for(run(), BOUND_S)) == ["t1", "t2", "t3", "t4"]


async def _until(condition: Any) -> None:
    """Wait (bounded) for ``condition()`` to hold, looking again every few milliseconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BOUND_S
    while not condition():
        assert loop.time() < deadline
        await asyncio.sleep(0.005)


def test_the_engine_thread_waits_until_a_first_token_is_consumed(recording: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On an asynchronous device the engine thread gives the loop a request's first token before its next step
    (the consumer asks for the next event: the token has gone to the client)."""
    monkeypatch.setattr(async_engine, "HANDOVER_TIMEOUT_S", BOUND_S)
    engine = LaunchingEngine(tokens=3)
    ae = recording(engine)

    async def run() -> list[str]:
        events = ae.generate(_request())
        first = asyncio.ensure_future(events.__anext__())
        for _ in range(4):  # step 1 launches and ends; step 2 may launch and end
            engine.gate.release()
        texts = [(await asyncio.wait_for(first, BOUND_S)).text]
        await asyncio.sleep(0.2)
        assert engine.steps == 1 and ae._awaiting  # the engine thread waits for the consumer's next read
        engine.gate.release()
        engine.gate.release()  # step 3
        texts += [e.text async for e in events]  # the next read lets it go on
        return texts
    assert asyncio.run(asyncio.wait_for(run(), BOUND_S)) == ["t1", "t2", "t3"]
    assert engine.steps == 3 and not ae._awaiting


def test_a_consumer_that_does_not_come_back_holds_the_engine_only_briefly(recording: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(async_engine, "HANDOVER_TIMEOUT_S", 0.01)
    engine = LaunchingEngine(tokens=3)
    ae = recording(engine)

    async def run() -> list[str]:
        events = ae.generate(_request())
        first = asyncio.ensure_future(events.__anext__())
        for _ in range(6):  # steps 1 and 2; step 3 launches
            engine.gate.release()
        texts = [(await asyncio.wait_for(first, BOUND_S)).text]
        await _until(lambda: engine.steps == 3)  # the engine went on without the consumer
        assert not ae._awaiting
        engine.gate.release()
        texts += [e.text async for e in events]
        return texts
    assert asyncio.run(asyncio.wait_for(run(), BOUND_S)) == ["t1", "t2", "t3"]


def test_the_engine_reports_each_forward_queued_before_it_waits_for_the_tokens(dense_ckpt: Any) -> None:
    import ninfer

    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, prefix_cache=False, progress=False)
    engine, order = llm.engine, []
    assert not engine.launches_async  # CPU: nothing to overlap, the server hands over at once
    sample = engine.sampler.sample
    engine.sampler.sample = lambda logits, reqs: (order.append("sample"), sample(logits, reqs))[1]
    engine.on_launched = lambda: order.append("launched")
    llm.generate(["hello there", "a second prompt"], max_new_tokens=3, greedy=True)
    assert order and order.count("launched") >= order.count("sample")
    assert all(order[i - 1] == "launched" for i, x in enumerate(order) if x == "sample")
