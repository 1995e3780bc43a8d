"""The three protocols through the official SDKs, against the real engine and the tiny model."""
from __future__ import annotations

import json

import httpx
import pytest
from api_testing import Server

USER = [{"role": "user", "content": "Hello there"}]


# -- OpenAI Chat Completions ----------------------------------------------------------------------
def test_chat_non_streaming(oai) -> None:
    r = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=6, seed=1)
    assert r.object == "chat.completion" and r.model == "tiny" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert isinstance(choice.message.reasoning_content, str)  # thinking is on by default
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.usage.completion_tokens_details.reasoning_tokens <= r.usage.completion_tokens


def test_chat_streaming_with_usage_chunk(oai) -> None:
    chunks = list(oai.chat.completions.create(model="tiny", messages=USER, max_completion_tokens=6, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert all(c.usage is None for c in chunks[:-1])
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks[1:-2])
    content = "".join(c.choices[0].delta.content or "" for c in chunks[1:-2])
    assert reasoning or content or chunks[-1].usage.completion_tokens >= 1


def test_chat_streaming_ends_with_done(server: Server) -> None:
    body = {"model": "tiny", "messages": USER, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["x-request-id"]
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert all(json.loads(d)["object"] == "chat.completion.chunk" for d in data[:-1])


def test_chat_seed_and_greedy_are_reproducible(oai) -> None:
    def run(**kw):
        r = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=6, **kw)
        return r.choices[0].message.reasoning_content, r.choices[0].message.content
    assert run(seed=7, temperature=1.0) == run(seed=7, temperature=1.0)
    assert run(temperature=0) == run(temperature=0)


def test_chat_thinking_off(oai) -> None:
    for extra in ({"enable_thinking": False}, {"chat_template_kwargs": {"enable_thinking": False}},
                  {"reasoning_effort": "none"}):
        r = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=4, extra_body=extra)
        assert getattr(r.choices[0].message, "reasoning_content", None) is None, extra


def test_chat_history_with_reasoning_and_tools_renders(oai) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    r = oai.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=4,
                                    extra_body={"preserve_thinking": True})
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_chat_max_tokens_zero_processes_the_prompt_only(oai) -> None:
    r = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=0)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens > 0 and r.choices[0].finish_reason == "length"


def test_stop_string_ends_the_answer(oai) -> None:
    r = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=4, temperature=0)
    text = (r.choices[0].message.reasoning_content or "") + (r.choices[0].message.content or "")
    if len(text) < 2:
        pytest.skip("the greedy output is too short to stop inside")
    stop = text[1:2]
    again = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=4, temperature=0, stop=[stop])
    out = (again.choices[0].message.reasoning_content or "") + (again.choices[0].message.content or "")
    assert stop not in out and again.choices[0].finish_reason == "stop"


# -- OpenAI Responses -----------------------------------------------------------------------------
def test_responses_chain_store_and_items(oai) -> None:
    first = oai.responses.create(model="tiny", input="Hi", instructions="Be brief.", max_output_tokens=5)
    assert first.object == "response" and first.status in ("completed", "incomplete")
    assert first.usage.input_tokens > 0 and first.usage.output_tokens >= 1
    assert first.output[-1].type == "message"
    second = oai.responses.create(model="tiny", input=[{"role": "user", "content": "And then?"}],
                                  previous_response_id=first.id, max_output_tokens=5)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens  # the chain is part of the prompt
    assert oai.responses.retrieve(second.id).id == second.id
    items = oai.responses.input_items.list(second.id, order="asc", limit=100).data
    assert items[0].type == "message" and items[0].role == "user" and items[-1].role == "user"
    page = oai.responses.input_items.list(second.id, limit=1)
    assert len(page.data) == 1 and page.has_more and page.data[0].id == items[-1].id
    oai.responses.delete(first.id)
    with pytest.raises(Exception) as err:
        oai.responses.retrieve(first.id)
    assert getattr(err.value, "status_code", None) == 404


def test_responses_store_false_is_not_kept(oai) -> None:
    r = oai.responses.create(model="tiny", input="Hi", max_output_tokens=3, store=False)
    with pytest.raises(Exception) as err:
        oai.responses.retrieve(r.id)
    assert getattr(err.value, "status_code", None) == 404


