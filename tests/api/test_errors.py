"""Every bad input gets its status and a message naming the problem, in its protocol's shape."""
from __future__ import annotations

import logging

import httpx
import pytest
from api_testing import ScriptedEngine, Server, serve

import ninfer
from ninfer.api import ServerConfig

USER = [{"role": "user", "content": "Hi"}]
CHAT = {"model": "tiny", "messages": USER, "max_tokens": 2}
RESP = {"model": "tiny", "input": "Hi", "max_output_tokens": 2}
MSG = {"model": "tiny", "max_tokens": 2, "messages": USER}

CASES = [
    # (path, body, status, text the message must contain)
    ("/v1/chat/completions", {"model": "tiny"}, 400, "'messages' is required"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "'messages' must not be empty"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "'messages' must be an array"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "x"}]}, 400, "'messages[0].role' is required"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "'temperature' must be a finite number"),
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, 400, "'temperature' must be in [0, 2]"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "'top_p' must be > 0"),
    ("/v1/chat/completions", {**CHAT, "top_k": 1.5}, 400, "'top_k' must be an integer"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -1}, 400, "'max_tokens' must be >= 0"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": True}, 400, "'max_completion_tokens'"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, 400, "'n'"),
    ("/v1/chat/completions", {**CHAT, "n": 1000}, 400, "'n' must be in [1, "),
    ("/v1/responses", {"input": "hi", "n": 2}, 400, "'n' is not supported"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": -1}, 400, "'min_tokens'"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "'stop' has 5 entries"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, 400, "'stream' must be a boolean"),
    ("/v1/chat/completions", {**CHAT, "seed": "x"}, 400, "'seed' must be an integer"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "'top_logprobs'"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "'top_logprobs' needs 'logprobs'"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 3}}, 400, "'logit_bias'"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "'response_format.type'"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "'tool_choice'"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": 5}}]}, 400,
     "'tools[0].function.name'"),
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": "huge"}, 400, "'reasoning_effort' must be one of"),
    ("/v1/chat/completions", {**CHAT, "enable_thinking": False, "reasoning_effort": "high"}, 400, "contradicts"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"foo": 1}}, 400, "'chat_template_kwargs.foo'"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages[0].content[0]"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400,
     "'messages[0].tool_calls[0].function.arguments' is not valid JSON"),
    ("/v1/responses", {**RESP, "frobnicate": 1}, 400, "unknown parameter 'frobnicate'"),
    ("/v1/responses", {"model": "tiny"}, 400, "'input' is required"),
    ("/v1/responses", {**RESP, "input": 5}, 400, "'input' must be a string or an array"),
    ("/v1/responses", {**RESP, "input": [{"type": "mystery"}]}, 400, "'input[0].type'"),
    ("/v1/responses", {**RESP, "max_output_tokens": 0}, 400, "'max_output_tokens' must be >= 1"),
    ("/v1/responses", {**RESP, "max_tool_calls": 2}, 400, "max_tool_calls"),
    ("/v1/responses", {**RESP, "previous_response_id": "resp_nope"}, 404, "resp_nope"),
    ("/v1/responses", {**RESP, "tools": [{"type": "web_search"}]}, 400, "'tools[0].type'"),
    ("/v1/responses", {**RESP, "reasoning": {"effort": "extreme"}}, 400, "'reasoning.effort'"),
    ("/v1/responses", {**RESP, "top_logprobs": 21}, 400, "'top_logprobs'"),
    ("/v1/responses", {**RESP, "background": True}, 400, "'background'"),
    ("/v1/responses/input_tokens", {"model": "tiny", "input": 7}, 400, "'input'"),
    ("/v1/messages", {"model": "tiny", "messages": USER}, 400, "'max_tokens' is required"),
    ("/v1/messages", {**MSG, "max_tokens": 0}, 400, "'max_tokens' must be >= 1"),
    ("/v1/messages", {**MSG, "temperature": 1.5}, 400, "'temperature' must be in [0, 1]"),
    ("/v1/messages", {**MSG, "messages": [{"role": "system", "content": "x"}]}, 400, "'messages[0].role'"),
    ("/v1/messages", {**MSG, "thinking": {"type": "enabled", "budget_tokens": 10}}, 400,
     "'thinking.budget_tokens' must be >= 1024"),
    ("/v1/messages", {**MSG, "max_tokens": 1500, "thinking": {"type": "enabled", "budget_tokens": 2000}}, 400,
     "must be less than 'max_tokens'"),
    ("/v1/messages", {**MSG, "thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}}, 400,
     "thinking.display"),
    ("/v1/messages", {**MSG, "tool_choice": {"type": "any"}}, 400, "'tool_choice.type'"),
    ("/v1/messages", {**MSG, "stop_sequences": "END"}, 400, "'stop_sequences' must be an array"),
    ("/v1/messages", {**MSG, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "'messages[0].content[0].type'"),
    ("/v1/messages", {**MSG, "output_config": {"format": {"type": "json_schema"}}}, 400,
     "'output_config.format.schema'"),
    ("/v1/messages/count_tokens", {"model": "tiny"}, 400, "'messages' is required"),
]


@pytest.mark.parametrize("path,body,status,fragment", CASES, ids=[f"{c[0]}:{c[3][:40]}" for c in CASES])
def test_bad_inputs(server: Server, path: str, body: dict, status: int, fragment: str) -> None:
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    payload = r.json()
    if path.startswith("/v1/messages"):
        assert payload["type"] == "error" and payload["error"]["type"] in ("invalid_request_error", "not_found_error")
        assert fragment in payload["error"]["message"]
        assert r.headers["request-id"]
    else:
        assert fragment in payload["error"]["message"], payload
        assert r.headers["x-request-id"]


def test_malformed_json_and_non_objects(server: Server) -> None:
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        for raw in (b"{not json", b"[1, 2]", b""):
            r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400
            message = (r.json()["error"]["message"])
            assert "JSON" in message, message


def test_unknown_routes_and_methods_get_protocol_errors(server: Server) -> None:
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "/v1/nothing" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405
    r = httpx.post(server.url + "/v1/responses/resp_x/cancel")
    assert r.status_code == 400 and r.json()["error"]["code"] == "background_not_supported"
    r = httpx.get(server.url + "/v1/responses/resp_x/input_items")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


def test_server_answers_normally_after_bad_inputs(server: Server, oai, anth) -> None:
    assert oai.chat.completions.create(model="tiny", messages=USER, max_tokens=2).usage.completion_tokens >= 1
    assert anth.messages.create(model="tiny", max_tokens=2, messages=USER).usage.output_tokens >= 1
    assert server.service.in_flight == 0


@pytest.fixture(scope="module")
def small(dense_ckpt) -> Server:
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=1, max_context=64, progress=False)
    with serve(llm, ServerConfig(default_max_tokens=4, max_request_bytes=4096, api_key="sekret-key",
                                 model_id="tiny", cors=True)) as s:
        yield s


