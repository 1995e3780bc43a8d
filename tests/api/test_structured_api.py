"""Structured output through the server: the official SDKs against a loopback server with the tiny model."""
from __future__ import annotations

import json
import re
import sys
from typing import Literal

import httpx
import openai
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
from api_testing import Server  # noqa: E402
from pydantic import BaseModel  # noqa: E402

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MSG = [{"role": "user", "content": "answer"}]
BOUNDED = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
           "required": ["ok", "n"], "additionalProperties": False}


class Answer(BaseModel):
    ok: bool
    level: Literal["low", "high"]


def test_pydantic_response_format_parses(oai) -> None:
    for seed in range(2):
        done = oai.chat.completions.parse(model="tiny", messages=MSG, response_format=Answer, max_tokens=40,
                                          seed=seed, extra_body=NO_THINK)
        choice = done.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Answer)


def test_json_schema_with_thinking_constrains_the_answer(oai) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": BOUNDED, "strict": True}}
    out = oai.chat.completions.create(model="tiny", messages=MSG, response_format=fmt, max_tokens=60, seed=3)
    choice = out.choices[0]
    if choice.finish_reason == "stop" and choice.message.content:
        jsonschema.validate(json.loads(choice.message.content), BOUNDED)


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["red", "green", "blue"]}, lambda s: s in ("red", "green", "blue")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda s: s in ("yes", "no")),
    ({"guided_regex": r"\d{3}-[a-z]{2}"}, lambda s: re.fullmatch(r"\d{3}-[a-z]{2}", s)),
    ({"structured_outputs": {"regex": "(ab|cd)+!"}}, lambda s: re.fullmatch("(ab|cd)+!", s)),
    ({"guided_json": BOUNDED}, lambda s: jsonschema.validate(json.loads(s), BOUNDED) is None),
    ({"structured_outputs": {"json": json.dumps(BOUNDED)}}, lambda s: jsonschema.validate(json.loads(s), BOUNDED) is None),
    ({"guided_grammar": 'root ::= "v" [0-9] ("." [0-9])?'}, lambda s: re.fullmatch(r"v[0-9](\.[0-9])?", s)),
])
def test_vllm_extras_constrain_the_answer(oai, extra: dict, check) -> None:
    out = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=30, temperature=1.0, seed=5,
                                      extra_body={**extra, **NO_THINK})
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        assert check(choice.message.content), choice.message.content
    else:  # only a JSON answer may still be unfinished at 30 tokens
        assert "guided_json" in extra or "json" in extra.get("structured_outputs", {})


def test_json_object_streamed(oai) -> None:
    stream = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=24, stream=True, seed=1,
                                         response_format={"type": "json_object"}, extra_body=NO_THINK)
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert text.startswith("{")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length"


def test_length_before_the_grammar_completes(oai) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40}}, "required": ["s"]}
    out = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, extra_body={"guided_json": schema,
                                                                                            **NO_THINK})
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content.startswith('{"s"')


def test_responses_text_format(oai) -> None:
    out = oai.responses.create(model="tiny", input="answer", max_output_tokens=40, extra_body=NO_THINK,
                               text={"format": {"type": "json_schema", "name": "a", "schema": BOUNDED}})
    assert out.text.format.type == "json_schema"
    if out.status == "completed":
        jsonschema.validate(json.loads(out.output_text), BOUNDED)


def test_anthropic_output_config_format(anth) -> None:
    msg = anth.messages.create(model="tiny", max_tokens=40, messages=MSG,
                               extra_body={"output_config": {"format": {"type": "json_schema", "schema": BOUNDED}},
                                           "thinking": {"type": "disabled"}})
    if msg.stop_reason == "end_turn":
        [text] = [b.text for b in msg.content if b.type == "text"]
        jsonschema.validate(json.loads(text), BOUNDED)
    else:
        assert msg.stop_reason == "max_tokens"


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "a("}, "guided_regex"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar"),
    ({"guided_json": {"type": "integer", "minimum": 3, "maximum": 1}}, "guided_json"),
    ({"guided_json": {"type": "string", "not": {"const": "x"}}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object",
      "properties": {"a": {"type": "array", "uniqueItems": True}}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " ", "guided_json": {"type": "object"}}, "guided_whitespace_pattern"),
])
def test_bad_constraints_are_400_naming_the_field(server: Server, body: dict, param: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": MSG, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    ok = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 2},
                    timeout=30)
    assert ok.status_code == 200  # the server keeps serving


def test_responses_and_anthropic_errors_name_the_field(server: Server) -> None:
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "a", "schema": {"type": "integer", "multipleOf": 2}}}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema", r.text
    r = httpx.post(server.url + "/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": MSG,
                                                      "output_config": {"format": {"type": "json_schema"}}},
                   timeout=30)
    assert r.status_code == 400 and "output_config.format.schema" in r.text, r.text


