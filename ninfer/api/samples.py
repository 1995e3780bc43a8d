"""The ``n`` samples of one prompt: sample 0 runs first, the others once it has prefilled.

Sample 0's first token shows that its prompt is prefilled and checkpointed by the prefix cache, so
the other samples submitted then start from that checkpoint instead of prefilling the prompt again
(as ``ninfer.LLM`` submits ``n``). Without a prefix cache they all start at once. Sample ``i > 0``
draws from a seed derived from ``(seed, i)`` (:func:`ninfer.api.sampling.sample_seed`). Each sample is
its own :class:`~ninfer.api.run.Run` (its own lane); closing :class:`Samples` cancels all that still run.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request as HTTPRequest

from ninfer.api.convert import engine_failure
from ninfer.api.errors import invalid
from ninfer.api.output import Collected, OutputStream
from ninfer.api.run import ClientGone, Run, watch_disconnect
from ninfer.api.sampling import sample_seed
from ninfer.api.structured import grammar_for
from ninfer.runtime.request import Request, RequestOutput

if TYPE_CHECKING:
    from ninfer.api.service import GenerationSpec, Service

MAX_SAMPLES = 64  # as ninfer.SamplingParams.n


def check_n(n: int | None, service: Service, param: str = "n") -> int:
    """``n`` in [1, min(64, lanes + queue places)]: the samples of one request must all fit the server."""
    n = 1 if n is None else n
    room = min(MAX_SAMPLES, service.lanes + service.config.max_pending)
    if not 1 <= n <= room:
        raise invalid(f"'{param}' must be in [1, {room}] (samples per request; this server has "
                      f"{service.lanes} lanes and {service.config.max_pending} queue places), got {n}", param)
    return n


async def sample_requests(service: Service, first: Request, spec: GenerationSpec) -> list[Request]:
    """``first`` and its ``spec.n - 1`` siblings: the same prompt and limits, derived seeds, own grammar states."""
    reqs = [first]
    for i in range(1, spec.n):
        params = dataclasses.replace(first.params, seed=sample_seed(first.params.seed, i))
        req = Request(prompt_ids=list(first.prompt_ids), params=params, max_new_tokens=first.max_new_tokens,
                      stop_token_ids=first.stop_token_ids, stop_strings=first.stop_strings, thinking=first.thinking, mm=first.mm,
                      rope_delta=first.rope_delta, checkpoint_marks=first.checkpoint_marks,
                      media_keys=first.media_keys)
        if spec.structured is not None:
            req.grammar = await grammar_for(service.llm, spec.structured, bool(first.thinking))
        reqs.append(req)
    return reqs


class Samples:
    """The runs of one request's samples, their events merged as ``(index, event)``. ``groups``: the sizes of
    consecutive runs of samples of one prompt (a batch of prompts; default: all of one prompt)."""

    def __init__(self, service: Service, reqs: list[Request], groups: list[int] | None = None) -> None:
        self.service, self.reqs = service, reqs
        self.runs: dict[int, Run] = {}
        self._tasks: list[asyncio.Task] = []
        self._followers: dict[int, list[int]] = {}  # a prompt's first sample -> the others
        first = 0
        for size in groups or [len(reqs)]:
            self._followers[first] = list(range(first + 1, first + size))
            first += size

    @property
    def n(self) -> int:
        return len(self.reqs)

    async def start(self, http: HTTPRequest | None) -> None:
        """Admit the first sample (429 / 503 / 400 are still HTTP statuses); the places of all are checked now."""
        self.runs[0] = await self.service.start(self.reqs[0], http, siblings=self.n - 1)

    def leaders(self) -> list[int]:
        """The index of each prompt's first sample."""
        return list(self._followers)

    async def events(self, http: HTTPRequest | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every sample's events until each has finished; with ``http``, a disconnect cancels all (ClientGone)."""
        if self.n == 1:  # the common case: no tasks in between
            async for event in self.runs[0].events(http):
                yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()
        waiting = dict(self._followers)
        if getattr(self.service.llm.engine, "prefix", None) is None:  # nothing to share: all at once
            waiting = {}
        self._tasks.append(asyncio.create_task(self._pump(0, queue)))
        self._start([i for i in self._followers if i != 0] + [j for i in self._followers if i not in waiting
                                                               for j in self._followers[i]], queue)
        watch = watch_disconnect(http)
        remaining = self.n
        try:
            while remaining:
                i, item = await self._next(queue, watch)
                if isinstance(item, BaseException):
                    raise item
                if i in waiting:
                    self._start(waiting.pop(i), queue)
                if item.finished:
                    remaining -= 1
                yield i, item
        finally:
            if watch is not None:
                watch.cancel()
            self.close()

    def _start(self, indices: list[int], queue: asyncio.Queue) -> None:
        for i in indices:
            self._tasks.append(asyncio.create_task(self._pump(i, queue)))

    async def _pump(self, i: int, queue: asyncio.Queue) -> None:
        try:
            run = self.runs.get(i)
            if run is None:
                run = self.runs[i] = self.service.open_sibling(self.reqs[i])
                run.log_id = f"{self.runs[0].log_id}/{i}"  # the log line names the HTTP request and the sample
                await run.admit(None)
            async for event in run.events():
                queue.put_nowait((i, event))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # APIError (a sibling's 429, engine failures): the merged stream raises it
            queue.put_nowait((i, err))

    @staticmethod
    async def _next(queue: asyncio.Queue, watch: asyncio.Task | None) -> tuple[int, Any]:
        if watch is None:
            return await queue.get()
        get = asyncio.ensure_future(queue.get())
        await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            raise ClientGone()
        return get.result()

    async def collect(self, outs: list[OutputStream], http: HTTPRequest | None = None) -> list[Collected]:
        """Run every sample to its end; an engine failure of any raises."""
        try:
            async for i, event in self.events(http):
                outs[i].push(event)
        finally:
            self.close()
        for out in outs:
            if (err := engine_failure(out.finish_reason, out.error)) is not None:
                raise err
        return [out.collected() for out in outs]

    def close(self) -> None:
        """Cancel every sample that still runs (idempotent, never awaits)."""
        for task in self._tasks:
            task.cancel()
        for run in self.runs.values():
            run.close()
