"""Media fetches of a real server (``ninfer serve --vision``): they stop when the client disconnects,
slow ones cannot starve text requests, and their errors do not tell what is behind an address.

The server runs on loopback with the private-media opt-in and an allowlist of 127.0.0.1, so the
loopback listeners of ``fetch_helpers`` can stand in for remote media servers.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))  # api_testing (not a package)

from api_testing import Server, serve
from fetch_helpers import Listener

import ninfer
from ninfer.api import ServerConfig
from ninfer.vision import VisionLimits

WORKERS = 2


@pytest.fixture(scope="module")
def vserver(vision_setup) -> Iterator[Server]:
    limits = VisionLimits(allow_private_media=True, media_allowed_hosts=("127.0.0.1",), fetch_timeout_s=30.0,
                          media_workers=WORKERS)
    llm = ninfer.load(vision_setup.ckpt.path, device="cpu", vision=True, max_concurrency=2, prefill_chunk=32,
                      progress=False, vision_limits=limits)
    with serve(llm, ServerConfig(default_max_tokens=2, model_id="tiny-vl")) as s:
        yield s


def _chat(url: str) -> dict:
    return {"model": "tiny-vl", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]}


def _raw_post(server: Server, path: str, body: dict) -> socket.socket:
    """A request sent on a socket that stays open (the client waits) until the test closes it."""
    port = int(server.url.rsplit(":", 1)[1])
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
    return sock


def _wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_disconnected_client_stops_its_fetch(vserver: Server) -> None:
    with Listener(mode="trickle", interval=0.2, lifetime_s=40) as slow:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(vserver.url + "/v1/chat/completions", json=_chat(slow.url + "/a.png"), timeout=1.0)
        gone = time.monotonic()
        assert _wait_for(lambda: slow.closed_at, 5.0), "the fetch went on after its client left"
        assert slow.closed_at[0] - gone < 3.0 and slow.accepts == 1  # not at the 30 s deadline
    with Listener(body=(Path(__file__).parent / "vision_helpers.py").read_bytes()) as ok:  # still serving
        r = httpx.post(vserver.url + "/v1/chat/completions", json=_chat(ok.url + "/a.png"), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_media"
        assert "cannot decode the image" in r.json()["error"]["message"] and ok.accepts == 1


def test_slow_fetches_do_not_delay_text_requests(vserver: Server) -> None:
    default_workers = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor
    clients: list[socket.socket] = []
    with Listener(mode="trickle", interval=0.5, lifetime_s=60) as slow:
        try:
            for _ in range(default_workers + 2):  # more than every default worker and every media worker
                clients.append(_raw_post(vserver, "/v1/chat/completions", _chat(slow.url + "/a.png")))
            assert _wait_for(lambda: slow.accepts >= WORKERS, 10.0)
            time.sleep(0.3)
            assert slow.accepts == WORKERS  # the media pool bounds the fetches in flight
            long_text = {"model": "tiny-vl", "messages": [{"role": "user", "content": "word " * 3000}]}
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                start = time.monotonic()
                count = pool.submit(httpx.post, vserver.url + "/v1/messages/count_tokens", json=long_text,
                                    timeout=30)
                chat = pool.submit(httpx.post, vserver.url + "/v1/chat/completions", timeout=30,
                                   json={"model": "tiny-vl", "max_tokens": 2,
                                         "messages": [{"role": "user", "content": "hello"}]})
                counted, answered = count.result(), chat.result()
                took = time.monotonic() - start
            assert counted.status_code == 200 and counted.json()["input_tokens"] > 3000
            assert answered.status_code == 200 and took < 5.0, took
        finally:
            for sock in clients:
                sock.close()
        # The fetches stop with their clients; a queued one may start as a worker frees up before its
        # client's disconnect is seen, and then stops as soon as it is.
        time.sleep(1.0)
        assert _wait_for(lambda: len(slow.closed_at) == slow.accepts, 5.0), (slow.accepts, len(slow.closed_at))
        assert slow.accepts < len(clients)


def test_a_closed_port_and_a_refused_redirect_answer_alike(vserver: Server) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_url = f"http://127.0.0.1:{closed.getsockname()[1]}/a.png"
    closed.close()
    with Listener() as target, Listener(mode="redirect") as first:
        first.location = f"http://localhost:{target.port}/a.png"  # not in the allowlist
        bodies = []
        for url in (closed_url, first.url + "/a.png"):
            r = httpx.post(vserver.url + "/v1/chat/completions", json=_chat(url), timeout=30)
            assert r.status_code == 400
            bodies.append(json.dumps(r.json()).replace(url, "<url>"))
        assert bodies[0] == bodies[1] and "was not fetched" in bodies[0]
        assert target.accepts == 0 and first.accepts == 1
