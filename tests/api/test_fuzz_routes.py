"""Property-based fuzz of every POST route: generated bodies, valid and invalid, never get a 5xx, and
afterwards the server is idle with every lane, page and slot free again."""
from __future__ import annotations

import json
from typing import Any

import httpx
from api_testing import Server, wait_idle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Any character, lone surrogates included (json.dumps escapes them as \udXXX).
TEXT = st.text(st.characters(codec=None, categories=None), max_size=12)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2**31 - 2, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=1e30, max_value=1e300),
                    TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8)
ROLES = st.sampled_from(["user", "assistant", "system", "developer", "tool", "function", "robot", ""])
PART_TYPES = st.sampled_from(["text", "input_text", "output_text", "image_url", "image", "tool_use", "tool_result",
                              "thinking", "function_call", "function_call_output", "reasoning", "message", "x"])
PART = st.fixed_dictionaries({"type": PART_TYPES}, optional={"text": st.one_of(TEXT, JSON), "id": TEXT,
                                                             "name": TEXT, "input": JSON, "content": JSON,
                                                             "arguments": st.one_of(TEXT, JSON), "call_id": TEXT})
CONTENT = st.one_of(TEXT, st.lists(PART, max_size=3), JSON)
MESSAGE = st.fixed_dictionaries({"role": ROLES, "content": CONTENT},
                                optional={"tool_calls": JSON, "reasoning_content": TEXT, "tool_call_id": TEXT})
SCHEMA = st.one_of(JSON, st.fixed_dictionaries({"type": st.sampled_from(["object", "array", "string"])},
                                               optional={"properties": JSON, "required": JSON}))
CHAT_TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "web"]), "function": st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["f", "get_weather"]), TEXT)}, optional={"parameters": SCHEMA})})
FLAT_TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "custom"]), "name": st.sampled_from(["f", ""])},
                                  optional={"parameters": SCHEMA, "input_schema": SCHEMA})
# Output limits stay small so a valid request generates a few tokens only.
LIMIT = st.one_of(st.integers(min_value=-2, max_value=3), JSON.filter(lambda v: not isinstance(v, int)))
SAMPLING = {name: st.one_of(SCALARS, st.floats(min_value=0, max_value=2)) for name in (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed")}
STOP = st.one_of(TEXT, st.lists(st.one_of(TEXT, st.text(max_size=2000)), max_size=6), JSON)
COMMON = {**SAMPLING, "model": st.one_of(st.just("tiny"), JSON), "stream": st.one_of(st.booleans(), JSON)}
ROUTES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "/v1/chat/completions": ({"messages": st.lists(MESSAGE, max_size=3)}, {
        **COMMON, "max_tokens": LIMIT, "max_completion_tokens": LIMIT, "stop": STOP,
        "tools": st.one_of(st.lists(CHAT_TOOL, max_size=2), JSON), "tool_choice": JSON, "logit_bias": JSON,
        "logprobs": JSON, "top_logprobs": JSON, "n": JSON, "stream_options": JSON, "chat_template_kwargs": JSON,
        "reasoning_effort": st.one_of(st.sampled_from(["low", "none", "x"]), JSON), "response_format": JSON}),
    "/v1/responses": ({"input": st.one_of(TEXT, st.lists(st.one_of(MESSAGE, PART), max_size=3), JSON)}, {
        **COMMON, "max_output_tokens": LIMIT, "stop": STOP, "instructions": st.one_of(TEXT, JSON),
        "tools": st.one_of(st.lists(FLAT_TOOL, max_size=2), JSON), "reasoning": JSON, "text": JSON,
        "metadata": JSON, "previous_response_id": st.one_of(TEXT, JSON), "top_logprobs": JSON, "store": JSON}),
    "/v1/responses/input_tokens": ({"input": st.one_of(TEXT, st.lists(MESSAGE, max_size=3))}, {
        "model": COMMON["model"], "instructions": st.one_of(TEXT, JSON), "tools": st.lists(FLAT_TOOL, max_size=2)}),
    "/v1/messages": ({"messages": st.lists(MESSAGE, max_size=3), "max_tokens": LIMIT}, {
        **COMMON, "system": st.one_of(TEXT, st.lists(PART, max_size=2), JSON), "stop_sequences": STOP,
        "tools": st.one_of(st.lists(FLAT_TOOL, max_size=2), JSON), "tool_choice": JSON, "thinking": JSON,
        "metadata": JSON, "output_config": JSON}),
    "/v1/messages/count_tokens": ({"messages": st.lists(MESSAGE, max_size=3)}, {
        "model": COMMON["model"], "system": st.one_of(TEXT, JSON), "tools": st.lists(FLAT_TOOL, max_size=2),
        "thinking": JSON}),
    "/v1/completions": ({"prompt": st.one_of(TEXT, st.lists(st.one_of(TEXT, st.integers(-2, 600),
                                                                      st.lists(st.integers(-2, 600), max_size=4)),
                                                            max_size=3), JSON)}, {
        **COMMON, "max_tokens": LIMIT, "stop": STOP, "n": st.one_of(st.integers(0, 3), JSON),
        "best_of": JSON, "echo": JSON, "logprobs": st.one_of(st.integers(-1, 3), JSON), "suffix": JSON,
        "stream_options": JSON, "ignore_eos": JSON, "stop_token_ids": JSON, "logit_bias": JSON}),
    "/tokenize": ({"prompt": st.one_of(TEXT, JSON)}, {
        "model": COMMON["model"], "messages": st.lists(MESSAGE, max_size=2), "add_special_tokens": JSON,
        "return_token_strs": JSON, "tools": JSON}),
    "/detokenize": ({"tokens": st.one_of(st.lists(st.integers(-2, 600), max_size=4), JSON)},
                    {"model": COMMON["model"]}),
}


# Bodies that should be served: each is then mutated in one field half of the time.
GOOD_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=16)
GOOD_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": GOOD_TEXT}), min_size=1,
                         max_size=2)
