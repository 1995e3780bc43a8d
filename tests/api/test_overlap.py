"""Streaming through a server whose engine hands outputs over at its launches (as on CUDA), on CPU."""
from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from api_testing import Server, serve, wait_idle

import ninfer
from ninfer.api import ServerConfig

USER = [{"role": "user", "content": "Tell me a long story"}]


@pytest.fixture(scope="module")
def overlapping(dense_ckpt) -> Iterator[Server]:
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, progress=False)
    llm.engine.launches_async = True  # the CUDA timing: tokens held for the next launch, admissions at a launch
    with serve(llm, ServerConfig(default_max_tokens=12, model_id="tiny")) as s:
        yield s


def _stream(server: Server, max_tokens: int) -> tuple[str, int]:
    chunks = list(server.openai().chat.completions.create(
        model="tiny", messages=USER, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage.completion_tokens


def test_streamed_text_is_the_same_with_and_without_overlap(overlapping: Server, server: Server) -> None:
    held, plain = _stream(overlapping, 12), _stream(server, 12)
    assert held == plain
    reply = overlapping.openai().chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == held[0]


def test_concurrent_streams_complete_with_overlap(overlapping: Server) -> None:
    with ThreadPoolExecutor(5) as pool:  # more than the lanes: some wait, some decode side by side
        results = list(pool.map(lambda _: _stream(overlapping, 10), range(5)))
    assert all(n == 10 for _, n in results)
    assert not overlapping.app.state.service.engine._held
    wait_idle(overlapping.llm)