def test_without_xgrammar_a_structured_request_is_400(server: Server, monkeypatch) -> None:
    from ninfer.runtime.structured import StructuredCompiler

    llm = server.llm
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    monkeypatch.setattr(llm, "structured", StructuredCompiler(llm.tokenizer.hf, 512, sorted(llm.stop_ids), None))
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": MSG, "response_format": {"type": "json_object"}}, timeout=30)
    assert r.status_code == 400 and "pip install ninfer[structured]" in r.text, r.text
    ok = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 2},
                    timeout=30)
    assert ok.status_code == 200


def test_sdk_error_surface(oai) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny", messages=MSG, extra_body={"guided_regex": "("})
    assert "guided_regex" in str(err.value)


PING = {"type": "object", "properties": {"flag": {"type": "boolean"}, "k": {"enum": [1, 2]}}, "required": ["flag"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "ping", "parameters": PING}},
         {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "properties": {
             "q": {"type": "string"}}, "required": ["q"]}}}]


@pytest.mark.parametrize("choice, extra", [
    ({"type": "function", "function": {"name": "ping"}}, {}),
    ("required", {"parallel_tool_calls": False}),
])
def test_forced_tool_call_is_a_parsed_call_with_valid_arguments(oai, choice, extra: dict) -> None:
    out = oai.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=110,
                                      seed=4, extra_body=NO_THINK, **extra)
    c = out.choices[0]
    if c.finish_reason == "length":
        assert not c.message.tool_calls
        return
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0].function
    if isinstance(choice, dict):
        assert call.name == "ping"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.name]
    jsonschema.validate(json.loads(call.arguments), schema)


def test_forced_tool_call_finishes_for_a_small_schema(oai) -> None:
    tools = [{"type": "function", "function": {"name": "go", "parameters": {"type": "object", "properties": {}}}}]
    out = oai.chat.completions.create(model="tiny", messages=MSG, tools=tools, tool_choice="required", max_tokens=80,
                                      parallel_tool_calls=False, extra_body=NO_THINK)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert [t.function.name for t in c.message.tool_calls] == ["go"]
    assert json.loads(c.message.tool_calls[0].function.arguments) == {}


def test_anthropic_tool_choice_tool(anth) -> None:
    tools = [{"name": "go", "input_schema": {"type": "object", "properties": {}}},
             {"name": "ping", "input_schema": PING}]
    msg = anth.messages.create(model="tiny", max_tokens=80, messages=MSG, tools=tools,
                               tool_choice={"type": "tool", "name": "go"}, extra_body={"thinking": {"type": "disabled"}})
    assert msg.stop_reason == "tool_use", msg
    assert [b.name for b in msg.content if b.type == "tool_use"] == ["go"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": MSG, "tools": TOOLS, "tool_choice": {"type": "function",
                                                                             "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"messages": MSG, "tools": TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f"}],
                       "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name"),
    ("/v1/messages", {"max_tokens": 4, "messages": MSG, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                      "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice.name"),
])
def test_forced_tool_errors_name_the_field(server: Server, path: str, body: dict, param: str) -> None:
    r = httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert param in r.text, r.text


def test_concurrent_constrained_and_free_requests(server: Server) -> None:
    """Two requests in one batch: the constrained one conforms, the free one is served as usual."""
    import concurrent.futures

    def post(extra: dict) -> dict:
        r = httpx.post(server.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": MSG, "max_tokens": 24, "seed": 2, **NO_THINK, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        constrained = pool.submit(post, {"guided_choice": ["north", "south"]})
        free = pool.submit(post, {})
        c, f = constrained.result(timeout=120), free.result(timeout=120)
    assert c["finish_reason"] == "stop" and c["message"]["content"] in ("north", "south")
    assert f["finish_reason"] in ("stop", "length")


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_FIELDS = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 20}, st.integers(-20, 20)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 3)),
    st.builds(lambda vals: {"enum": vals}, st.lists(st.sampled_from(["p", "q r", 7, None]), min_size=1, max_size=3,
                                                      unique=True)),
)
SERVER_SCHEMAS = st.dictionaries(st.sampled_from(["a", "b", "c"]), _FIELDS, min_size=1, max_size=3).map(
    lambda props: {"type": "object", "properties": props, "required": sorted(props)[:1],
                   "additionalProperties": False})


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=SERVER_SCHEMAS)
def test_sdk_json_schema_outputs_validate(oai, schema: dict) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    for seed, temperature in ((0, 0.0), (1, 1.0)):
        out = oai.chat.completions.create(model="tiny", messages=MSG, response_format=fmt, max_tokens=40, seed=seed,
                                          temperature=temperature, extra_body=NO_THINK)
        choice = out.choices[0]
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
        else:
            assert choice.finish_reason == "length" and out.usage.completion_tokens == 40
