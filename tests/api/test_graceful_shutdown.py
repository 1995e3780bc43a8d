"""SIGTERM to a real ``ninfer serve``: open streams of every protocol end with their terminal events, a
non-streamed answer is truncated, a request still queued gets 503, and the process exits 0.

The checkpoint is the tiny dense model with its stop tokens' LM-head rows zeroed, so that greedy decoding
never ends a stream by itself: every stream below is still running when the signal comes and must be
ended by the shutdown deadline.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file
from tiny_checkpoints import IDS, make_dense

ROOT = Path(__file__).resolve().parents[2]
SHUTDOWN_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def endless_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_dense(tmp_path_factory.mktemp("endless")).path
    weights = load_file(path / "model.safetensors")
    for token in ("<|im_end|>", "<|endoftext|>"):  # logit 0 never beats the largest of 500 random logits
        weights["lm_head.weight"][IDS[token]] = 0.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stream:
    """One streamed request read to its end on a thread: its SSE (event, data) pairs, or its error."""

    url: str
    body: dict
    frames: list[tuple[str | None, str]] = field(default_factory=list)
    error: BaseException | None = None
    started: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        event = None
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=60) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():  # a body cut mid-chunk raises httpx.RemoteProtocolError
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: "):
                        self.frames.append((event, line[6:]))
                        event = None
                        if len(self.frames) >= 3:
                            self.started.set()
        except BaseException as err:  # noqa: BLE001 - reported by the test
            self.error = err
        finally:
            self.started.set()


@dataclass
class Answer:
    """One non-streamed request on a thread: its response, or its error."""

    url: str
    body: dict
    response: httpx.Response | None = None
    error: BaseException | None = None

    def run(self) -> None:
        try:
            self.response = httpx.post(self.url, json=self.body, timeout=60)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            self.error = err


def _gauge(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def _wait_for(predicate, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _wait_healthy(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)


def test_sigterm_ends_every_stream_with_its_terminal_event_and_exits_0(endless_ckpt: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.api.cli", "serve", str(endless_ckpt), "--port", str(port),
                             "--device", "cpu", "--max-context", "4096", "--max-concurrency", "4", "--greedy",
                             "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--log-level", "info"],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        _wait_healthy(proc, url)
        messages = [{"role": "user", "content": "Hi"}]
        streams = [Stream(url + "/v1/chat/completions", {"model": "m", "stream": True, "max_tokens": 3000,
                                                         "messages": messages}),
                   Stream(url + "/v1/messages", {"model": "m", "stream": True, "max_tokens": 3000,
                                                 "messages": messages}),
                   Stream(url + "/v1/responses", {"model": "m", "stream": True, "max_output_tokens": 3000,
                                                  "input": "Hi"})]
        running = Answer(url + "/v1/chat/completions", {"model": "m", "max_tokens": 3000, "messages": messages})
        queued = Answer(url + "/v1/chat/completions", {"model": "m", "max_tokens": 3000, "messages": messages})
        threads = [threading.Thread(target=s.run, daemon=True) for s in streams]
        for t in threads:
            t.start()
        for s in streams:
            assert s.started.wait(60) and s.error is None, s.error
        threads.append(threading.Thread(target=running.run, daemon=True))
        threads[-1].start()
        _wait_for(lambda: _gauge(url, "ninfer_requests_running") == 4, "four requests in lanes")
        threads.append(threading.Thread(target=queued.run, daemon=True))
        threads[-1].start()
        _wait_for(lambda: _gauge(url, "ninfer_http_requests_in_flight") == 5, "a fifth request in the queue")
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # uvicorn closes the listener at once; a request that still got in would be a 503
        try:
            late = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages}, timeout=5)
            assert late.status_code == 503 and "retry-after" in late.headers
        except httpx.TransportError:
            pass
        for t in threads:
            t.join(timeout=30)
        rc = proc.wait(timeout=30)
        elapsed = time.monotonic() - sent
        log = proc.stdout.read().decode() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert rc == 0, log
    assert elapsed < SHUTDOWN_TIMEOUT_S + 10, f"took {elapsed:.1f} s to exit"
    for s in streams:
        assert s.error is None, (s.url, repr(s.error))
    assert log.count(" interrupted: ") == 4, log  # every admitted request ran until the deadline

    assert running.error is None and running.response is not None and running.response.status_code == 200
    answer = running.response.json()
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] > 0
    assert queued.error is None and queued.response is not None and queued.response.status_code == 503
    assert queued.response.json()["error"]["code"] == "server_shutting_down"
    assert queued.response.headers["retry-after"] == "5"

    chat, anth, resp = streams
    assert chat.frames[-1] == (None, "[DONE]")
    finish = json.loads(chat.frames[-2][1])["choices"][0]
    assert finish["finish_reason"] == "length" and finish["delta"] == {}

    assert [e for e, _ in anth.frames[-2:]] == ["message_delta", "message_stop"]
    assert json.loads(anth.frames[-2][1])["delta"]["stop_reason"] == "max_tokens"
    assert anth.frames[-3][0] == "content_block_stop"

    event, data = resp.frames[-1]
    assert event == "response.incomplete"
    final = json.loads(data)["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}