def test_responses_stream_grammar(server: Server) -> None:
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 5, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200
        frames = []
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                frames.append((name, json.loads(line[6:])))
    assert all(n == d["type"] for n, d in frames)
    assert [d["sequence_number"] for _, d in frames] == list(range(len(frames)))
    names = [n for n, _ in frames]
    assert names[:2] == ["response.created", "response.in_progress"]
    terminal = [n for n in names if n in ("response.completed", "response.incomplete", "response.failed")]
    assert terminal == [names[-1]]
    final = frames[-1][1]["response"]
    for kind in ("reasoning", "message"):
        done = [d["item"] for n, d in frames if n == "response.output_item.done" and d["item"]["type"] == kind]
        assert done == [i for i in final["output"] if i["type"] == kind]
    deltas = "".join(d["delta"] for n, d in frames if n == "response.output_text.delta")
    assert deltas == "".join(p["text"] for i in final["output"] if i["type"] == "message" for p in i["content"])


def test_responses_sdk_stream_and_reasoning_effort(oai) -> None:
    with oai.responses.stream(model="tiny", input="Hi", max_output_tokens=4, reasoning={"effort": "none"}) as s:
        types = [e.type for e in s]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
    assert "response.reasoning_text.delta" not in types


def test_responses_input_tokens_counts_like_the_prompt(oai) -> None:
    counted = oai.responses.input_tokens.count(model="tiny", input="Hi", instructions="Be brief.")
    r = oai.responses.create(model="tiny", input="Hi", instructions="Be brief.", max_output_tokens=2)
    assert counted.input_tokens == r.usage.input_tokens


# -- Anthropic Messages ---------------------------------------------------------------------------
def test_messages_with_thinking(anth) -> None:
    m = anth.messages.create(model="tiny", max_tokens=6, messages=USER, system="Be brief.",
                             thinking={"type": "adaptive"})
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.input_tokens > 0
    assert m.content[0].type == "thinking"


def test_messages_without_thinking_and_prefill(anth) -> None:
    m = anth.messages.create(model="tiny", max_tokens=5, thinking={"type": "disabled"}, messages=USER)
    assert all(b.type == "text" for b in m.content)
    prefilled = anth.messages.create(model="tiny", max_tokens=5, messages=USER + [
        {"role": "assistant", "content": "Sure,"}])
    assert all(b.type == "text" for b in prefilled.content)
    def prompt(u) -> int:  # Anthropic counts prefix-cache reads apart from input_tokens
        return u.input_tokens + u.cache_read_input_tokens

    assert prompt(prefilled.usage) > prompt(m.usage)


def test_messages_stream_lifecycle(anth) -> None:
    with anth.messages.stream(model="tiny", max_tokens=6, messages=USER) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events
    assert final.usage.output_tokens >= 1


def test_messages_tool_round_trip_through_the_engine(anth) -> None:
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    history = USER + [
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "Thanks"}]}]
    m = anth.messages.create(model="tiny", max_tokens=5, tools=tools, messages=history)
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    count = anth.messages.count_tokens(model="tiny", tools=tools, messages=history)
    assert count.input_tokens == m.usage.input_tokens


def test_messages_stop_sequence(anth) -> None:
    m = anth.messages.create(model="tiny", max_tokens=4, messages=USER, extra_body={"temperature": 0},
                             thinking={"type": "disabled"})
    text = "".join(b.text for b in m.content if b.type == "text")
    if len(text) < 2:
        pytest.skip("the greedy output is too short to stop inside")
    stop = text[1:2]
    again = anth.messages.create(model="tiny", max_tokens=4, messages=USER, extra_body={"temperature": 0},
                                 thinking={"type": "disabled"}, stop_sequences=["\u0000unused", stop])
    assert again.stop_reason == "stop_sequence" and again.stop_sequence == stop
    assert "".join(b.text for b in again.content if b.type == "text") == text[:text.index(stop)]


def test_count_tokens_matches_usage(anth) -> None:
    count = anth.messages.count_tokens(model="tiny", messages=USER, system="Be brief.")
    m = anth.messages.create(model="tiny", max_tokens=2, messages=USER, system="Be brief.")
    assert count.input_tokens == m.usage.input_tokens


# -- models, health ----------------------------------------------------------------------------------
def test_models_and_health(server: Server, oai) -> None:
    assert [m.id for m in oai.models.list().data] == ["tiny"]
    assert oai.models.retrieve("tiny").id == "tiny"
    r = httpx.get(server.url + "/v1/models/other")
    assert r.status_code == 404 and "other" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
