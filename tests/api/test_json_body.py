"""Every malformed or hostile JSON body is a 400 naming the problem (and the field where there is one)."""
from __future__ import annotations

import json
import time
import tracemalloc

import httpx
import pytest
from api_testing import Server

from ninfer.api.errors import APIError
from ninfer.api.json_body import MAX_DEPTH, MAX_VALUES, parse_body, parse_text

ROUTES = ["/v1/chat/completions", "/v1/responses", "/v1/responses/input_tokens", "/v1/messages",
          "/v1/messages/count_tokens"]


def _refused(raw: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse_body(raw)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(("raw", "text"), [
    (b'{"a": "\xff"}', "invalid UTF-8 at byte 7"),
    (b'{"a": "\xed\xa0\x80"}', "invalid UTF-8"),  # a surrogate encoded as UTF-8
    (b"", "empty"), (b"  \n", "empty"),
    (b'{"a": 1', "not valid JSON"),
    (b'{"t": NaN}', "NaN is not a JSON number"), (b'{"t": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"t": 1e400}', "1e400 is out of range"), (b'{"t": -2e308}', "out of range"),
    (b'{"t": 1, "t": 2}', "duplicate key 't'"),
    (b'{"a": ' + b"1" * 5000 + b"}", "more than 64 digits"),
    (b"[" * 100_000 + b"]" * 100_000, f"deeper than {MAX_DEPTH} levels"),
])
def test_malformed_bodies(raw: bytes, text: str) -> None:
    assert text in _refused(raw).message


def test_errors_name_the_field_path() -> None:
    err = _refused(b'{"messages": [{"content": "ok"}, {"content": [{"text": "x\\ud800"}]}]}')
    assert err.param == "messages[1].content[0].text" and "lone UTF-16 surrogate" in err.message
    assert _refused(b'{"m": {"\\udc00": 1}}').param == 'm["\\udc00"]'
    assert _refused(b'{"seed": ' + b"9" * 65 + b"}").param == "seed"
    deep = _refused(b'{"tools": [' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"]}")
    assert deep.code == "request_too_complex" and deep.param.startswith("tools[0][0]")


def test_what_is_valid_stays_valid() -> None:
    body = {"a": "\U0001F600 é \\ud800 \"quoted, [x]\"", "n": 10**63, "f": -1.5e300, "x": [[[]]] * 3}
    assert parse_body(json.dumps(body).encode()) == body  # ensure_ascii: the emoji arrives as a surrogate pair
    assert parse_body(b"\xef\xbb\xbf" + json.dumps(body, ensure_ascii=False).encode()) == body
    nested = {"a": 1}
    for _ in range(MAX_DEPTH - 1):
        nested = {"a": nested}
    assert parse_body(json.dumps(nested).encode()) == nested


def test_value_count_ignores_punctuation_inside_strings() -> None:
    text = 'say "x", [y] {z} \\' * (MAX_VALUES // 2)
    assert parse_body(json.dumps({"a": text, "b": [1, 2]}).encode())["b"] == [1, 2]
    err = _refused(json.dumps({"a": [0] * (MAX_VALUES + 1)}).encode())
    assert err.code == "request_too_complex"


def test_many_tiny_values_are_refused_before_they_are_built() -> None:
    raw = b"[" + b"[]," * 5_000_000 + b"[]]"
    tracemalloc.start()
    try:
        start = time.perf_counter()
        assert _refused(raw).code == "request_too_complex"
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(raw) and elapsed < 20  # parsing it would have built 5M lists (> 280 MB)


def test_string_fields_holding_json_follow_the_same_rules() -> None:
    with pytest.raises(APIError) as info:
        parse_text('{"x": NaN}', "messages[0].tool_calls[0].function.arguments")
    assert info.value.param == "messages[0].tool_calls[0].function.arguments"
    with pytest.raises(APIError) as info:
        parse_text('{"x": ["\\udfff"]}', "args")
    assert info.value.param == "args.x[0]"
    with pytest.raises(APIError, match="deeper"):
        parse_text("[" * 5000 + "]" * 5000, "args")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("raw", [b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
                                 b"[" * 100_000, b'{"model": "tiny", "max_tokens": ' + b"7" * 5000 + b"}",
                                 b'{"model": NaN}', b'"just a string"', b"\xc3\x28", b"[1, 2]"])
def test_every_route_answers_400(server: Server, route: str, raw: bytes) -> None:
    r = httpx.post(server.url + route, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "JSON" in message or "nests" in message or "surrogate" in message


def test_surrogates_in_every_text_field_name_the_field(server: Server) -> None:
    bodies = {
        "/v1/chat/completions": ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                  "stop": ["\udc00"]}, "stop[0]"),
        "/v1/responses": ({"model": "tiny", "input": "hi", "instructions": "a\ud800b"}, "instructions"),
        "/v1/messages": ({"model": "tiny", "max_tokens": 2, "system": [{"type": "text", "text": "\ud801"}],
                          "messages": [{"role": "user", "content": "hi"}]}, "system[0].text"),
    }
    for route, (body, param) in bodies.items():
        raw = json.dumps(body).encode()  # ensure_ascii writes the lone surrogate as an escape
        r = httpx.post(server.url + route, content=raw, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, r.text
        assert param in r.json()["error"]["message"]
