"""Bad media, limits, sources and caches: every client mistake is a MediaError that says what is wrong."""
from __future__ import annotations

import base64
import http.server
import io
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from vision_helpers import make_image

from ninfer.checkpoint import CheckpointError
from ninfer.vision import (
    ByteLRU,
    MediaError,
    MediaLimitError,
    MediaRef,
    VisionDisabledError,
    VisionLimits,
    VisionPipeline,
    canonical_part,
    collect_media,
    error_code,
    load_vision_tower,
    rebase_local_paths,
    reject_media,
)


def _pipeline_with(pipeline: VisionPipeline, **limits) -> VisionPipeline:
    return VisionPipeline(pipeline.tower, pipeline.tokens, pipeline.processor, VisionLimits(**limits))


def _data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _png_bytes(h: int = 40, w: int = 30, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    make_image(h, w, seed).save(buf, format="PNG")
    return buf.getvalue()


def test_sources_agree_path_file_url_data_uri_bytes(vision_setup, pipeline: VisionPipeline) -> None:
    path = vision_setup.media_dir / "wide.png"
    data = path.read_bytes()
    sources = [str(path), path.as_uri(), _data_uri(data, "image/png"), data]
    items = [pipeline.prepare_media(MediaRef("image", s)) for s in sources]
    assert all(torch.equal(i.pixels, items[0].pixels) and i.key == items[0].key for i in items)


def test_http_url(vision_setup, pipeline: VisionPipeline) -> None:
    directory = str(vision_setup.media_dir)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=directory, **kwargs)

        def log_message(self, *args):  # keep pytest output clean
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(MediaError, match="was not fetched"):  # loopback: refused by default
            pipeline.prepare_media(MediaRef("image", f"{base}/tall.jpg"))
        private = _pipeline_with(pipeline, allow_private_media=True)
        got = private.prepare_media(MediaRef("image", f"{base}/tall.jpg"))
        local = pipeline.prepare_media(MediaRef("image", str(vision_setup.media_dir / "tall.jpg")))
        assert torch.equal(got.pixels, local.pixels)
        with pytest.raises(MediaError, match="URL .*/missing.png' was not fetched"):
            private.prepare_media(MediaRef("image", f"{base}/missing.png"))
        with pytest.raises(MediaLimitError, match="max_media_bytes"):
            _pipeline_with(pipeline, max_media_bytes=1000, allow_private_media=True).prepare_media(
                MediaRef("image", f"{base}/big.png"))
    finally:
        server.shutdown()


