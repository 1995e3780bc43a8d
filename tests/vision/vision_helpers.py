"""Media and config helpers shared by the vision tests (imported by conftest and the test modules).

The preprocessor files carry what Qwen ships (mean = std = 0.5, patch 16, temporal 2, merge 2,
fps 2, min 4 frames) but smaller pixel bounds, so that both the upscale and the downscale branch
of ``smart_resize`` run on small, fast inputs.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

IMAGE_CONFIG = {
    "size": {"shortest_edge": 4096, "longest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}
VIDEO_CONFIG = {
    "size": {"shortest_edge": 4096, "longest_edge": 98304}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fps": 2,
    "min_frames": 4, "max_frames": 16, "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}


def write_preprocessor_files(path: Path) -> None:
    (path / "preprocessor_config.json").write_text(json.dumps(IMAGE_CONFIG))
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))


def make_image(height: int, width: int, seed: int, mode: str = "RGB"):
    """A smooth gradient plus noise: resampling has real work to do, and no two images are alike."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L")
        image.putalpha(alpha)
    return image


def write_video(path: Path, frames: int = 13, fps: int = 6, size: tuple[int, int] = (72, 56), seed: int = 0) -> Path:
    """An mpeg4 MP4 written with PyAV: moving gradients, odd frame count, non-square frames."""
    import av

    rng = np.random.default_rng(seed)
    width, height = size
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            y, x = np.mgrid[0:height, 0:width]
            rgb = np.stack([(x * 4 + i * 20) % 256, (y * 4 + i * 9) % 256, (x + y + i * 30) % 256], axis=-1)
            rgb = np.clip(rgb + rng.normal(0, 10, rgb.shape), 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
