"""Pixels to flat patches, exactly as transformers' Qwen3.5 processors do (reference §11.3).

Images follow ``Qwen2VLImageProcessor`` (torchvision backend) and videos ``Qwen3VLVideoProcessor``:
``smart_resize`` to multiples of ``patch * merge`` (32 px) inside the pixel bounds, bicubic
antialiased resize of the uint8 pixels, one fused rescale+normalize in fp32, then patches cut in
2x2 merge-block order with ``temporal_patch_size`` frames per patch (a still image is repeated to
fill the pair; a video with an odd frame count repeats its last frame). The same torchvision ops
are called in the same order, so on CPU the output is bit-identical; ``device="cuda"`` runs them on
the GPU (the resize may then differ from CPU by one uint8 step on rare pixels).

Settings come from the checkpoint's ``preprocessor_config.json`` and
``video_preprocessor_config.json``; absent files fall back to the values Qwen ships.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ninfer.vision.media import MediaError

# Values of the Qwen3-VL / Qwen3.5 preprocessor files (reference §11.3).
_QWEN_IMAGE = {"min_pixels": 65536, "max_pixels": 16777216}
_QWEN_VIDEO = {"min_pixels": 4096, "max_pixels": 25165824}
_RESAMPLE = {0: "NEAREST_EXACT", 2: "BILINEAR", 3: "BICUBIC"}  # PIL enum -> torchvision mode
MAX_ASPECT = 200  # the processors refuse more elongated inputs


@dataclass(frozen=True)
class PixelConfig:
    """One processor's settings (image or video); video-only fields are ignored for images."""

    min_pixels: int
    max_pixels: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = 3
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    num_frames: int | None = None
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class ProcessorConfig:
    image: PixelConfig = field(default_factory=lambda: PixelConfig(**_QWEN_IMAGE))
    video: PixelConfig = field(default_factory=lambda: PixelConfig(**_QWEN_VIDEO))


_FIELDS = ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "do_rescale", "do_normalize",
           "resample", "fps", "min_frames", "max_frames", "num_frames", "cap_pixels_per_frame", "max_video_tokens")


def _pixel_config(raw: dict[str, Any], base: PixelConfig) -> PixelConfig:
    size = raw.get("size") or {}
    values: dict[str, Any] = {k: raw[k] for k in _FIELDS if raw.get(k) is not None}
    # The ``size`` dict is the current form; top-level min/max_pixels override it (transformers' rule).
    values["min_pixels"] = raw.get("min_pixels") or size.get("shortest_edge") or base.min_pixels
    values["max_pixels"] = raw.get("max_pixels") or size.get("longest_edge") or base.max_pixels
    for key in ("image_mean", "image_std"):
        if raw.get(key) is not None:
            v = raw[key]
            values[key] = tuple(float(x) for x in (v if isinstance(v, (list, tuple)) else [v] * 3))
    if int(values.get("resample", base.resample)) not in _RESAMPLE:
        raise ValueError(f"preprocessor resample={values['resample']} is not supported (use 0, 2 or 3)")
    return replace(base, **values)


def load_processor_config(model_dir: str | Path) -> ProcessorConfig:
    """Read the checkpoint's image and video preprocessor files (either may be absent)."""
    model_dir, default = Path(model_dir), ProcessorConfig()

    def read(name: str) -> dict[str, Any]:
        path = model_dir / name
        return json.loads(path.read_text()) if path.is_file() else {}

    image_raw = read("preprocessor_config.json")
    image = _pixel_config(image_raw, default.image)
    # A checkpoint without a video file inherits the image geometry but keeps the video pixel bounds.
    shared = {k: getattr(image, k) for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean",
                                             "image_std", "rescale_factor")}
    video = _pixel_config(read("video_preprocessor_config.json"), replace(default.video, **shared))
    return ProcessorConfig(image=image, video=video)