@pytest.mark.parametrize("source, message", [
    (_data_uri(b"definitely not an image", "image/png"), "cannot decode the image"),
    (_data_uri(_png_bytes()[:80], "image/png"), "truncated or corrupt|cannot decode"),
    (_data_uri(b"hello", "text/plain"), "unsupported media type 'text/plain'"),
    ("data:image/png;base64,@@@not-base64@@@", "not valid base64"),
    ("data:image/png;base64", "malformed data URI"),
    ("ftp://example.com/a.png", "unsupported image URL scheme 'ftp'"),
    ("/no/such/file.png", "image file not found"),
    (12345, "unsupported image source of type int"),
])
def test_bad_images(pipeline: VisionPipeline, source, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        pipeline.prepare_media(MediaRef("image", source))


def test_bad_videos(vision_setup, pipeline: VisionPipeline, tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="cannot decode the video"):
        pipeline.prepare_media(MediaRef("video", _data_uri(b"\x00\x00\x00\x18ftypmp42garbage" * 20, "video/mp4")))
    with pytest.raises(MediaError, match="unsupported media type 'image/png' for a video part"):
        pipeline.prepare_media(MediaRef("video", _data_uri(_png_bytes(), "image/png")))
    clip = (vision_setup.media_dir / "clip.mp4").read_bytes()
    with pytest.raises(MediaError, match="cannot decode the video"):
        pipeline.prepare_media(MediaRef("video", clip[: len(clip) // 3]))  # the index (moov) is at the end


def test_limits_name_the_limit(vision_setup, pipeline: VisionPipeline, llm) -> None:
    media = vision_setup.media_dir
    with pytest.raises(MediaLimitError, match=r"300x400 = 120000 pixels.*\(limit max_image_pixels\)") as err:
        _pipeline_with(pipeline, max_image_pixels=100_000).prepare_media(MediaRef("image", str(media / "big.png")))
    assert err.value.limit == "max_image_pixels"
    with pytest.raises(MediaLimitError, match="5 sampled frames") as err:
        _pipeline_with(pipeline, max_video_frames=4).prepare_media(MediaRef("video", str(media / "clip.mp4")))
    assert err.value.limit == "max_video_frames"
    with pytest.raises(MediaLimitError, match="max_media_bytes"):
        _pipeline_with(pipeline, max_media_bytes=100).prepare_media(MediaRef("image", str(media / "tiny.png")))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": str(media / n)}
                                             for n in ("wide.png", "tall.jpg", "tiny.png")]}]
    with pytest.raises(MediaLimitError, match="more than 20 vision tokens") as err:
        _pipeline_with(pipeline, max_media_tokens=20).prompt_from_messages(messages, llm.tokenizer)
    assert err.value.limit == "max_media_tokens"
    with pytest.raises(MediaLimitError, match="max_media_items"):
        _pipeline_with(pipeline, max_media_items=2).prompt_from_messages(messages, llm.tokenizer)
    with pytest.raises(MediaError, match="local image paths are not allowed"):
        _pipeline_with(pipeline, allow_local_files=False).prepare_media(MediaRef("image", str(media / "tiny.png")))


def test_aspect_ratio_and_placeholder_mismatch(pipeline: VisionPipeline, llm) -> None:
    buf = io.BytesIO()
    make_image(2, 500, 0).save(buf, format="PNG")
    with pytest.raises(MediaError, match="aspect ratio above 200"):
        pipeline.prepare_media(MediaRef("image", buf.getvalue()))
    messages = [{"role": "user", "content": [{"type": "text", "text": "typed <|image_pad|> by hand"}]}]
    with pytest.raises(MediaError, match="1 image/video placeholders but 0 media"):
        pipeline.prompt_from_messages(messages, llm.tokenizer)


def test_message_part_shapes_and_disabled_vision() -> None:
    png = _data_uri(b"x", "image/png")
    messages = [
        {"role": "system", "content": "plain text"},
        {"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u1"}},  # OpenAI chat
            {"type": "input_image", "image_url": "u2"},  # OpenAI Responses
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "eA=="}},  # Anthropic
            {"type": "image", "source": {"type": "url", "url": "u3"}},
            {"type": "video_url", "video_url": {"url": "v1"}}, {"type": "video", "video": "v2"},
            {"type": "image", "image": png}]},
    ]
    refs = collect_media(messages)
    assert [(r.kind, r.source) for r in refs] == [
        ("image", "u1"), ("image", "u2"), ("image", png), ("image", "u3"), ("video", "v1"), ("video", "v2"),
        ("image", png)]
    with pytest.raises(MediaError, match="image part has no source"):
        collect_media([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(VisionDisabledError, match="vision is disabled") as err:
        reject_media(messages)
    assert error_code(err.value) == "vision_disabled"
    assert error_code(MediaLimitError("max_media_tokens", "x")) == "media_limit_exceeded"
    assert error_code(MediaError("x")) == "invalid_media"
    reject_media([{"role": "user", "content": "text only"}])
    assert canonical_part({"type": "input_image", "image_url": "u"}) == {"type": "image", "image": "u"}
    assert canonical_part({"type": "text", "text": "t"}) is None


def test_rebase_local_paths(vision_setup) -> None:
    media = vision_setup.media_dir
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "wide.png"}},
                                             {"type": "image_url", "image_url": "https://x/y.png"},
                                             {"type": "text", "text": "hi"}]}]
    rebased = rebase_local_paths(messages, media)
    assert [(r.kind, r.source) for r in collect_media(rebased)] == [("image", str(media / "wide.png")),
                                                                    ("image", "https://x/y.png")]
    assert rebased[0]["content"][2] == {"type": "text", "text": "hi"} and messages[0]["content"][0]["image_url"] == {
        "url": "wide.png"}


def test_caches_hit_by_content_and_stay_bounded(vision_setup, pipeline: VisionPipeline, llm) -> None:
    path = vision_setup.media_dir / "wide.png"
    first = pipeline.prepare_media(MediaRef("image", str(path)))
    again = pipeline.prepare_media(MediaRef("image", _data_uri(path.read_bytes(), "image/png")))
    assert again is first  # same bytes, different source: one cached entry
    prompt = pipeline.prompt_from_messages(
    [{"role": "user", "content": [{"type": "image", "image": str(path)}]}], llm.tokenizer)
    embeds = pipeline.encode(prompt)
    assert pipeline.embeddings.get(first.key) is not None
    assert torch.equal(pipeline.encode(prompt), embeds)
    lru: ByteLRU[str] = ByteLRU(max_bytes=10)
    for i in range(5):
        lru.put(str(i), "v", 4)
    assert len(lru) == 2 and lru.bytes == 8 and lru.get("0") is None and lru.get("4") == "v"
    lru.put("huge", "v", 11)  # larger than the whole cache: not stored
    assert lru.get("huge") is None


def test_loader_errors(vision_setup, tmp_path: Path, dense_ckpt) -> None:
    from ninfer.config import load_config

    with pytest.raises(CheckpointError, match="text-only, vision is unavailable"):
        load_vision_tower(dense_ckpt.path, load_config(dense_ckpt.path), "cpu", torch.float32)
    src = vision_setup.ckpt.path
    config = load_config(src)
    for edit, message in (("drop", "missing 1 vision tensors: blocks.1.attn.proj.bias"),
                          ("reshape", r"model.visual.merger.linear_fc2.weight has shape \[64, 12\]")):
        dst = tmp_path / edit
        shutil.copytree(src, dst)
        tensors = load_file(dst / "model.safetensors")
        if edit == "drop":
            del tensors["model.visual.blocks.1.attn.proj.bias"]
        else:
            tensors["model.visual.merger.linear_fc2.weight"] = torch.zeros(64, 12)
        save_file(tensors, dst / "model.safetensors")
        with pytest.raises(CheckpointError, match=message):
            load_vision_tower(dst, config, "cpu", torch.float32)
