"""Operations side of the server: API key sources, request ids, Retry-After, the responses counter, draining."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from api_testing import ScriptedEngine, Server, serve

from ninfer.api import ServerConfig, create_app
from ninfer.api.cli import add_serve_parser, server_config
from ninfer.api.serve_ops import API_KEY_ENV, drain_of
from ninfer.api.shutdown import Drain, GracefulServer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


# -- API key sources -------------------------------------------------------------------------------------------
def test_api_key_precedence_flag_then_file_then_environment(tmp_path, monkeypatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert server_config(_parse("--api-key", "from-flag")).api_key == "from-flag"
    assert server_config(_parse("--api-key-file", str(key_file))).api_key == "from-file"
    assert server_config(_parse()).api_key == "from-env"
    monkeypatch.delenv(API_KEY_ENV)
    assert server_config(_parse()).api_key is None


@pytest.mark.parametrize("content, fragment", [(None, "cannot be read"), ("", "is empty"), ("  \n", "is empty"),
                                               ("a\nb\n", "one line")])
def test_bad_api_key_files_are_cli_errors_naming_the_flag(tmp_path, capsys, content, fragment) -> None:
    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit):
        _parse("--api-key-file", str(path))
    err = capsys.readouterr().err
    assert "--api-key-file" in err and fragment in err


def test_empty_keys_never_turn_authentication_off(capsys, monkeypatch) -> None:
    with pytest.raises(SystemExit):
        _parse("--api-key", "")
    assert "--api-key must not be empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("--api-key", "k", "--api-key-file", "/nonexistent")
    monkeypatch.setenv(API_KEY_ENV, " ")
    with pytest.raises(ValueError, match=API_KEY_ENV):
        server_config(_parse())


def test_the_file_key_is_enforced(llm, tmp_path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    config = server_config(_parse("--api-key-file", str(key_file)))
    with serve(llm, config, engine=ScriptedEngine(llm, pieces=[("", "Hi")])) as s:
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/v1/models", headers={"authorization": "Bearer s3cret"}).status_code == 200


@pytest.mark.parametrize("argv", [["--shutdown-timeout", "-1"], ["--shutdown-timeout", "inf"],
                                  ["--header-timeout", "0"], ["--body-timeout", "slow"]])
def test_bad_timeout_flags_are_refused(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        _parse(*argv)
    assert argv[0] in capsys.readouterr().err


def test_timeout_flag_defaults() -> None:
    args = _parse()
    assert (args.shutdown_timeout, args.header_timeout, args.body_timeout) == (25.0, 30.0, 60.0)
    assert _parse("--shutdown-timeout", "0").shutdown_timeout == 0.0  # end open requests at once


# -- request ids ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scripted_server(llm) -> Iterator[tuple[Server, ScriptedEngine]]:
    engine = ScriptedEngine(llm, pieces=[("", "Hello"), ("", " there")])
    with serve(llm, ServerConfig(default_max_tokens=8, model_id="tiny"), engine=engine) as s:
        yield s, engine


@pytest.mark.parametrize("path, body, prefix", [("/v1/chat/completions", CHAT, "chatcmpl-"),
                                                ("/v1/messages", MESSAGES, "msg_"),
                                                ("/v1/responses", {"model": "m", "input": "Hi"}, "resp_")])
def test_the_client_request_id_is_the_one_id(scripted_server, caplog, path, body, prefix) -> None:
    server, _ = scripted_server
    caplog.set_level(logging.INFO, logger="ninfer.api")
    r = httpx.post(server.url + path, json=body, headers={"x-request-id": "trace-42.a:b"}, timeout=30)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42.a:b"
    assert r.json()["id"] == prefix + "trace-42.a:b"
    if path == "/v1/messages":
        assert r.headers["request-id"] == "trace-42.a:b"
    deadline = time.monotonic() + 5  # the request's log line is written as its run is accounted for
    while "request trace-42.a:b stop" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "request trace-42.a:b stop" in caplog.text


def test_streamed_chunks_carry_the_request_id(scripted_server) -> None:
    server, _ = scripted_server
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                      headers={"x-request-id": "s-1"}, timeout=30) as r:
        assert r.headers["x-request-id"] == "s-1"
        ids = {line for line in r.iter_lines() if line.startswith("data: {")}
    assert ids and all('"id": "chatcmpl-s-1"' in line for line in ids)


def test_a_generated_request_id_is_shared_by_header_and_body(scripted_server) -> None:
    server, _ = scripted_server
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=30)
    rid = r.headers["x-request-id"]
    assert len(rid) == 24 and r.json()["id"] == "chatcmpl-" + rid
    other = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=30).headers["x-request-id"]
    assert other != rid


@pytest.mark.parametrize("value", ["x" * 129, "has space", "semi;colon", "ünï"])
def test_bad_request_ids_are_400_naming_the_header(scripted_server, value) -> None:
    server, _ = scripted_server
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT,
                   headers={"x-request-id": value.encode()}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"
    assert len(r.headers["x-request-id"]) == 24  # the error response still has an id of its own


# -- metrics ---------------------------------------------------------------------------------------------------
def _responses(server: Server) -> dict[tuple[str, str], float]:
    """``ninfer_http_responses_total`` by (route, status), as scraped now."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert "# TYPE ninfer_http_responses_total counter" in text
    counts = {}
    for line in text.splitlines():
        if line.startswith("ninfer_http_responses_total{"):
            labels, value = line[len("ninfer_http_responses_total{"):].split("} ")
            named = dict(part.split("=") for part in labels.split(","))
            counts[(named["route"].strip('"'), named["status"].strip('"'))] = float(value)
    return counts