GOOD_SAMPLING = {"temperature": st.floats(0, 1), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 40),
                 "seed": st.integers(-(2**63), 2**63 - 1), "stream": st.booleans(),
                 "stop": st.lists(GOOD_TEXT, max_size=2)}
GOOD = {
    "/v1/chat/completions": ({"messages": GOOD_MESSAGES, "max_tokens": st.integers(1, 3)},
                             {**GOOD_SAMPLING, "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.5, 2)}),
    "/v1/responses": ({"input": GOOD_TEXT, "max_output_tokens": st.integers(1, 3)},
                      {**GOOD_SAMPLING, "instructions": GOOD_TEXT, "store": st.booleans()}),
    "/v1/responses/input_tokens": ({"input": GOOD_TEXT}, {"instructions": GOOD_TEXT}),
    "/v1/messages": ({"messages": GOOD_MESSAGES, "max_tokens": st.integers(1, 3)},
                     {"temperature": st.floats(0, 1), "top_k": st.integers(0, 40), "stream": st.booleans(),
                      "system": GOOD_TEXT, "stop_sequences": st.lists(GOOD_TEXT, max_size=2)}),
    "/v1/messages/count_tokens": ({"messages": GOOD_MESSAGES}, {"system": GOOD_TEXT}),
    "/v1/completions": ({"prompt": st.one_of(GOOD_TEXT, st.lists(st.integers(0, 400), min_size=1, max_size=4)),
                         "max_tokens": st.integers(0, 3)},
                        {**GOOD_SAMPLING, "n": st.integers(1, 2), "echo": st.booleans(), "logprobs": st.integers(0, 2)}),
    "/tokenize": ({"prompt": GOOD_TEXT}, {"add_special_tokens": st.booleans(), "return_token_strs": st.booleans()}),
    "/detokenize": ({"tokens": st.lists(st.integers(0, 400), max_size=4)}, {}),
}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    route = draw(st.sampled_from(sorted(ROUTES)))
    required, optional = draw(st.sampled_from([GOOD, GOOD, ROUTES]))[route]
    body = draw(st.fixed_dictionaries({"model": st.just("tiny"), **required},
                                      optional={k: v for k, v in optional.items() if k != "model"}))
    required, optional = ROUTES[route]
    if draw(st.booleans()):  # also whole-field junk and dropped required fields
        for name in draw(st.lists(st.sampled_from(sorted({*required, *optional})), max_size=2)):
            body[name] = draw(JSON) if name not in ("max_tokens", "max_output_tokens") else draw(LIMIT)
    raw = json.dumps(body).encode()
    mangle = draw(st.sampled_from(["none"] * 12 + ["truncate", "bytes", "deep", "toplevel"]))
    if mangle == "truncate":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif mangle == "bytes":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.binary(min_size=1, max_size=4)) + raw[at:]
    elif mangle == "deep":
        depth = draw(st.integers(100, 5000))
        raw = raw[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}"
    elif mangle == "toplevel":
        raw = json.dumps(draw(JSON)).encode()
    return route, raw


@settings(max_examples=160, deadline=10_000, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=bodies())
def test_no_route_answers_a_server_error(server: Server, case: tuple[str, bytes]) -> None:
    route, raw = case
    r = httpx.post(server.url + route, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (route, raw[:300], r.text[:500])
    if r.status_code != 200:
        assert r.json()["error"]["message"]  # the protocol's error shape, with a message
    elif "text/event-stream" in r.headers.get("content-type", ""):
        assert '"internal_error"' not in r.text and "engine_error" not in r.text, r.text[-500:]
    else:
        r.json()


def test_the_server_is_idle_and_whole_after_the_fuzz(server: Server) -> None:
    wait_idle(server.llm)
    assert server.service.held == 0
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
