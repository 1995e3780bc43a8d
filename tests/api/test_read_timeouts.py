"""Read timeouts (``ninfer.api.timeouts``): raw sockets on loopback against uvicorn with the guarded protocol."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from ninfer.api.timeouts import guarded_h11

HEADER_S, BODY_S = 0.6, 0.6
disconnects: list[str] = []


async def echo_length(scope, receive, send) -> None:
    """Reads the whole body and answers its length; notes a client that left before the body was in."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/early":  # answers before the body is in, like a 413 on an oversized body
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            disconnects.append(scope["path"])
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(size).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(echo_length, log_level="warning", lifespan="off", http=guarded_h11(HEADER_S, BODY_S))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@contextlib.contextmanager
def connect(port: int) -> Iterator[socket.socket]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        yield s


def read_until_closed(s: socket.socket, limit_s: float = 5.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (bounded)."""
    start, data = time.monotonic(), b""
    s.settimeout(limit_s)
    while time.monotonic() - start < limit_s:
        try:
            chunk = s.recv(4096)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - start


def test_partial_headers_get_408_and_are_closed_in_time(port: int) -> None:
    with connect(port) as s:
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n")
        data, elapsed = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 408 ")
    assert HEADER_S * 0.8 <= elapsed < HEADER_S + 2


def test_trickled_headers_are_bounded_in_total(port: int) -> None:
    """Each header line in time is not enough: the whole head must arrive within the timeout."""
    with connect(port) as s:
        start = time.monotonic()
        for i in range(8):  # 8 x 0.2 s > the 0.6 s header timeout; bounded either way
            try:
                s.sendall(b"x-h%d: 1\r\n" % i if i else b"GET / HTTP/1.1\r\nHost: x\r\n")
            except OSError:
                break
            time.sleep(0.2)
        data, _ = read_until_closed(s)
        elapsed = time.monotonic() - start
    assert data.startswith(b"HTTP/1.1 408 ") and elapsed < HEADER_S + 3


def test_a_connection_that_sends_nothing_is_closed(port: int) -> None:
    with connect(port) as s:
        data, elapsed = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 408 ") and elapsed < HEADER_S + 2


def test_a_stalled_body_is_closed_and_the_app_sees_the_disconnect(port: int) -> None:
    disconnects.clear()
    with connect(port) as s:
        s.sendall(b"POST /stalled HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        data, elapsed = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 408 ") and BODY_S * 0.8 <= elapsed < BODY_S + 2
    deadline = time.monotonic() + 5
    while "/stalled" not in disconnects and time.monotonic() < deadline:
        time.sleep(0.01)
    assert disconnects == ["/stalled"]


def test_a_slow_but_steady_body_is_served(port: int) -> None:
    """The body timeout bounds the gap between bytes, not the upload: 2 s of body in 0.25 s steps pass."""
    with connect(port) as s:
        s.sendall(b"POST /steady HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\nConnection: close\r\n\r\n")
        for _ in range(8):
            time.sleep(0.25)
            s.sendall(b"y")
        data, _ = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"\r\n\r\n8")


def test_kept_alive_connection_is_guarded_again_for_its_next_request(port: int) -> None:
    with connect(port) as s:
        s.sendall(b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        first = b""
        while not first.endswith(b"\r\n\r\n0"):  # the whole first response (its body is "0"), bounded by the timeout
            first += s.recv(4096)
        assert first.startswith(b"HTTP/1.1 200 ")
        s.sendall(b"GET /two HTTP/1.1\r\nHo")  # the keep-alive timeout (5 s) is longer than the header one
        data, elapsed = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 408 ") and elapsed < HEADER_S + 2


def test_a_normal_request_is_not_affected(port: int) -> None:
    with connect(port) as s:
        s.sendall(b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc")
        data, _ = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"3")


def test_a_stalled_body_after_an_early_answer_is_closed_without_a_second_response(port: int) -> None:
    with connect(port) as s:
        s.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        data, elapsed = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 413 ") and b"408" not in data and elapsed < BODY_S + 2
