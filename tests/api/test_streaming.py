"""SSE framing: the ready-made frames are byte for byte what sse-starlette would write."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from sse_starlette import sse
from sse_starlette.event import ensure_bytes

from ninfer.api.streaming import json_text, sse_frame, sse_response

OBJECTS: list[Any] = [
    {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "héllo ✓ \u2028 \"q\" \n\r\t\\"}}]},
    {"type": "content_block_delta", "delta": {"text": "日本語 🙂"}, "n": 1.5, "ok": True, "none": None},
    [], "", 0,
]
DATA = [json_text(o) for o in OBJECTS] + [json.dumps(o) for o in OBJECTS] + ["[DONE]", "", "two\nlines", "cr\rlf\r\n"]


@pytest.mark.parametrize("obj", OBJECTS)
def test_json_text_is_json_dumps_without_ascii_escaping(obj: Any) -> None:
    assert json_text(obj) == json.dumps(obj, ensure_ascii=False)


@pytest.mark.parametrize("event", [None, "content_block_delta"])
@pytest.mark.parametrize("data", DATA)
def test_sse_frame_is_what_sse_starlette_writes(data: str, event: str | None) -> None:
    assert sse_frame(data, event) == ensure_bytes({"data": data, "event": event}, "\n")


def test_a_send_without_timeout_skips_the_cancel_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    scopes: list[Any] = []
    move_on_after = sse.anyio.move_on_after

    def recording(delay: Any, *a: Any, **k: Any) -> Any:
        scopes.append(delay)
        return move_on_after(delay, *a, **k)
    monkeypatch.setattr(sse.anyio, "move_on_after", recording)

    async def nothing() -> Any:
        yield b""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)
    response = sse_response(nothing(), 15.0, lambda: None)
    message = {"type": "http.response.body", "body": b"data: x\n\n", "more_body": True}
    asyncio.run(response._send_with_timeout(send, message))
    assert sent == [message] and scopes == []
    response.send_timeout = 5.0  # with a timeout, sse-starlette's own scope applies
    asyncio.run(response._send_with_timeout(send, message))
    assert len(sent) == 2 and scopes == [5.0]
