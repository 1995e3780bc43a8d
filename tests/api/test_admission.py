"""Admission and lifetime: more requests than lanes, cancel on disconnect, 429/529, 503/504, keep-alive."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from api_testing import ScriptedEngine, Server, serve, wait_idle
from prometheus_client.parser import text_string_to_metric_families

import ninfer
from ninfer.api import ServerConfig

USER = [{"role": "user", "content": "Tell me a long story"}]


def _metric(server: Server, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_more_concurrent_requests_than_lanes_all_complete(server: Server) -> None:
    client = server.openai()

    def one(i: int) -> int:
        if i % 2:
            r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, seed=i)
            return r.usage.completion_tokens
        chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, stream=True,
                                                     stream_options={"include_usage": True}))
        return chunks[-1].usage.completion_tokens

    assert server.service.lanes == 2
    with ThreadPoolExecutor(7) as pool:
        results = list(pool.map(one, range(7)))
    assert all(1 <= n <= 6 for n in results)
    wait_idle(server.llm)


@pytest.fixture(scope="module")
def slow(dense_ckpt) -> Server:
    """The real engine, each step slowed by 10 ms so that a request is surely still running when cancelled."""
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, progress=False)
    step = llm.engine.step

    def slow_step():
        time.sleep(0.01)
        return step()
    llm.engine.step = slow_step
    with serve(llm, ServerConfig(default_max_tokens=8, model_id="tiny")) as s:
        yield s


def test_client_disconnect_mid_stream_frees_the_lane(slow: Server) -> None:
    before = _metric(slow, "ninfer_requests_total", outcome="cancelled")
    body = {"model": "tiny", "messages": USER, "max_tokens": 3000, "stream": True, "temperature": 0}
    with httpx.stream("POST", slow.url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert slow.llm.engine.scheduler.running, "the request should still be generating"
    wait_idle(slow.llm)
    assert _metric(slow, "ninfer_requests_total", outcome="cancelled") == before + 1
    assert slow.service.in_flight == 0


def test_client_disconnect_of_a_non_streaming_request_frees_the_lane(slow: Server) -> None:
    before = _metric(slow, "ninfer_requests_total", outcome="cancelled")
    for path, body in (("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 3000}),
                       ("/v1/messages", {"model": "tiny", "messages": USER, "max_tokens": 3000})):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(slow.url + path, json={**body, "temperature": 0}, timeout=httpx.Timeout(30, read=0.4))
        wait_idle(slow.llm)
    assert _metric(slow, "ninfer_requests_total", outcome="cancelled") == before + 2
    assert slow.service.in_flight == 0


@pytest.fixture()
def held(llm) -> Server:
    """Two lanes, no queue places, and requests that stay admitted for a while."""
    engine = ScriptedEngine(llm, pieces=[("", "x")] * 40, finish_reason="length", step_s=0.05)
    with serve(llm, ServerConfig(max_pending=0, default_max_tokens=8), engine=engine) as s:
        yield s


def test_overload_is_429_and_anthropic_529(held: Server) -> None:
    chat = {"model": "tiny", "messages": USER, "stream": True}
    with httpx.stream("POST", held.url + "/v1/chat/completions", json=chat) as a, \
            httpx.stream("POST", held.url + "/v1/chat/completions", json=chat) as b:
        assert a.status_code == b.status_code == 200
        r = httpx.post(held.url + "/v1/chat/completions", json={**chat, "stream": False})
        assert r.status_code == 429 and r.json()["error"]["code"] == "server_overloaded"
        m = httpx.post(held.url + "/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": USER})
        assert m.status_code == 529 and m.json()["error"]["type"] == "overloaded_error"
        assert "overloaded" in m.json()["error"]["message"]
    deadline = time.monotonic() + 5
    while held.service.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert held.service.in_flight == 0
    r = httpx.post(held.url + "/v1/chat/completions", json={**chat, "stream": False})
    assert r.status_code == 200  # answers normally again
    assert _metric(held, "ninfer_requests_total", outcome="overloaded") == 2


def test_queue_timeout_is_503_and_anthropic_504(llm) -> None:
    engine = ScriptedEngine(llm, pieces=[("", "x")], queue_s=2.0)
    with serve(llm, ServerConfig(pending_timeout_ms=100), engine=engine) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": "tiny", "messages": USER})
        assert r.status_code == 503 and r.json()["error"]["code"] == "request_queue_timeout"
        assert "100 ms" in r.json()["error"]["message"]
        m = httpx.post(s.url + "/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": USER,
                                                     "stream": True})
        assert m.status_code == 504 and m.json()["error"]["type"] == "timeout_error"
        assert len(engine.cancelled) == 2  # the waiting requests were withdrawn
        assert s.service.in_flight == 0


def test_client_disconnect_while_queued_withdraws_the_request(llm) -> None:
    engine = ScriptedEngine(llm, pieces=[("", "x")], queue_s=5.0)
    with serve(llm, ServerConfig(), engine=engine) as s:
        for stream in (False, True):
            body = {"model": "tiny", "messages": USER, "stream": stream}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(s.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
        deadline = time.monotonic() + 5
        while (len(engine.cancelled) < 2 or s.service.in_flight) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(engine.cancelled) == 2 and s.service.in_flight == 0


def test_keepalive_comments_during_a_long_prefill(llm) -> None:
    engine = ScriptedEngine(llm, pieces=[("", "hi")], prefill_s=0.6)
    with serve(llm, ServerConfig(keepalive_s=0.1), engine=engine) as s:
        body = {"model": "tiny", "messages": USER, "stream": True}
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: {") and '"hi"' in line)
    assert any(line == ": keep-alive" for line in lines[:first_data])
    assert lines[-1] == "data: [DONE]"


def test_metrics_parse_and_cover_the_engine(server: Server, oai) -> None:
    oai.chat.completions.create(model="tiny", messages=USER, max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("ninfer_requests", "ninfer_prompt_tokens", "ninfer_generation_tokens", "ninfer_requests_waiting",
                 "ninfer_requests_running", "ninfer_time_to_first_token_seconds", "ninfer_request_duration_seconds",
                 "ninfer_request_queue_seconds", "ninfer_device_kv_used_pages", "ninfer_device_kv_capacity_pages",
                 "ninfer_device_state_used_slots", "ninfer_device_state_capacity_slots", "ninfer_engine_ready",
                 "ninfer_max_concurrency", "ninfer_max_context_tokens"):
        assert name in families, name
    assert _metric(server, "ninfer_generation_tokens_total") >= 1
    assert _metric(server, "ninfer_device_state_capacity_slots") == server.llm.engine.config.num_state_slots
    assert _metric(server, "ninfer_engine_ready") == 1
    assert _metric(server, "ninfer_time_to_first_token_seconds_count") >= 1
