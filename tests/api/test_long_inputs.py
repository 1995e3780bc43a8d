"""Huge inputs: refused early (before tokenizing) with bounded time and memory, prepared off the event loop
and inside the admission limit, so one huge request neither blocks nor starves the others."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from api_testing import ScriptedEngine, Server, serve, wait_idle

from ninfer.api import ServerConfig

_PAGE = 4096


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """The highest resident set size of this process (the server runs in it) above the start, sampled."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def grown(self) -> int:
        return self.peak - self.base


def _huge(route: str, chars: int) -> dict[str, Any]:
    text = "lorem ipsum dolor sit amet, " * (chars // 28)
    if route == "/v1/responses/input_tokens":
        return {"model": "tiny", "input": text}
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}]}
    return body if route == "/v1/messages/count_tokens" else {**body, "max_tokens": 2}


@pytest.mark.parametrize("route", ["/v1/messages/count_tokens", "/v1/responses/input_tokens",
                                   "/v1/chat/completions"])
def test_a_30mb_prompt_is_refused_before_tokenizing(server: Server, route: str) -> None:
    raw = httpx.Request("POST", "/", json=_huge(route, 30 << 20)).content
    with PeakRSS() as rss:
        start = time.perf_counter()
        r = httpx.post(server.url + route, content=raw, headers={"content-type": "application/json"}, timeout=120)
        elapsed = time.perf_counter() - start
    assert r.status_code == 400, r.text
    assert "at least" in r.text and "context limit" in r.text
    # Before: 18.6 s and 5.5 GB for count_tokens (the whole body tokenized). Generous bounds for a shared CPU.
    assert elapsed < 15, elapsed
    assert rss.grown < 1 << 30, rss.grown
    wait_idle(server.llm)


def test_the_early_bound_never_refuses_what_fits(server: Server) -> None:
    service = server.service
    text = "x" * (service.max_context * service.max_token_bytes // 4 - 1)
    service.check_prompt_size(text)  # below the bound for any text: no work at all
    service.check_prompt_size("a" * (service.max_context - 1))
    with pytest.raises(Exception, match="at least"):
        service.check_prompt_size("é" * (service.max_context * service.max_token_bytes))


def test_small_requests_are_served_while_a_long_prompt_is_tokenized(server: Server) -> None:
    """A prompt just under the early bound is tokenized on a worker thread; short requests meanwhile finish."""
    service = server.service
    long_body = _huge("/v1/messages/count_tokens", service.max_context * service.max_token_bytes // 2)
    done: dict[str, Any] = {}

    def long_request() -> None:
        done["long"] = httpx.post(server.url + "/v1/messages/count_tokens", json=long_body, timeout=120)

    thread = threading.Thread(target=long_request)
    thread.start()
    small = []
    for _ in range(3):
        r = httpx.post(server.url + "/v1/messages/count_tokens",
                       json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}, timeout=60)
        small.append(r.status_code)
    thread.join(timeout=120)
    assert small == [200, 200, 200]
    assert done["long"].status_code in (200, 400), done["long"].text


@pytest.fixture()
def one_place(llm: Any) -> Iterator[Server]:
    engine = ScriptedEngine(llm, pieces=[("", "ok")])
    with serve(llm, ServerConfig(max_pending=0, default_max_tokens=4, model_id="tiny"), engine=engine) as s:
        yield s


def _slow_body(body: bytes, release: threading.Event) -> Iterator[bytes]:
    yield body[:10]
    release.wait(timeout=30)
    yield body[10:]


def test_requests_being_read_and_prepared_hold_places_of_the_admission_limit(one_place: Server) -> None:
    lanes = one_place.service.lanes
    body = httpx.Request("POST", "/", json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                            "max_tokens": 2}).content
    release = threading.Event()
    results: list[int] = []

    def slow(route: str) -> None:
        r = httpx.post(one_place.url + route, content=_slow_body(body, release),
                       headers={"content-type": "application/json"}, timeout=60)
        results.append(r.status_code)

    routes = (["/v1/chat/completions", "/v1/messages/count_tokens"] * lanes)[:lanes]
    threads = [threading.Thread(target=slow, args=(route,)) for route in routes]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 10
        while one_place.service.preparing < lanes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert one_place.service.preparing == lanes
        for route, status in (("/v1/messages/count_tokens", 529), ("/v1/chat/completions", 429)):
            r = httpx.post(one_place.url + route, content=body, headers={"content-type": "application/json"},
                           timeout=60)
            assert r.status_code == status, r.text
    finally:
        release.set()
        for t in threads:
            t.join(timeout=60)
    assert results and all(code == 200 for code in results)
    assert one_place.service.held == 0