def test_error_responses_are_counted_by_route_and_status(scripted_server) -> None:
    server, _ = scripted_server
    before = _responses(server)
    bad = {"model": "m", "messages": "not a list"}
    for _ in range(2):
        assert httpx.post(server.url + "/v1/chat/completions", json=bad, timeout=30).status_code == 400
    assert httpx.get(server.url + "/nowhere", timeout=30).status_code == 404
    assert httpx.post(server.url + "/v1/messages", json={"model": "m"}, timeout=30).status_code == 400
    assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    after = _responses(server)
    grown = {key: n - before.get(key, 0.0) for key, n in after.items() if n != before.get(key, 0.0)}
    assert grown == {("/v1/chat/completions", "400"): 2, ("unmatched", "404"): 1, ("/v1/messages", "400"): 1,
                     ("/v1/chat/completions", "200"): 1, ("/metrics", "200"): 1}


def test_a_client_gone_before_its_body_arrived_is_a_499_not_an_internal_error(scripted_server, caplog) -> None:
    server, _ = scripted_server
    before = _responses(server)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\"")
        time.sleep(0.2)
    key = ("/v1/chat/completions", "499")
    deadline = time.monotonic() + 5
    while _responses(server).get(key, 0) == before.get(key, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _responses(server).get(key, 0) == before.get(key, 0) + 1
    assert "internal error" not in caplog.text


# -- Retry-After ---------------------------------------------------------------------------------------------
def test_overload_answers_carry_retry_after(llm) -> None:
    engine = ScriptedEngine(llm, pieces=[("", "x")] * 40, step_s=0.05)  # each stream holds its lane ~2 s
    with serve(llm, ServerConfig(default_max_tokens=8, max_pending=0), engine=engine) as s:
        lanes = s.service.lanes
        done = threading.Event()

        def hold() -> None:
            with httpx.stream("POST", s.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                              timeout=30) as r:
                for _ in r.iter_lines():
                    if done.is_set():
                        break

        holders = [threading.Thread(target=hold, daemon=True) for _ in range(lanes)]
        for t in holders:
            t.start()
        deadline = time.monotonic() + 10
        while s.service.in_flight < lanes and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            r = httpx.post(s.url + "/v1/chat/completions", json=CHAT, timeout=30)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            r = httpx.post(s.url + "/v1/messages", json=MESSAGES, timeout=30)
            assert r.status_code == 529 and r.headers["retry-after"] == "1"
        finally:
            done.set()
            for t in holders:
                t.join(timeout=10)


def test_queue_timeouts_carry_retry_after(llm) -> None:
    engine = ScriptedEngine(llm, pieces=[("", "x")], queue_s=2.0)
    with serve(llm, ServerConfig(default_max_tokens=8, pending_timeout_ms=100), engine=engine) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        r = httpx.post(s.url + "/v1/messages", json=MESSAGES, timeout=30)
        assert r.status_code == 504 and r.headers["retry-after"] == "1"


def test_a_draining_server_refuses_new_requests_with_503(llm) -> None:
    with serve(llm, ServerConfig(default_max_tokens=8), engine=ScriptedEngine(llm, pieces=[("", "x")])) as s:
        s.service.drain.begin()
        r = httpx.post(s.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "server_shutting_down"
        assert httpx.post(s.url + "/v1/messages", json=MESSAGES, timeout=30).status_code == 503
        health = httpx.get(s.url + "/health", timeout=30)
        assert health.status_code == 503 and "retry-after" in health.headers
        assert httpx.get(s.url + "/metrics", timeout=30).status_code == 200


# -- the graceful server -----------------------------------------------------------------------------------------
class _Run:
    def __init__(self) -> None:
        self.interrupts = 0

    def interrupt(self) -> None:
        self.interrupts += 1


def test_signals_drain_then_interrupt(llm) -> None:
    """First signal: draining, interrupt at the deadline; second signal: interrupt now."""
    app = create_app(llm, ServerConfig(), engine=ScriptedEngine(llm))

    async def signalled(shutdown_timeout: float, signals: int, wait_s: float) -> tuple[Drain, _Run]:
        drain, run = Drain(), _Run()
        drain.opened(run)
        server = GracefulServer(uvicorn.Config(app, log_level="warning"), lambda: drain, shutdown_timeout)
        assert server.config.timeout_graceful_shutdown > shutdown_timeout  # uvicorn's cancel: only a backstop
        server._loop = asyncio.get_running_loop()
        for count in range(1, signals + 1):
            server._on_signal(count)
        assert drain.draining
        await asyncio.sleep(wait_s)
        return drain, run

    drain, run = asyncio.run(signalled(60, 1, 0.3))
    assert not drain.interrupted and run.interrupts == 0  # before the deadline: the run goes on
    drain, run = asyncio.run(signalled(0.2, 1, 0.5))
    assert drain.interrupted and run.interrupts == 1  # the deadline passed
    drain, run = asyncio.run(signalled(60, 2, 0.0))
    assert drain.interrupted and run.interrupts == 1  # a second signal does not wait for the deadline
    drain.closed(run)
    drain.interrupt_all()
    assert run.interrupts == 1 and not drain.runs


def test_an_idle_server_exits_at_once_on_sigint_without_reraising(llm) -> None:
    app = create_app(llm, ServerConfig(), engine=ScriptedEngine(llm))
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = GracefulServer(config, lambda: drain_of(app), shutdown_timeout=30)

    def interrupt_when_started() -> None:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_started, daemon=True).start()
    start = time.monotonic()
    server.run()  # in the main thread, so uvicorn installs its signal handlers; no KeyboardInterrupt follows
    assert server.started and time.monotonic() - start < 15
    assert drain_of(app).draining
