"""Values past what the engine stores, stop strings, logit_bias and tool schemas: a 400 naming the field on
every route, and the server (whose pools are full again afterwards) keeps serving."""
from __future__ import annotations

from typing import Any

import httpx
import pytest
from api_testing import Server, wait_idle

from ninfer.runtime.sampling import INT32_MAX, INT64_MAX

USER = [{"role": "user", "content": "Hi"}]
BASES = {
    "/v1/chat/completions": {"model": "tiny", "messages": USER, "max_tokens": 2},
    "/v1/responses": {"model": "tiny", "input": "Hi", "max_output_tokens": 2},
    "/v1/messages": {"model": "tiny", "max_tokens": 2, "messages": USER},
}
OPENAI = ("/v1/chat/completions", "/v1/responses")
NUMERIC = [  # (field, value, routes)
    ("top_k", 2**31, None), ("top_k", 2**40, None), ("seed", 2**63, OPENAI), ("seed", 2**64 - 1, OPENAI),
    ("repetition_penalty", 1e39, OPENAI), ("repetition_penalty", 1e-40, OPENAI), ("temperature", 1e39, None),
    ("top_p", 1e39, None), ("min_p", 1e39, OPENAI), ("presence_penalty", 1e39, OPENAI),
    ("frequency_penalty", -1e39, OPENAI), ("top_logprobs", 2**40, OPENAI),
]


def post(server: Server, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60)


def message(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


@pytest.mark.parametrize(("field", "value", "routes"), NUMERIC)
def test_values_past_the_engine_are_400s_naming_the_field(server: Server, field: str, value: Any,
                                                          routes: tuple[str, ...] | None) -> None:
    for route in routes or BASES:
        r = post(server, route, {**BASES[route], field: value})
        assert r.status_code == 400, (route, r.text)
        assert f"'{field}'" in message(r)


def test_max_tokens_beyond_any_integer_type_is_clamped_not_an_error(scripted: tuple[Server, Any]) -> None:
    server, _ = scripted  # the scripted engine answers at once; the clamping is the service's
    for route, name in (("/v1/chat/completions", "max_tokens"), ("/v1/responses", "max_output_tokens"),
                        ("/v1/messages", "max_tokens")):
        r = post(server, route, {**BASES[route], name: 2**70, "temperature": 0})
        assert r.status_code == 200, r.text


def test_the_limits_themselves_are_served(server: Server) -> None:
    r = post(server, "/v1/chat/completions", {**BASES["/v1/chat/completions"], "top_k": INT32_MAX,
                                              "seed": INT64_MAX, "repetition_penalty": 1e9, "temperature": 2})
    assert r.status_code == 200, r.text
    wait_idle(server.llm)


@pytest.mark.parametrize(("stop", "text"), [
    (["x" * 1025], "'stop[0]' has 1025 characters"), (["ok", ""], "'stop[1]' is empty"),
    (["x" * 1024] * 4 + ["y"], "'stop' has 5 entries"), (7, "'stop' must be a string or an array"),
])
def test_stop_strings_are_bounded(server: Server, stop: Any, text: str) -> None:
    for route in OPENAI:
        r = post(server, route, {**BASES[route], "stop": stop})
        assert r.status_code == 400 and text in message(r), r.text


def test_anthropic_stop_sequences_are_bounded_in_length_and_total(server: Server) -> None:
    r = post(server, "/v1/messages", {**BASES["/v1/messages"], "stop_sequences": ["x" * 1000] * 9})
    assert r.status_code == 400 and "'stop_sequences' has 9000 characters in all" in message(r), r.text
    r = post(server, "/v1/messages", {**BASES["/v1/messages"], "stop_sequences": ["a" * 2000]})
    assert r.status_code == 400 and "'stop_sequences[0]'" in message(r), r.text


@pytest.mark.parametrize(("bias", "text"), [
    ({"abc": 1}, "token ids"), ({str(2**40): 0}, "token ids"), ({"-1": 0}, "token ids"),
    ({"5": 1e39}, "'logit_bias.5' must be a number in [-100, 100]"), ({"5": "x"}, "must be a number"),
    ({"5": 3}, "'logit_bias' is not supported"),
])
def test_logit_bias_keys_and_values_are_checked(server: Server, bias: dict, text: str) -> None:
    r = post(server, "/v1/chat/completions", {**BASES["/v1/chat/completions"], "logit_bias": bias})
    assert r.status_code == 400 and text in message(r), r.text


def test_an_all_zero_logit_bias_is_accepted(server: Server) -> None:
    r = post(server, "/v1/chat/completions", {**BASES["/v1/chat/completions"], "logit_bias": {"5": 0, "7": 0.0}})
    assert r.status_code == 200, r.text
    wait_idle(server.llm)


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _tools(route: str, schema: Any) -> list[dict[str, Any]]:
    if route == "/v1/chat/completions":
        return [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    if route == "/v1/responses":
        return [{"type": "function", "name": "f", "parameters": schema}]
    return [{"name": "f", "input_schema": schema}]


@pytest.mark.parametrize(("schema", "where"), [
    ({"type": "object", "properties": "x"}, ".properties' must be an object"),
    ({"type": "array"}, ".type' must be \"object\""),
    ({"type": "object", "properties": {"a": 5}}, ".properties.a' must be a JSON schema"),
    ({"type": "object", "properties": {"a": {"type": 5}}}, ".properties.a.type' must be a string"),
    ({"type": "object", "required": "a"}, ".required' must be an array"),
    ({"type": "object", "properties": {"a": {"anyOf": {"type": "string"}}}}, ".anyOf' must be an array"),
    (_nested(40), "deeper than 32 levels"),
    (_nested(400), "deeper than 128 levels"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_001)}}, "10000 subschemas"),
])
def test_tool_schemas_are_checked_and_the_error_names_the_tool(server: Server, schema: Any, where: str) -> None:
    for route in BASES:
        r = post(server, route, {**BASES[route], "tools": _tools(route, schema)})
        assert r.status_code == 400, (route, r.text)
        assert "tools[0]" in message(r) and where in message(r), (route, message(r))


def test_a_reasonable_tool_schema_is_served(server: Server) -> None:
    schema = {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": ["integer", "null"]},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["q"], "additionalProperties": False, "$defs": {"x": True}}
    for route in BASES:
        assert post(server, route, {**BASES[route], "tools": _tools(route, schema)}).status_code == 200
    wait_idle(server.llm)
