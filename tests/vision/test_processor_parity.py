"""Preprocessing equals transformers' Qwen3.5 processor: pixel values, grids, timestamps and prompt ids."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from vision_helpers import make_image

from ninfer.vision import (
    MediaRef,
    VisionPipeline,
    build_prompt,
    collect_media,
    load_processor_config,
)
from ninfer.vision.processor import smart_resize

IMAGES = ["wide.png", "tall.jpg", "tiny.png", "big.png", "alpha.png"]


def _hf_image(hf_processor, image: Image.Image) -> tuple[torch.Tensor, list[int]]:
    out = hf_processor.image_processor(images=[image], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"][0].tolist()


@pytest.mark.parametrize("name", IMAGES)
def test_image_pixels_and_grid_match(vision_setup, hf_processor, pipeline: VisionPipeline, name: str) -> None:
    path = vision_setup.media_dir / name
    ours = pipeline.prepare_media(MediaRef("image", str(path)))
    ref_pixels, ref_grid = _hf_image(hf_processor, Image.open(path))
    assert list(ours.grid) == ref_grid
    assert torch.equal(ours.pixels, ref_pixels)  # same torchvision ops in the same order: bit-identical


def test_grids_cover_both_resize_branches(vision_setup, pipeline: VisionPipeline) -> None:
    grids = {n: pipeline.prepare_media(MediaRef("image", str(vision_setup.media_dir / n))).grid for n in IMAGES}
    assert grids["tiny.png"][1] * grids["tiny.png"][2] * 256 >= 4096  # scaled up to min_pixels
    assert grids["big.png"][1] * grids["big.png"][2] * 256 <= 65536  # scaled down to max_pixels
    assert grids["wide.png"][2] > grids["wide.png"][1] and grids["tall.jpg"][1] > grids["tall.jpg"][2]


def test_exif_orientation_matches_transformers_load_image(tmp_path: Path, hf_processor,
                                                          pipeline: VisionPipeline) -> None:
    from transformers.image_utils import load_image

    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    make_image(40, 100, 9).save(path, exif=exif, quality=95)
    ours = pipeline.prepare_media(MediaRef("image", str(path)))
    ref_pixels, ref_grid = _hf_image(hf_processor, load_image(str(path)))
    assert list(ours.grid) == ref_grid and ref_grid[1] > ref_grid[2]  # upright: taller than wide
    assert torch.equal(ours.pixels, ref_pixels)


def _hf_video_frames(path: Path) -> tuple[np.ndarray, dict]:
    from transformers.video_utils import read_video_pyav

    frames, meta = read_video_pyav(str(path), sample_indices_fn=lambda metadata, **_: np.arange(
    metadata.total_num_frames))
    return frames, {"fps": meta.fps, "total_num_frames": meta.total_num_frames}


def test_video_pixels_grid_and_timestamps_match(vision_setup, hf_processor, pipeline: VisionPipeline) -> None:
    path = vision_setup.media_dir / "clip.mp4"
    ours = pipeline.prepare_media(MediaRef("video", str(path)))
    frames, meta = _hf_video_frames(path)
    out = hf_processor.video_processor(videos=[frames], video_metadata=[meta], return_metadata=True,
                                       cap_pixels_per_frame=False, return_tensors="pt")
    assert list(ours.grid) == out["video_grid_thw"][0].tolist()
    assert ours.grid[0] == 3  # 5 sampled frames, padded to 6 by repeating the last
    assert torch.equal(ours.pixels, out["pixel_values_videos"])
    hf_meta = out["video_metadata"][0]
    stamps = hf_processor._calculate_timestamps(hf_meta.frames_indices, hf_meta.fps, 2)
    assert ours.timestamps == pytest.approx(stamps)


def _messages(media: Path) -> list[dict]:
    return [
        {"role": "system", "content": "You look at pictures."},
        {"role": "user", "content": [
            {"type": "text", "text": "First "},
            {"type": "image_url", "image_url": {"url": str(media / "wide.png")}},
            {"type": "text", "text": " then a clip "},
            {"type": "video_url", "video_url": {"url": str(media / "clip.mp4")}},
            {"type": "text", "text": " and a tall one "},
            {"type": "image_url", "image_url": str(media / "tall.jpg")},
            {"type": "text", "text": " - compare."},
        ]},
    ]


def _hf_inputs(hf_processor, text: str, media: Path):
    frames, meta = _hf_video_frames(media / "clip.mp4")
    return hf_processor(text=[text], images=[Image.open(media / "wide.png"), Image.open(media / "tall.jpg")],
                        videos=[frames], video_metadata=[meta], cap_pixels_per_frame=False, return_tensors="pt")


def test_prompt_ids_match_processor(vision_setup, hf_processor, llm, pipeline: VisionPipeline) -> None:
    """Up to transformers 5.24 its processor keeps the template's outer vision_start/end around a video (our
    "transformers" layout); Qwen's own processor replaces the triple ("qwen", the default), and from 5.25 so does
    transformers'. Before 5.25 the two are equal once those two tokens go."""
    messages = _messages(vision_setup.media_dir)
    text = llm.tokenizer.apply_chat_template(messages)
    ref = _hf_inputs(hf_processor, text, vision_setup.media_dir)
    ref_ids, ref_types = ref["input_ids"][0].tolist(), ref["mm_token_type_ids"][0].tolist()
    qwen = pipeline.prompt_from_messages(messages, llm.tokenizer)
    assert len(qwen.input_ids) == pipeline.count_tokens(messages, llm.tokenizer)
    if tuple(int(part) for part in transformers.__version__.split(".")[:2]) >= (5, 25):
        assert qwen.input_ids == ref_ids and qwen.mm_types == ref_types
        return
    media = pipeline.prepare_all(collect_media(messages))
    ids = llm.tokenizer.encode(text)
    hf_layout = build_prompt(ids, media, pipeline.tokens, 2, llm.tokenizer.encode, "transformers")
    assert hf_layout.input_ids == ref_ids
    assert hf_layout.mm_types == ref_types
    video = [i for i, t in enumerate(ref_types) if t == 2]
    # Drop the outer pair: the vision_start before the first timestamp, the vision_end after the last frame's.
    stamp = llm.tokenizer.encode(f"<{qwen.media[1].timestamps[0]:.1f} seconds>")
    outer_start, outer_end = video[0] - len(stamp) - 2, video[-1] + 2
    assert ref_ids[outer_start] == pipeline.tokens.vision_start and ref_ids[outer_end] == pipeline.tokens.vision_end
    stripped = [t for i, t in enumerate(ref_ids) if i not in (outer_start, outer_end)]
    assert qwen.input_ids == stripped


