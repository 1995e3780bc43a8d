"""Helpers of the API tests: real uvicorn servers on 127.0.0.1, and a scripted engine.

``serve(llm, config, engine=None)`` starts uvicorn in a background thread on a free port and stops it
afterwards.
``ScriptedEngine`` stands in for ``AsyncEngine`` at the engine boundary: every request gets the
same scripted events (already split into reasoning and content, as the engine's output does),
which is how tool calls, which the random model never writes, reach the protocol renderers.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
import uvicorn

from ninfer.api import ServerConfig, create_app
from ninfer.runtime.request import Request, RequestOutput, Status


@dataclass
class Server:
    url: str
    app: Any
    llm: Any

    @property
    def service(self) -> Any:
        return self.app.state.service

    def openai(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0,
                             timeout=60, **kw)

    def anthropic(self, **kw: Any) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=kw.pop("api_key", "unused"), max_retries=0,
                                   timeout=60, **kw)


@contextlib.contextmanager
def serve(llm: Any, config: ServerConfig | None = None, engine: Any = None, **app_kw: Any) -> Iterator[Server]:
    """``app_kw``: create_app's keywords (served_model_names, chat_template, strict_model_names, access_log)."""
    app = create_app(llm, config or ServerConfig(default_max_tokens=8), engine=engine, **app_kw)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio sets TCP_NODELAY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield Server(f"http://127.0.0.1:{port}", app, llm)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def wait_idle(llm: Any, timeout: float = 10.0) -> None:
    """Wait until the engine holds no request and every lane, page and slot is free again (but those
    the prefix cache keeps)."""
    engine = llm.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.is_idle():
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: running={len(engine.scheduler.running)} "
                         f"waiting={len(engine.scheduler.waiting)} free_pages={engine.pages.num_free}")


@dataclass
class ScriptedEngine:
    """The ``AsyncEngine`` interface over a fixed script: ``pieces`` are (reasoning, text) deltas."""

    llm: Any
    pieces: list[tuple[str, str]] = field(default_factory=list)
    finish_reason: str = "stop"
    queue_s: float = 0.0  # time a request stays WAITING before it is admitted
    prefill_s: float = 0.0  # time from admission to the first event
    step_s: float = 0.0  # time between events
    cancelled: list[str] = field(default_factory=list)
    logprobs: bool = False

    @property
    def engine(self) -> Any:
        return self.llm.engine

    async def generate(self, req: Request):
        await asyncio.sleep(self.queue_s)
        req.status = Status.RUNNING
        await asyncio.sleep(self.prefill_s)
        req.first_token_time = time.perf_counter()
        for i, (reasoning, text) in enumerate(self.pieces):
            lp = [(7, -0.5, [(7, -0.5), (8, -1.5)])] if self.logprobs else None
            yield RequestOutput(req.request_id, [100 + i], text=text, reasoning=reasoning, logprobs=lp)
            await asyncio.sleep(self.step_s)
        req.status = Status.FINISHED
        yield RequestOutput(req.request_id, [], finished=True, finish_reason=self.finish_reason)

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def call(self, fn: Any) -> None:
        fn(self.llm.engine)

    def shutdown(self) -> None:
        pass
