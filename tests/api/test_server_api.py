"""Chat n, served model names, the chat-template override, tokenize routes, access log and metrics, on loopback."""
from __future__ import annotations

import logging

import httpx
import openai
import pytest

import ninfer
from ninfer.api import ServerConfig

from api_testing import ScriptedEngine, serve, wait_idle


def test_chat_n_shares_the_prompt(oai: openai.OpenAI, server, llm: ninfer.LLM) -> None:
    prefix = llm.engine.prefix
    assert prefix is not None  # on by default: what the samples share
    before = prefix.stats.hits
    out = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a fresh prompt"}], n=3,
                                      max_tokens=4, temperature=0, extra_body={"enable_thinking": False})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) == 1  # greedy: the samples agree
    assert out.usage.completion_tokens % 3 == 0 and 3 <= out.usage.completion_tokens <= 12
    assert prefix.stats.hits >= before + 2  # samples 1 and 2 resumed from sample 0's prompt checkpoint
    wait_idle(llm)


def test_chat_n_streams_every_index(oai: openai.OpenAI, llm: ninfer.LLM) -> None:
    finishes = {}
    for chunk in oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                             max_tokens=3, stream=True):
        for c in chunk.choices:
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert set(finishes) == {0, 1}
    wait_idle(llm)


def test_tokenize_and_detokenize(server, llm: ninfer.LLM) -> None:
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": "Hello world"})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == llm.tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == llm.engine.config.max_context
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages, "return_token_strs": True})
    text = llm.tokenizer.apply_chat_template(messages, enable_thinking=True)
    assert r.json()["tokens"] == llm.tokenizer.encode(text) and len(r.json()["token_strs"]) == r.json()["count"]
    r = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello world"}
    for path, payload, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": messages},
                                                                "messages"),
                                 ("/tokenize", {"prompt": "a", "tools": []}, "tools"),
                                 ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
                                 ("/detokenize", {"tokens": [1], "x": 1}, "x")):
        r = httpx.post(server.url + path, json=payload)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, payload, r.text)
    assert httpx.get(server.url + "/version").json()["version"]


def test_served_names_and_strict_models(llm: ninfer.LLM) -> None:
    engine = ScriptedEngine(llm, pieces=[("", "ok")])
    with serve(llm, ServerConfig(default_max_tokens=4), engine=engine,
               served_model_names=["alpha", "beta"]) as s:
        assert [m.id for m in s.openai().models.list()] == ["alpha", "beta"]
        out = s.openai().chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
        assert out.model == "other"  # served anyway, named as asked
        assert s.openai().completions.create(model="beta", prompt="x").model == "beta"
    with serve(llm, ServerConfig(default_max_tokens=4), engine=engine, served_model_names=["alpha"],
               strict_model_names=True) as s:
        with pytest.raises(openai.NotFoundError) as err:
            s.openai().chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
        assert err.value.code == "model_not_found"
        assert s.anthropic().messages.create(model="alpha", max_tokens=4,
                                             messages=[{"role": "user", "content": "x"}]).model == "alpha"
        for path, body in (("/v1/completions", {"model": "other", "prompt": "x"}),
                           ("/tokenize", {"model": "other", "prompt": "x"}),
                           ("/v1/responses", {"model": "other", "input": "x"}),
                           ("/v1/messages/count_tokens", {"model": "other", "messages": [{"role": "user",
                                                                                          "content": "x"}]})):
            assert httpx.post(s.url + path, json=body).status_code == 404, path


def test_chat_template_override(llm: ninfer.LLM, tmp_path) -> None:
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}ANSWER:"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    with serve(llm, ServerConfig(default_max_tokens=4), engine=ScriptedEngine(llm),
               chat_template=str(path)) as s:
        r = httpx.post(s.url + "/tokenize", json={"messages": [{"role": "user", "content": "hey"}]})
        assert r.json()["tokens"] == llm.tokenizer.encode("<<hey>>ANSWER:")
    with pytest.raises(ValueError, match="chat_template"):
        ninfer.api.create_app(llm, chat_template="{% for %}")


