"""Images through the three protocols (``ninfer serve --vision``), against the real engine and a tiny composite model.

The checkpoint and media come from the helpers of tests/vision (a tiny ``Qwen3_5ForConditionalGeneration``
with preprocessor files, gradient images); the server is a real uvicorn server on loopback.
"""
from __future__ import annotations

import base64
import io
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vision"))  # vision_helpers (not a package)

from api_testing import Server, serve, wait_idle
from tiny_checkpoints import make_composite
from vision_helpers import make_image, write_preprocessor_files, write_video

import ninfer
from ninfer.api import ServerConfig
from ninfer.api.cli import add_serve_parser, vision_limits
from ninfer.vision import MultimodalRunner, VisionLimits

MAX_PIXELS = 120 * 120


def _png(height: int, width: int, seed: int) -> bytes:
    buf = io.BytesIO()
    make_image(height, width, seed).save(buf, format="PNG")
    return buf.getvalue()


SMALL = _png(64, 96, 1)
OTHER = _png(80, 48, 2)
LARGE = _png(128, 128, 3)  # over MAX_PIXELS


def _uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vision_llm(tmp_path_factory: pytest.TempPathFactory) -> ninfer.LLM:
    ckpt = make_composite(tmp_path_factory.mktemp("api_vision_ckpt"), seed=7)
    write_preprocessor_files(ckpt.path)
    return ninfer.load(ckpt.path, device="cpu", vision=True, max_concurrency=2, prefill_chunk=32, progress=False,
                       vision_limits=VisionLimits(max_image_pixels=MAX_PIXELS))


@pytest.fixture(scope="module")
def vserver(vision_llm: ninfer.LLM) -> Iterator[Server]:
    with serve(vision_llm, ServerConfig(default_max_tokens=4, model_id="tiny-vl")) as s:
        yield s


def _chat_messages(data: bytes) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": _uri(data)}}]}]


def test_server_never_reads_local_files(vserver: Server, vision_llm: ninfer.LLM, tmp_path: Path) -> None:
    assert vision_llm.vision.limits.allow_local_files is False
    path = tmp_path / "x.png"
    path.write_bytes(SMALL)
    body = {"model": "tiny-vl", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(path)}}]}]}
    r = httpx.post(vserver.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_media", r.text


def test_chat_image_through_the_openai_sdk(vserver: Server, vision_llm: ninfer.LLM) -> None:
    oai = vserver.openai()
    messages = _chat_messages(SMALL)
    r = oai.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=5, temperature=0,
                                    extra_body={"enable_thinking": False})
    canonical = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                              {"type": "image", "image": _uri(SMALL)}]}]
    expected_prompt = vision_llm.vision.prompt_from_messages(canonical, vision_llm.tokenizer, enable_thinking=False)
    assert r.usage.prompt_tokens == len(expected_prompt.input_ids) > 10
    # the same greedy tokens as the reference multimodal runner (vision tower + M-RoPE positions + decode)
    embeds = vision_llm.vision.encode(expected_prompt)
    ids = MultimodalRunner(vision_llm.model).greedy(expected_prompt, embeds, r.usage.completion_tokens,
                                                    stop_ids=sorted(vision_llm.stop_ids),
                                                    vocab_limit=vision_llm.valid_vocab)
    assert len(ids) == r.usage.completion_tokens
    assert r.choices[0].message.content == vision_llm.tokenizer.decode(ids, skip_special_tokens=True)
    # streaming (thinking on, the server default) counts the same prompt as the library does
    chunks = list(oai.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=3, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == vision_llm.count_tokens(canonical, enable_thinking=True)
    empty = oai.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=0,
                                        extra_body={"enable_thinking": False})
    assert empty.usage.prompt_tokens == len(expected_prompt.input_ids)
    wait_idle(vision_llm)


def test_concurrent_image_requests_match_sequential_ones(vserver: Server) -> None:
    from concurrent.futures import ThreadPoolExecutor

    oai = vserver.openai()

    def ask(data: bytes) -> str | None:
        r = oai.chat.completions.create(model="tiny-vl", messages=_chat_messages(data), max_tokens=5, temperature=0,
                                        extra_body={"enable_thinking": False})
        return r.choices[0].message.content
    sequential = [ask(SMALL), ask(OTHER)]
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(ask, [SMALL, OTHER])) == sequential


def test_chat_video_data_uri(vserver: Server, tmp_path: Path) -> None:
    clip = write_video(tmp_path / "clip.mp4", frames=9, fps=6, size=(64, 48))
    uri = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": uri}},
                                             {"type": "text", "text": "What happens?"}]}]
    oai = vserver.openai()
    r = oai.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=2)
    text_only = oai.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": "What happens?"}],
                                            max_tokens=0)
    assert r.usage.prompt_tokens > text_only.usage.prompt_tokens + 8  # timestamps, frame pads
    assert r.usage.completion_tokens >= 1


