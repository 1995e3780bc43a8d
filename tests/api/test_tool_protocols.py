"""Parsed tool calls as each protocol's tool calls, streamed and not (scripted engine events)."""
from __future__ import annotations

import json

import httpx
import pytest
from api_testing import ScriptedEngine, Server

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n" \
       "</parameter>\n</function>\n</tool_call>"
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                  "parameters": WEATHER}}]


@pytest.fixture()
def tool_script(scripted: tuple[Server, ScriptedEngine]) -> tuple[Server, ScriptedEngine]:
    server, engine = scripted
    # The call arrives in small pieces, split inside tags, after some reasoning and text.
    engine.pieces = [("Need the", ""), (" weather.", ""), ("", "Checking.\n\n")] + \
        [("", CALL[i:i + 7]) for i in range(0, len(CALL), 7)]
    engine.finish_reason, engine.prefill_s, engine.queue_s = "stop", 0.0, 0.0
    return server, engine


def test_chat_tool_calls(tool_script) -> None:
    server, _ = tool_script
    r = server.openai().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                                tools=OPENAI_TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert choice.message.reasoning_content == "Need the weather."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}


def test_chat_tool_calls_streamed(tool_script) -> None:
    server, _ = tool_script
    with server.openai().chat.completions.stream(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                                 tools=OPENAI_TOOLS) as stream:
        chunks = [e for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    tool_deltas = [c.chunk.choices[0].delta.tool_calls for c in chunks
                   if c.chunk.choices and c.chunk.choices[0].delta.tool_calls]
    assert len(tool_deltas) == 1 and tool_deltas[0][0].index == 0
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert message.content == "Checking."
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}


def test_tool_choice_none_leaves_the_text_alone(tool_script) -> None:
    server, _ = tool_script
    r = server.openai().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                                tools=OPENAI_TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == "Checking.\n\n" + CALL


def test_malformed_call_degrades_to_text(scripted) -> None:
    server, engine = scripted
    broken = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"
    engine.pieces, engine.finish_reason = [("", "Hi "), ("", broken[:9]), ("", broken[9:])], "stop"
    r = server.openai().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                tools=OPENAI_TOOLS)
    assert r.choices[0].message.content == "Hi " + broken
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"


def test_responses_function_calls(tool_script) -> None:
    server, _ = tool_script
    client = server.openai()
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    r = client.responses.create(model="tiny", input="Weather?", tools=tools)
    assert r.status == "completed"
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    call = r.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 3}
    # The next turn sends the tool result back through the stored chain.
    engine_result = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    follow = client.responses.create(model="tiny", previous_response_id=r.id, input=engine_result, tools=tools)
    items = client.responses.input_items.list(follow.id, order="asc").data
    assert [i.type for i in items] == ["message", "reasoning", "message", "function_call", "function_call_output"]

    with client.responses.stream(model="tiny", input="Weather?", tools=tools) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    assert types[-1] == "response.completed"
    assert json.loads(final.output[-1].arguments) == {"city": "Paris", "days": 3}


def test_anthropic_tool_use(tool_script) -> None:
    server, _ = tool_script
    client = server.anthropic()
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
    m = client.messages.create(model="tiny", max_tokens=64, tools=tools,
                               messages=[{"role": "user", "content": "Weather?"}])
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "Need the weather." and m.content[0].signature
    assert m.content[2].name == "get_weather" and m.content[2].input == {"city": "Paris", "days": 3}

    with client.messages.stream(model="tiny", max_tokens=64, tools=tools,
                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Paris", "days": 3}

    # A tool_result turn is accepted and rendered (the next answer is the script again).
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                                 {"type": "tool_use", "id": m.content[2].id, "name": "get_weather",
                                                  "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[2].id,
                                             "content": "sunny"}]}]
    again = client.messages.create(model="tiny", max_tokens=64, tools=tools, messages=history)
    assert again.stop_reason == "tool_use"


def test_anthropic_thinking_budget_is_accepted(tool_script) -> None:
    server, _ = tool_script
    m = server.anthropic().messages.create(model="tiny", max_tokens=2048, messages=[{"role": "user", "content": "x"}],
                                           thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.content[0].type == "thinking" and m.content[0].thinking == "Need the weather."
    off = server.anthropic().messages.create(model="tiny", max_tokens=16, thinking={"type": "disabled"},
                                             messages=[{"role": "user", "content": "x"}])
    assert off.content[0].type == "thinking"  # the script always reasons; the prompt had thinking off


def test_anthropic_stream_event_grammar(tool_script) -> None:
    server, _ = tool_script
    body = {"model": "tiny", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "get_weather", "input_schema": WEATHER}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["request-id"]
        frames = _frames(r.iter_lines())
    names = [n for n, _ in frames]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    open_index = None
    for name, data in frames:
        assert data["type"] == name
        if name == "content_block_start":
            assert open_index is None
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    kinds = [d["delta"]["type"] for n, d in frames if n == "content_block_delta"]
    assert "thinking_delta" in kinds and "signature_delta" in kinds and "input_json_delta" in kinds


def test_logprobs_are_rendered_when_the_engine_reports_them(scripted, monkeypatch) -> None:
    server, engine = scripted
    monkeypatch.setattr(engine, "logprobs", True)
    monkeypatch.setattr(server.llm.engine, "supports_logprobs", True, raising=False)
    engine.pieces, engine.finish_reason = [("", "a"), ("", "b")], "length"
    r = server.openai().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                logprobs=True, top_logprobs=2,
                                                extra_body={"enable_thinking": False})
    entries = r.choices[0].logprobs.content
    assert len(entries) == 2 and entries[0].logprob == -0.5 and len(entries[0].top_logprobs) == 2


def _frames(lines) -> list[tuple[str, dict]]:
    frames, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            frames.append((name, json.loads(line[len("data: "):])))
    return frames


def test_engine_errors_are_reported_in_each_protocol(scripted) -> None:
    server, engine = scripted
    engine.pieces, engine.finish_reason = [("", "partial")], "error"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**chat, "stream": True}) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["code"] == "engine_error"
    with httpx.stream("POST", server.url + "/v1/responses", json={"model": "tiny", "input": "x", "stream": True}) as r:
        frames = _frames(r.iter_lines())
    assert frames[-1][0] == "response.failed" and frames[-1][1]["response"]["error"]["code"] == "engine_error"
    body = {"model": "tiny", "max_tokens": 8, "stream": True, "messages": chat["messages"]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body) as r:
        frames = _frames(r.iter_lines())
    assert frames[-1][0] == "error" and frames[-1][1]["error"]["type"] == "api_error"
    assert server.service.in_flight == 0


def test_responses_logprobs_when_the_engine_reports_them(scripted, monkeypatch) -> None:
    server, engine = scripted
    monkeypatch.setattr(engine, "logprobs", True)
    monkeypatch.setattr(server.llm.engine, "supports_logprobs", True, raising=False)
    engine.pieces, engine.finish_reason = [("", "a"), ("", "b")], "stop"
    client = server.openai()
    r = client.responses.create(model="tiny", input="x", top_logprobs=2, reasoning={"effort": "none"})
    entries = r.output[-1].content[0].logprobs
    assert len(entries) == 2 and entries[0].logprob == -0.5 and len(entries[0].top_logprobs) == 2
    with client.responses.stream(model="tiny", input="x", top_logprobs=2) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert [len(d.logprobs) for d in deltas] == [1, 1]
    assert len(final.output[-1].content[0].logprobs) == 2