def test_access_log_and_metrics(llm: ninfer.LLM, caplog) -> None:
    engine = ScriptedEngine(llm, pieces=[("", "a"), ("", "b"), ("", "c")], step_s=0.01)
    with serve(llm, ServerConfig(default_max_tokens=4, model_id="tiny"), engine=engine, access_log=True) as s:
        with caplog.at_level(logging.INFO, logger="ninfer.api.access"):
            s.openai().completions.create(model="tiny", prompt="x", max_tokens=3)
            httpx.post(s.url + "/v1/completions", json={"prompt": "x", "suffix": "y"})
        lines = [r.getMessage() for r in caplog.records if r.name == "ninfer.api.access"]
        assert any(line.startswith("POST /v1/completions 200 ") for line in lines)
        assert any(line.startswith("POST /v1/completions 400 ") for line in lines)
        text = httpx.get(s.url + "/metrics").text
    for name in ("ninfer_time_to_first_token_seconds_bucket", "ninfer_time_per_output_token_seconds_bucket",
                 "ninfer_inter_token_latency_seconds_bucket", "ninfer_request_queue_seconds_bucket",
                 "ninfer_prompt_tokens_total", "ninfer_generation_tokens_total"):
        assert f'{name}{{' in text and 'model_name="tiny"' in text, name
    assert 'ninfer_http_responses_total{model_name="tiny",route="/v1/completions",status="400"} 1.0' in text
    for counter in ("ninfer_prefill_tokens_total", "ninfer_prefix_cache_hits_total"):
        assert f"# TYPE {counter} counter" in text
    lines = [line for line in text.splitlines() if line.startswith("ninfer_generation_tokens_total{")]
    assert lines and float(lines[0].split()[-1]) == 3.0


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MESSAGES = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {**CHAT, "bogus": 1}, "bogus"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": 9}, "min_tokens"),  # above max_tokens (2)
    ("/v1/chat/completions", {**CHAT, "skip_special_tokens": False}, "skip_special_tokens"),
    ("/v1/chat/completions", {**CHAT, "use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo"),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {**CHAT, "chat_template": "{{ x }}"}, "chat_template"),
    ("/v1/chat/completions", {**CHAT, "bad_words": ["x"]}, "bad_words"),
    ("/v1/chat/completions", {**CHAT, "service_tier": "flex"}, "service_tier"),
    ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ("/v1/messages", {**MESSAGES, "bogus": 1}, None),
    ("/v1/messages", {**MESSAGES, "container": "c1"}, None),
    ("/v1/messages", {**MESSAGES, "speed": "fast"}, None),
    ("/v1/responses", {"model": "tiny", "input": "hi", "service_tier": "flex"}, "service_tier"),
])
def test_fields_that_cannot_be_honoured_are_400s_naming_them(server, path: str, body: dict, param: str | None) -> None:
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
    else:  # Anthropic errors have no param: the message names the field
        name = next(k for k in body if k not in MESSAGES)
        assert f"'{name}'" in r.json()["error"]["message"]


def test_neutral_and_honoured_extensions_are_accepted(oai: openai.OpenAI, server, llm: ninfer.LLM) -> None:
    out = oai.chat.completions.create(**CHAT, extra_body={
        "skip_special_tokens": True, "add_generation_prompt": True, "min_tokens": 0, "ignore_eos": True,
        "stop_token_ids": [], "priority": 0, "user": "u1", "metadata": {"k": "v"}, "service_tier": "auto"})
    assert out.usage.completion_tokens == 2
    reply = server.anthropic().messages.create(**MESSAGES, metadata={"user_id": "u"}, service_tier="auto")
    assert reply.usage.output_tokens >= 1
    resp = oai.responses.create(model="tiny", input="hi", max_output_tokens=2,
                                include=["message.output_text.logprobs"])
    texts = [c for item in resp.output if item.type == "message" for c in item.content]
    assert texts and all(c.logprobs for c in texts if c.text)
    wait_idle(llm)


def test_tokenize_counts_like_the_chat_route(server, llm: ninfer.LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    tok = httpx.post(server.url + "/tokenize", json={"messages": messages, "add_special_tokens": True,
                                                     "enable_thinking": False}).json()
    chat = server.openai().chat.completions.create(model="tiny", messages=messages, max_tokens=0,
                                                   extra_body={"enable_thinking": False})
    assert tok["count"] == chat.usage.prompt_tokens
    raw = httpx.post(server.url + "/tokenize", json={"prompt": "hello", "add_special_tokens": True}).json()
    assert raw["tokens"] == llm.tokenizer.hf.encode("hello", add_special_tokens=True)


def test_chat_stream_with_nothing_to_generate(oai: openai.OpenAI) -> None:
    chunks = list(oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=0, n=2, stream=True, stream_options={"include_usage": True}))
    assert sorted(c.choices[0].index for c in chunks if c.choices) == [0, 1]
    assert all(c.choices[0].finish_reason == "length" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens > 0
