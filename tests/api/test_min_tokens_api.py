"""vLLM's ``min_tokens`` on the server, through the official openai SDK: Completions, Chat Completions and
Responses honour it (no stop before that many tokens), and a value above the request's budget is a 400."""
from __future__ import annotations

import httpx
import openai
import pytest

import ninfer

PROMPT = [5, 17, 33, 99, 12, 7, 201, 45]
MIN, MAX = 10, 24
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}]}


@pytest.fixture(scope="module")
def ref(dense_ckpt) -> ninfer.LLM:
    """A second engine over the server's checkpoint, for the Python API's view (the server's own ``llm`` is
    stepped by its engine thread, so the test thread must not step it too)."""
    return ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, progress=False)


def _first_new(tokens: list[int], at: int = 2) -> int:
    return next(i for i in range(at, len(tokens)) if tokens[i] not in tokens[:i])


def _completion(oai: openai.OpenAI, **extra):
    return oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX, temperature=0, extra_body=extra)


def test_completions_stop_token_ids_wait_for_min_tokens(oai: openai.OpenAI, ref) -> None:
    free = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX, temperature=0,
                                  extra_body={"ignore_eos": True})
    run = ref.generate([PROMPT], ninfer.SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True))[0].outputs[0]
    assert run.text == free.choices[0].text  # the server's run is the Python API's
    ids = run.token_ids
    stop = ids[_first_new(ids)]
    early = _completion(oai, stop_token_ids=[stop])
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == _first_new(ids) + 1
    out = _completion(oai, stop_token_ids=[stop], min_tokens=MIN)
    assert out.usage.completion_tokens > MIN
    want = ref.generate([PROMPT], ninfer.SamplingParams(temperature=0, max_tokens=MAX, min_tokens=MIN,
                                                       stop_token_ids=[stop]))[0].outputs[0]
    assert out.choices[0].text == want.text and out.usage.completion_tokens == len(want.token_ids)


def test_chat_and_streaming_honour_min_tokens(oai: openai.OpenAI) -> None:
    free = oai.chat.completions.create(**CHAT, max_tokens=MAX, temperature=0, logprobs=True,
                                       extra_body={"ignore_eos": True, "enable_thinking": False})
    pieces = [t.token for t in free.choices[0].logprobs.content]
    # A stop string the free run completes early: a printable piece not seen in the text before it.
    i = next(i for i in range(2, MIN) if pieces[i].strip().isascii() and pieces[i].strip().isprintable()
             and pieces[i].strip() and pieces[i].strip() not in "".join(pieces[:i]))
    stop = pieces[i].strip()
    early = oai.chat.completions.create(**CHAT, max_tokens=MAX, temperature=0, stop=[stop],
                                        extra_body={"enable_thinking": False})
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens <= i + 1
    body = {"enable_thinking": False, "min_tokens": MIN}
    out = oai.chat.completions.create(**CHAT, max_tokens=MAX, temperature=0, stop=[stop], extra_body=body)
    assert out.usage.completion_tokens > MIN
    content = out.choices[0].message.content
    # Stop strings mask no token: the tokens are the free run's, past the early stop.
    assert free.choices[0].message.content.startswith(content) and len(content) > len(early.choices[0].message.content)
    chunks = oai.chat.completions.create(**CHAT, max_tokens=MAX, temperature=0, stop=[stop], extra_body=body,
                                         stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == out.choices[0].message.content


def test_responses_honour_min_tokens(oai: openai.OpenAI) -> None:
    kw = dict(model="tiny", input="Tell me a story", max_output_tokens=MAX, temperature=0,
              extra_body={"enable_thinking": False})
    free = oai.responses.create(**kw)
    text = free.output_text
    stop = text[len(text) // 4: len(text) // 4 + 1]
    early = oai.responses.create(**{**kw, "extra_body": {**kw["extra_body"], "stop": [stop]}})
    assert len(early.output_text) < len(text) // 4 + 1
    out = oai.responses.create(**{**kw, "extra_body": {**kw["extra_body"], "stop": [stop], "min_tokens": MAX}})
    assert out.output_text == text and out.usage.output_tokens == MAX


def test_min_tokens_raises_the_default_budget(oai: openai.OpenAI) -> None:
    """Without max_tokens a request gets the server's default (8 here), raised to its min_tokens."""
    out = oai.chat.completions.create(**CHAT, temperature=0, extra_body={"min_tokens": 12, "ignore_eos": True})
    assert out.usage.completion_tokens == 12
    plain = oai.chat.completions.create(**CHAT, temperature=0, extra_body={"ignore_eos": True})
    assert plain.usage.completion_tokens == 8


@pytest.mark.parametrize("path,body,message", [
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 3, "min_tokens": 4}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 0, "echo": True, "min_tokens": 1},
     "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 3, "min_tokens": 4}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": -1}, "min_tokens"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": "5"}, "min_tokens"),
    ("/v1/responses", {"model": "tiny", "input": "a", "max_output_tokens": 3, "min_tokens": 4},
     "max_output_tokens"),
])
def test_bad_min_tokens_are_400s_naming_it(server, path: str, body: dict, message: str) -> None:
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "min_tokens" and message in r.json()["error"]["message"]