def test_anthropic_base64_and_url_images(vserver: Server) -> None:
    anth = vserver.anthropic()
    b64 = base64.b64encode(SMALL).decode()
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
              {"type": "text", "text": "Describe it."}]
    messages = [{"role": "user", "content": blocks}]
    r = anth.messages.create(model="tiny-vl", max_tokens=3, messages=messages)
    assert r.stop_reason in ("end_turn", "max_tokens") and r.usage.output_tokens >= 1
    counted = anth.messages.count_tokens(model="tiny-vl", messages=messages).input_tokens
    assert counted == r.usage.input_tokens
    text_only = anth.messages.count_tokens(model="tiny-vl", messages=[
        {"role": "user", "content": "Describe it."}]).input_tokens
    assert counted > text_only + 4  # the image's pads and vision_start/end
    # a url source (here a data URI), and an assistant prefill after an image turn
    url_blocks = [{"type": "image", "source": {"type": "url", "url": _uri(SMALL)}}, blocks[1]]
    prefilled = anth.messages.create(model="tiny-vl", max_tokens=3, messages=[
        {"role": "user", "content": url_blocks}, {"role": "assistant", "content": "It shows"}])
    assert prefilled.usage.input_tokens + prefilled.usage.cache_read_input_tokens > counted  # no thinking, plus the prefill text
    assert all(b.type == "text" for b in prefilled.content)


def test_responses_input_image_and_input_tokens(vserver: Server) -> None:
    oai = vserver.openai()
    content = [{"type": "input_text", "text": "Compare"}, {"type": "input_image", "image_url": _uri(SMALL)},
               {"type": "input_image", "image_url": _uri(OTHER), "detail": "auto"}]
    body_input = [{"role": "user", "content": content}]
    first = oai.responses.create(model="tiny-vl", input=body_input, max_output_tokens=3)
    assert first.status in ("completed", "incomplete")
    counted = httpx.post(vserver.url + "/v1/responses/input_tokens",
                         json={"model": "tiny-vl", "input": body_input}, timeout=30).json()["input_tokens"]
    assert counted == first.usage.input_tokens
    items = oai.responses.input_items.list(first.id, order="asc").data
    assert [p.type for p in items[0].content] == ["input_text", "input_image", "input_image"]
    second = oai.responses.create(model="tiny-vl", previous_response_id=first.id, input="And now?", max_output_tokens=2)
    assert second.usage.input_tokens > first.usage.input_tokens  # the chained images are part of the prompt


def test_over_limit_image_is_a_400_naming_the_limit(vserver: Server) -> None:
    chat = {"model": "tiny-vl", "max_tokens": 2, "messages": _chat_messages(LARGE)}
    r = httpx.post(vserver.url + "/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "media_limit_exceeded" and err["param"] == "max_image_pixels"
    assert "max_image_pixels" in err["message"]
    msg = {"model": "tiny-vl", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": base64.b64encode(LARGE).decode()}}]}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(vserver.url + path, json=msg, timeout=30)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and "max_image_pixels" in r.json()["error"]["message"]
    resp = {"model": "tiny-vl", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": _uri(LARGE)}]}]}
    r = httpx.post(vserver.url + "/v1/responses/input_tokens", json=resp, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_image_pixels"


@pytest.mark.parametrize("part,fragment", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@notbase64@@"}}, "base64"),
    ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGVsbG8="}}, "text/plain"),
    ({"type": "image_url", "image_url": {"url": ""}}, "no source"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "input_audio"),
])
def test_invalid_media_is_a_400(vserver: Server, part: dict, fragment: str) -> None:
    body = {"model": "tiny-vl", "max_tokens": 2, "messages": [{"role": "user", "content": [part]}]}
    r = httpx.post(vserver.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_media" and fragment in r.json()["error"]["message"]


def test_images_outside_user_turns_are_refused(vserver: Server) -> None:
    body = {"model": "tiny-vl", "max_tokens": 2, "messages": [{"role": "system", "content": [
        {"type": "image_url", "image_url": {"url": _uri(SMALL)}}]}, {"role": "user", "content": "hi"}]}
    r = httpx.post(vserver.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_media"
    assert "'messages[0].content[0]'" in r.json()["error"]["message"] and "user messages" in r.json()["error"]["message"]


def test_without_vision_media_get_vision_disabled(server: Server) -> None:
    chat = {"model": "tiny", "max_tokens": 2, "messages": _chat_messages(SMALL)}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "vision_disabled"
    assert "vision" in r.json()["error"]["message"]
    resp = {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": _uri(SMALL)}]}]}
    r = httpx.post(server.url + "/v1/responses", json=resp, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "vision_disabled"
    msg = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": base64.b64encode(SMALL).decode()}}]}]}
    r = httpx.post(server.url + "/v1/messages", json=msg, timeout=30)
    assert r.status_code == 400 and "--vision" in r.json()["error"]["message"]


def test_vision_flags_map_onto_vision_limits() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "m", "--vision", "--max-image-pixels", "1000", "--max-video-frames", "8",
                              "--max-media-tokens", "64", "--max-media-bytes", "4096", "--max-media-items", "2"])
    limits = vision_limits(args)
    assert args.vision and limits.allow_local_files is False
    assert (limits.max_image_pixels, limits.max_video_frames, limits.max_media_tokens, limits.max_media_bytes,
            limits.max_media_items) == (1000, 8, 64, 4096, 2)
    assert vision_limits(parser.parse_args(["serve"])) == VisionLimits(allow_local_files=False)
