"""Media work of server requests on a small thread pool of its own, cancelled with its request.

Fetching, decoding and preprocessing a request's media can take up to the fetch deadline per URL.
On asyncio's default executor a few slow URLs would occupy every worker and delay the text
requests that tokenize there too; :class:`MediaJobs` keeps them on ``media_workers`` threads of
their own. :meth:`MediaJobs.run` cancels a job's fetches (their sockets are shut down) when its
request goes away: the awaiting task is cancelled, or the ``gone`` future (a disconnect watcher)
completes first.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

from ninfer.vision.fetch import CancelToken, cancellable
from ninfer.vision.media import FetchCancelled

T = TypeVar("T")


class MediaJobs:
    """A bounded pool for media work; jobs past ``workers`` wait for a free thread."""

    def __init__(self, workers: int = 4) -> None:
        if workers < 1:
            raise ValueError(f"media_workers must be at least 1, got {workers}")
        self.workers = workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:  # created on first use: a pipeline that never serves has no threads
            self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="ninfer-media")
        return self._pool

    async def run(self, fn: Callable[[], T], gone: asyncio.Future[Any] | None = None) -> T:
        """``fn()`` on the pool; raises ``FetchCancelled`` (and stops its fetches) when ``gone`` completes
        first, and stops them too when the awaiting task is cancelled."""
        token = CancelToken()

        def job() -> T:
            with cancellable(token):
                return fn()
        future = asyncio.get_running_loop().run_in_executor(self._executor(), job)
        waits: set[asyncio.Future[Any]] = {future} if gone is None else {future, gone}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            token.cancel()
            future.cancel()  # not started yet: never starts
            raise
        if future.done():
            return future.result()
        token.cancel()
        future.cancel()
        future.add_done_callback(_consume)  # the job ends with FetchCancelled, which nobody awaits
        raise FetchCancelled("the request went away while its media were fetched")

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
