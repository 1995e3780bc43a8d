"""Service.prompt: a short text prompt is rendered and tokenized on the event loop when nothing else is in
flight; the rest in a worker thread."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

import ninfer
from ninfer.api import service as service_module
from ninfer.api.config import ServerConfig
from ninfer.api.errors import APIError
from ninfer.api.metrics import Metrics
from ninfer.api.service import INLINE_PROMPT_CHARS, ChatInput, Service


@pytest.fixture()
def hops(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The functions Service.prompt hands to a worker thread."""
    calls: list[Any] = []
    to_thread = asyncio.to_thread

    async def recording(fn: Any, *args: Any) -> Any:
        calls.append(fn)
        return await to_thread(fn, *args)
    monkeypatch.setattr(service_module.asyncio, "to_thread", recording)
    return calls


@pytest.fixture()
def svc(llm: ninfer.LLM) -> Service:
    return Service(llm, ServerConfig(), None, Metrics("tiny", 2, 256), "tiny")


def _user(content: Any) -> ChatInput:
    return ChatInput([{"role": "user", "content": content}])


def test_a_short_text_prompt_stays_on_the_loop(svc: Service, hops: list[Any]) -> None:
    chat = _user("hello there")
    prompt = asyncio.run(svc.prompt(chat))
    assert hops == []
    assert prompt.ids == svc.tokenizer.encode(svc.render(chat)[0]) and prompt.media is None


def test_a_short_prompt_goes_to_a_thread_while_other_requests_are_in_flight(svc: Service, hops: list[Any]) -> None:
    svc.in_flight = 1
    chat = _user("hello there")
    prompt = asyncio.run(svc.prompt(chat))
    assert len(hops) == 1
    assert prompt.ids == svc.tokenizer.encode(svc.render(chat)[0])


def test_a_long_prompt_goes_to_a_thread_with_the_same_result(svc: Service, hops: list[Any]) -> None:
    chat = _user("word " * (INLINE_PROMPT_CHARS // 4))
    prompt = asyncio.run(svc.prompt(chat))
    assert len(hops) == 1
    assert prompt.ids == svc.tokenizer.encode(svc.render(chat)[0])


def test_tools_count_toward_the_size(svc: Service, hops: list[Any]) -> None:
    tool = {"type": "function", "function": {"name": "f", "description": "d" * INLINE_PROMPT_CHARS,
                                             "parameters": {"type": "object", "properties": {}}}}
    asyncio.run(svc.prompt(ChatInput([{"role": "user", "content": "hi"}], tools=[tool])))
    assert len(hops) == 1


def test_media_always_go_to_a_thread(svc: Service, hops: list[Any]) -> None:
    chat = _user([{"type": "text", "text": "what is this?"}, {"type": "image", "image": "http://example.com/x.png"}])
    with pytest.raises(APIError) as err:  # this server has no vision: the thread rejects the image
        asyncio.run(svc.prompt(chat))
    assert len(hops) == 1 and err.value.status == 400


def test_a_malformed_media_part_is_an_api_error_on_either_path(svc: Service) -> None:
    chat = _user([{"type": "image_url", "image_url": {"url": ""}}])
    for in_flight in (0, 1):
        svc.in_flight = in_flight
        with pytest.raises(APIError) as info:
            asyncio.run(svc.prompt(chat))
        assert info.value.status == 400 and "no source" in str(info.value)
