"""Mixed load through the server: concurrent streams, some abandoned by their clients, one whose request
hits an engine fault. Every other stream completes with its terminal event, nothing hangs, and the
engine's lanes, pages and slots are all free at the end."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from api_testing import Server, serve, wait_idle

import ninfer
from ninfer.api import ServerConfig
from ninfer.runtime.request import Request

FAULTY_MAX_TOKENS = 13  # how the test recognises the request it breaks
TIMEOUT = httpx.Timeout(60)


@pytest.fixture(scope="module")
def faulty(dense_ckpt) -> Iterator[Server]:
    """A real engine (4 lanes, each step slowed by 5 ms so that abandoned streams are surely mid-flight)
    whose detokenizer fails on the third token of any request with ``max_tokens == FAULTY_MAX_TOKENS``."""
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=4, progress=False)
    engine, make_output, step = llm.engine, llm.engine.make_output, llm.engine.step

    def make_faulty_output(req: Request):
        processor = make_output(req)
        if req.max_new_tokens == FAULTY_MAX_TOKENS:
            push, seen = processor.detok.push, []

            def push_then_fail(token: int) -> str:
                seen.append(token)
                if len(seen) == 3:
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
                return push(token)
            processor.detok.push = push_then_fail
        return processor

    def slow_step():
        time.sleep(0.005)
        return step()
    engine.make_output, engine.step = make_faulty_output, slow_step
    with serve(llm, ServerConfig(default_max_tokens=8, model_id="tiny")) as s:
        yield s


def _chat(i: int, max_tokens: int = 12) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"request number {i}"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}


def _openai_stream(server: Server, body: dict, keep: int | None = None) -> list[dict | str]:
    """The stream's data payloads (JSON objects, and the final "[DONE]"); ``keep``: stop reading after that
    many lines and close the connection (an abandoned stream)."""
    out: list[dict | str] = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for n, line in enumerate(r.iter_lines()):
            if keep is not None and n >= keep:
                break
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _text(payloads: list[dict | str]) -> str:
    return "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads
                   if isinstance(p, dict) and p.get("choices"))


def _anthropic_stream(server: Server, i: int) -> list[str]:
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"request number {i}"}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        return [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]


def test_mixed_load_with_abandoned_streams_and_an_engine_fault(faulty: Server) -> None:
    normal = list(range(5))
    reference = {i: _text(_openai_stream(faulty, _chat(i))) for i in normal}  # one at a time, no fault
    wait_idle(faulty.llm)
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=10) as pool:
        streams = {i: pool.submit(_openai_stream, faulty, _chat(i)) for i in normal}
        abandoned = [pool.submit(_openai_stream, faulty, _chat(100 + i, 3000), keep=4) for i in range(3)]
        broken = pool.submit(_openai_stream, faulty, _chat(200, FAULTY_MAX_TOKENS))
        anthropic = pool.submit(_anthropic_stream, faulty, 300)
        results = {i: f.result(timeout=120) for i, f in streams.items()}
        for f in abandoned:
            f.result(timeout=120)
        broken_payloads = broken.result(timeout=120)
        anthropic_events = anthropic.result(timeout=120)
    assert time.monotonic() - start < 120
    for i, payloads in results.items():  # complete, terminal event and all, and exactly as without the fault
        assert payloads[-1] == "[DONE]"
        assert payloads[-2]["choices"][0]["finish_reason"] in ("stop", "length")
        assert _text(payloads) == reference[i]
    assert anthropic_events[-2:] == ["message_delta", "message_stop"]
    errors = [p for p in broken_payloads if isinstance(p, dict) and "error" in p]
    assert broken_payloads[-1] == "[DONE]" and len(errors) == 1
    assert "detokenization failed" in errors[0]["error"]["message"]
    wait_idle(faulty.llm, timeout=30)
    assert faulty.service.in_flight == 0
    engine = faulty.llm.engine
    assert not engine.requests and not engine.outputs
    # The server goes on serving afterwards.
    assert _text(_openai_stream(faulty, _chat(0))) == reference[0]
    wait_idle(faulty.llm)