AUTH = {"authorization": "Bearer sekret-key"}


def test_prompt_over_the_context_gets_400_with_both_numbers(small: Server) -> None:
    long = [{"role": "user", "content": "word " * 100}]
    r = httpx.post(small.url + "/v1/chat/completions", json={"model": "tiny", "messages": long}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    message = r.json()["error"]["message"]
    assert "64" in message and "the prompt has" in message
    n = int(message.split("the prompt has ")[1].split()[0])
    assert n > 64
    m = httpx.post(small.url + "/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": long},
                   headers={"x-api-key": "sekret-key"})
    assert m.status_code == 400 and str(n) in m.json()["error"]["message"]
    ok = httpx.post(small.url + "/v1/chat/completions", json={"model": "tiny", "messages": USER}, headers=AUTH)
    assert ok.status_code == 200


def test_body_over_the_limit_is_413(small: Server) -> None:
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(small.url + "/v1/chat/completions", json=big, headers=AUTH)
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
    m = httpx.post(small.url + "/v1/messages", json={**big, "max_tokens": 2}, headers={"x-api-key": "sekret-key"})
    assert m.status_code == 413 and m.json()["error"]["type"] == "request_too_large"

    def chunks():  # no content-length: the limit is enforced while reading
        for _ in range(10):
            yield b"x" * 1000
    r = httpx.post(small.url + "/v1/chat/completions", content=chunks(), headers=AUTH)
    assert r.status_code == 413


def test_api_key_on_both_headers(small: Server) -> None:
    r = httpx.post(small.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(small.url + "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401
    m = httpx.post(small.url + "/v1/messages", json=MSG)
    assert m.status_code == 401 and m.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": m.json()["error"]["message"]}}
    assert httpx.get(small.url + "/metrics").status_code == 401
    assert httpx.get(small.url + "/health").status_code == 200  # no key needed
    assert small.openai(api_key="sekret-key").chat.completions.create(model="tiny", messages=USER).choices
    assert small.anthropic(api_key="sekret-key").messages.create(model="tiny", max_tokens=2, messages=USER).content


def test_prompts_outputs_and_keys_are_never_logged(llm, caplog) -> None:
    engine = ScriptedEngine(llm, pieces=[("", "SECRET-OUTPUT-9")])
    caplog.set_level(logging.DEBUG)
    with serve(llm, ServerConfig(api_key="SECRET-KEY-7"), engine=engine) as s:
        headers = {"authorization": "Bearer SECRET-KEY-7"}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "SECRET-PROMPT-3"}]}
        assert httpx.post(s.url + "/v1/chat/completions", json=body, headers=headers).status_code == 200
        assert httpx.post(s.url + "/v1/chat/completions", json={**body, "temperature": 9},
                          headers=headers).status_code == 400
    logged = caplog.text
    assert "request" in logged  # the request was logged, without its contents
    for secret in ("SECRET-OUTPUT-9", "SECRET-KEY-7", "SECRET-PROMPT-3"):
        assert secret not in logged


def test_cors_preflight_needs_no_key(small: Server) -> None:
    r = httpx.options(small.url + "/v1/chat/completions", headers={
        "origin": "http://example.com", "access-control-request-method": "POST",
        "access-control-request-headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://example.com")


def test_engine_failure_is_reported(llm) -> None:
    import threading

    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    engine = ScriptedEngine(llm, pieces=[("", "x")])
    engine._thread = dead  # what AsyncEngine exposes: its thread has died
    with serve(llm, ServerConfig(), engine=engine) as s:
        assert httpx.get(s.url + "/health").status_code == 503
        assert httpx.get(s.url + "/health").json() == {"status": "unavailable"}
        r = httpx.post(s.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        assert "ninfer_engine_ready 0.0" in httpx.get(s.url + "/metrics").text