def test_image_only_prompt_ids_equal_processor(vision_setup, hf_processor, llm, pipeline: VisionPipeline) -> None:
    media = vision_setup.media_dir
    messages = [{"role": "user", "content": [{"type": "image", "image": str(media / "tiny.png")},
                                             {"type": "text", "text": "What is this?"}]}]
    text = llm.tokenizer.apply_chat_template(messages, add_vision_id=True)
    ref = hf_processor(text=[text], images=[Image.open(media / "tiny.png")], return_tensors="pt")
    ours = pipeline.prompt_from_messages(messages, llm.tokenizer, add_vision_id=True)
    assert ours.input_ids == ref["input_ids"][0].tolist()
    assert ours.mm_types == ref["mm_token_type_ids"][0].tolist()


def test_processor_config_defaults_and_legacy_keys(tmp_path: Path) -> None:
    cfg = load_processor_config(tmp_path)  # no files: the values Qwen ships
    assert (cfg.image.min_pixels, cfg.image.max_pixels) == (65536, 16777216)
    assert (cfg.video.min_pixels, cfg.video.max_pixels, cfg.video.fps) == (4096, 25165824, 2.0)
    assert cfg.image.image_mean == cfg.image.image_std == (0.5, 0.5, 0.5) and cfg.image.patch_size == 16
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 1024, "max_pixels": 4096,
                                                                   "patch_size": 16}))
    cfg = load_processor_config(tmp_path)
    assert (cfg.image.min_pixels, cfg.image.max_pixels) == (1024, 4096)
    assert smart_resize(10, 10, 32, 1024, 4096) == (32, 32)