def _check_aspect(height: int, width: int) -> None:
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise MediaError(f"the media is {width}x{height}: aspect ratio above {MAX_ASPECT} is not supported")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Image target size: multiples of ``factor``, area within bounds, aspect ratio kept (Qwen2-VL rule)."""
    _check_aspect(height, width)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_video(num_frames: int, height: int, width: int, temporal: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Video target size: like :func:`smart_resize` but the bounds cover all frames together (Qwen3-VL rule)."""
    if num_frames < temporal:
        raise MediaError(f"the video has {num_frames} usable frame(s); at least {temporal} are needed")
    if height < factor or width < factor:  # tiny frames are first scaled up so the short side is one block
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def sample_frame_indices(total: int, video_fps: float, cfg: PixelConfig) -> np.ndarray:
    """Frames to keep: ``cfg.fps`` per second within ``[min_frames, max_frames]``, spread evenly."""
    num = cfg.num_frames
    if num is None:
        num = int(total / video_fps * cfg.fps)
        num = min(max(num, cfg.min_frames), cfg.max_frames, total)
    return np.linspace(0, total - 1, num).round().astype(int)


def frame_timestamps(indices: list[int], fps: float, temporal: int) -> list[float]:
    """One timestamp (seconds) per temporal patch: the mean of its first and last frame's time."""
    indices = list(indices)
    if len(indices) % temporal:
        indices.extend([indices[-1]] * (temporal - len(indices) % temporal))
    times = [i / fps for i in indices]
    return [(times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal)]


def require_torchvision() -> None:
    """Preprocessing calls torchvision's ops (the ones transformers uses): fail early and clearly without it."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        raise RuntimeError("vision preprocessing needs torchvision (pip install torchvision matching torch)") from None


def _resize_normalize(pixels: torch.Tensor, height: int, width: int, cfg: PixelConfig) -> torch.Tensor:
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as tvF

    mode = getattr(InterpolationMode, _RESAMPLE[cfg.resample])
    pixels = tvF.resize(pixels, [height, width], interpolation=mode, antialias=True)
    if cfg.do_normalize:
        mean = torch.tensor(cfg.image_mean, device=pixels.device)
        std = torch.tensor(cfg.image_std, device=pixels.device)
        if cfg.do_rescale:  # fold 1/255 into mean and std: one pass over the pixels, as transformers does
            mean, std = mean * (1.0 / cfg.rescale_factor), std * (1.0 / cfg.rescale_factor)
        return tvF.normalize(pixels.to(torch.float32), mean, std, inplace=pixels.dtype != torch.float32)
    return pixels.to(torch.float32) * cfg.rescale_factor if cfg.do_rescale else pixels.to(torch.float32)


def preprocess_image(rgb: torch.Tensor, cfg: PixelConfig, device: torch.device | str = "cpu"
                     ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``[3, H, W]`` uint8 -> patches ``[gh * gw, 3 * T * P * P]`` (fp32) and grid ``(1, gh, gw)``."""
    height, width = smart_resize(rgb.shape[-2], rgb.shape[-1], cfg.factor, cfg.min_pixels, cfg.max_pixels)
    x = _resize_normalize(rgb[None].to(device), height, width, cfg)
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = height // p, width // p
    x = x.reshape(1, 3, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
    # [1, gh/m, gw/m, m, m, C, P, P]: insert the temporal axis and repeat the still frame into it.
    x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1).reshape(gh * gw, 3 * t * p * p)
    return x, (1, gh, gw)


def preprocess_video(frames: torch.Tensor, cfg: PixelConfig, device: torch.device | str = "cpu"
                     ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``[T, 3, H, W]`` uint8 sampled frames -> patches ``[gt * gh * gw, 3 * T * P * P]`` and ``(gt, gh, gw)``."""
    n, _, height, width = frames.shape
    max_pixels = cfg.max_pixels
    if cfg.cap_pixels_per_frame:  # qwen-vl-utils' per-frame budget, opt-in in transformers
        per_frame = max(min(cfg.max_video_tokens * cfg.factor ** 2, cfg.max_pixels // n), int(cfg.min_pixels * 1.05))
        max_pixels = per_frame * n
    th, tw = smart_resize_video(n, height, width, cfg.temporal_patch_size, cfg.factor, cfg.min_pixels, max_pixels)
    x = _resize_normalize(frames[None].to(device), th, tw, cfg)  # [1, T, C, H, W]
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if pad := -n % t:
        x = torch.cat((x, x[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
    gt, gh, gw = (n + pad) // t, th // p, tw // p
    x = x.view(1, gt, t, 3, gh // m, m, p, gw // m, m, p).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return x.reshape(gt * gh * gw, 3 * t * p * p), (gt, gh, gw)
