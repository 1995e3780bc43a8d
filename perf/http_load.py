"""The HTTP side of ``perf/bench_server.py`` (and ``perf/trace_server.py``): the server in-process (uvicorn on a
loopback port, the engine on its own thread, as ``ninfer serve`` runs it) and the asyncio load generator
that streams chat completions from it, by default in its own process."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Self


@dataclass
class Sample:
    ttft_s: float
    decode_tok_s: float
    tokens: int
    total_s: float = 0.0  # send (library: creation) to the last token
    sent_s: float = 0.0  # HTTP: when the client sent it, from the start of the level's run


class InProcessServer:
    """``create_app(llm)`` under uvicorn on 127.0.0.1:<free port>, in a background thread."""

    def __init__(self, llm: Any, max_pending: int, max_tokens: int) -> None:
        import uvicorn

        from ninfer.api import ServerConfig, create_app

        config = ServerConfig(model_id="bench", max_pending=max_pending, pending_timeout_ms=3_600_000,
                              default_max_tokens=max_tokens, thinking=False)
        self.app = create_app(llm, config)
        # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets (proto 0 would leave Nagle on,
        # and small SSE writes on a reused connection would wait for delayed ACKs, ~40 ms)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.sock.close()


async def one_http(client: Any, url: str, text: str, max_tokens: int, t0: float) -> Sample:
    body = {"model": "bench", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "enable_thinking": False}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                elif choice.get("finish_reason") is not None:
                    last = time.perf_counter()
    if first is None:
        raise RuntimeError("the stream carried no token delta")
    decode = (last or first) - first
    return Sample(first - start, (tokens - 1) / decode if decode > 0 and tokens > 1 else 0.0, tokens,
                  (last or first) - start, start - t0)


async def run_http(url: str, texts: list[str], concurrency: int, max_tokens: int) -> list[Sample]:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def bounded(text: str) -> Sample:
            async with gate:
                return await one_http(client, url, text, max_tokens, t0)
        return list(await asyncio.gather(*(bounded(t) for t in texts)))


def _client_main(conn: Any) -> None:
    """The load generator's own process: (url, texts, concurrency, max_tokens) in, sample tuples out."""
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            conn.send([tuple(vars(x).values()) for x in asyncio.run(run_http(*job))])
        except Exception as err:  # noqa: BLE001 - reported in the parent
            conn.send(err)


class Client:
    """Runs the load generator in a separate process (default), so that client-side JSON parsing does
    not compete for the server's GIL; ``in_process=True`` runs it on this process's event loop."""

    def __init__(self, in_process: bool = False) -> None:
        self.proc = None
        if not in_process:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_client_main, args=(child,), daemon=True)
            self.proc.start()

    def run(self, url: str, texts: list[str], concurrency: int, max_tokens: int) -> list[Sample]:
        if self.proc is None:
            return asyncio.run(run_http(url, texts, concurrency, max_tokens))
        self.conn.send((url, texts, concurrency, max_tokens))
        result = self.conn.recv()
        if isinstance(result, Exception):
            raise result
        return [Sample(*row) for row in result]

    def close(self) -> None:
        if self.proc is not None:
            self.conn.send(None)
            self.proc.join(timeout=30)
