"""Chat messages with images and videos in, a ready multimodal prompt out.

:class:`VisionPipeline` owns the vision tower, the preprocessor settings, the request limits and
two bounded caches keyed by content hash: prepared pixels (CPU) and merged embeddings (device),
so the same image sent twice is decoded, resized and encoded once. Servers run media work on its
:class:`~ninfer.vision.jobs.MediaJobs` pool (``jobs``), cancellable per request.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from ninfer.config import ModelConfig
from ninfer.models.vision import VisionTransformer
from ninfer.vision.jobs import MediaJobs
from ninfer.vision.loader import load_vision_tower
from ninfer.vision.media import (
    MediaError,
    MediaLimitError,
    MediaRef,
    VisionDisabledError,
    VisionLimits,
    decode_image,
    decode_video,
    read_source,
)
from ninfer.vision.prefill import encode_media
from ninfer.vision.processor import (
    ProcessorConfig,
    frame_timestamps,
    load_processor_config,
    preprocess_image,
    preprocess_video,
    require_torchvision,
    sample_frame_indices,
)
from ninfer.vision.prompt import (
    MultimodalPrompt,
    PreparedMedia,
    VideoLayout,
    VisionTokens,
    build_prompt,
    collect_media,
)

V = TypeVar("V")


class ByteLRU(Generic[V]):
    """A thread-safe LRU map bounded by the total bytes of its values (not by count)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self._items: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> V | None:
        with self._lock:
            if key not in self._items:
                return None
            self._items.move_to_end(key)
            return self._items[key][0]

    def put(self, key: str, value: V, nbytes: int) -> None:
        if nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                self.bytes -= self._items.pop(key)[1]
            self._items[key] = (value, nbytes)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                self.bytes -= self._items.popitem(last=False)[1][1]

    def __len__(self) -> int:
        return len(self._items)


def _content_key(kind: str, source: Any, limits: VisionLimits) -> tuple[str, Any]:
    """(hash, payload to decode): bytes are read once and hashed; a PIL image hashes its pixels."""
    if hasattr(source, "tobytes") and hasattr(source, "mode"):  # PIL.Image
        digest = hashlib.sha256(f"{source.mode}{source.size}".encode() + source.tobytes()).hexdigest()
        return f"{kind}:{digest}", source
    data = read_source(source, kind, limits)  # type: ignore[arg-type]
    return f"{kind}:{hashlib.sha256(data).hexdigest()}", data


class VisionPipeline:
    def __init__(self, tower: VisionTransformer | None, tokens: VisionTokens, processor: ProcessorConfig,
                 limits: VisionLimits | None = None, *, preprocess_device: torch.device | str = "cpu",
                 cache_bytes: int = 512 << 20, video_layout: VideoLayout = "qwen") -> None:
        self.tower, self.tokens, self.processor = tower, tokens, processor
        self.limits = limits or VisionLimits()
        self.preprocess_device = preprocess_device
        self.video_layout = video_layout
        self.merge = processor.image.merge_size
        self.prepared: ByteLRU[PreparedMedia] = ByteLRU(cache_bytes)
        self.embeddings: ByteLRU[torch.Tensor] = ByteLRU(cache_bytes)
        self.jobs = MediaJobs(self.limits.media_workers)

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, config: ModelConfig, token_id: Callable[[str], int | None],
                        device: torch.device | str, dtype: torch.dtype, limits: VisionLimits | None = None,
                        **kwargs: Any) -> VisionPipeline:
        """Load ``model.visual.*`` and the preprocessor files of a composite checkpoint."""
        require_torchvision()
        tower = load_vision_tower(model_dir, config, device, dtype)
        tokens = VisionTokens.from_ids(config.multimodal_token_ids, token_id)
        processor = load_processor_config(model_dir)
        if processor.image.patch_size != tower.config.patch_size or processor.image.merge_size != tower.merge:
            raise ValueError("preprocessor_config.json disagrees with vision_config on patch_size / merge_size")
        return cls(tower, tokens, processor, limits, **kwargs)

    # -- media -----------------------------------------------------------------------------
    def prepare_media(self, ref: MediaRef) -> PreparedMedia:
        """Fetch, decode and preprocess one image or video (cached by content hash)."""
        key, payload = _content_key(ref.kind, ref.source, self.limits)
        if (hit := self.prepared.get(key)) is not None:
            return hit
        if ref.kind == "image":
            pixels, grid = preprocess_image(decode_image(payload, self.limits), self.processor.image,
                                            self.preprocess_device)
            item = PreparedMedia("image", pixels.cpu(), grid, key)
        else:
            cfg = self.processor.video
            clip = decode_video(payload, lambda total, fps: sample_frame_indices(total, fps, cfg), self.limits)
            pixels, grid = preprocess_video(clip.frames, cfg, self.preprocess_device)
            stamps = frame_timestamps(clip.indices, clip.fps, cfg.temporal_patch_size)
            item = PreparedMedia("video", pixels.cpu(), grid, key, tuple(stamps))
        self.prepared.put(key, item, item.pixels.numel() * item.pixels.element_size())
        return item

    def prepare_all(self, refs: Sequence[MediaRef]) -> list[PreparedMedia]:
        if len(refs) > self.limits.max_media_items:
            raise MediaLimitError("max_media_items", f"the request has {len(refs)} images/videos, more than "
                                                     f"{self.limits.max_media_items}")
        media, tokens = [], 0
        for ref in refs:
            media.append(self.prepare_media(ref))
            tokens += media[-1].num_tokens(self.merge)
            if tokens > self.limits.max_media_tokens:  # stop before preprocessing the rest
                raise MediaLimitError("max_media_tokens", f"the request's images/videos need more than "
                                                          f"{self.limits.max_media_tokens} vision tokens")
        return media

    # -- prompts ---------------------------------------------------------------------------
    def prompt_from_ids(self, ids: Sequence[int], refs: Sequence[MediaRef],
                        encode: Callable[[str], list[int]]) -> MultimodalPrompt:
        """A rendered, tokenized prompt whose pads match ``refs`` in order."""
        return build_prompt(ids, self.prepare_all(refs), self.tokens, self.merge, encode, self.video_layout)

    def prompt_from_messages(self, messages: Sequence[dict[str, Any]], tokenizer: Any, **template_kwargs: Any
                             ) -> MultimodalPrompt:
        """Render with the chat template (``tokenizer``: :class:`ninfer.tokenizer.Tokenizer`), then expand."""
        text = tokenizer.apply_chat_template(list(messages), **template_kwargs)
        return self.prompt_from_ids(tokenizer.encode(text), collect_media(messages), tokenizer.encode)

    def count_tokens(self, messages: Sequence[dict[str, Any]], tokenizer: Any, **template_kwargs: Any) -> int:
        """Prompt length including media tokens (decodes the media, does not run the tower)."""
        return len(self.prompt_from_messages(messages, tokenizer, **template_kwargs).input_ids)

    # -- encoder ---------------------------------------------------------------------------
    def encode(self, prompt: MultimodalPrompt) -> torch.Tensor:
        """``[num_media_tokens, H]`` merged embeddings in prompt order (cached per item)."""
        if self.tower is None:
            raise VisionDisabledError("vision is disabled: this model was loaded without its vision tower")
        found = [self.embeddings.get(m.key) for m in prompt.media]
        todo = [m for m, e in zip(prompt.media, found) if e is None]
        fresh = iter(encode_media(self.tower, todo))
        parts = []
        for item, hit in zip(prompt.media, found):
            if hit is None:
                hit = next(fresh)
                self.embeddings.put(item.key, hit, hit.numel() * hit.element_size())
            parts.append(hit)
        if not parts:
            return torch.empty(0, self.tower.config.out_hidden_size, device=self.tower.device, dtype=self.tower.dtype)
        return torch.cat(parts)


def reject_media(messages: Sequence[dict[str, Any]]) -> None:
    """Raise :class:`VisionDisabledError` if messages carry media (for models loaded without vision)."""
    refs = collect_media(messages)
    if refs:
        raise VisionDisabledError(f"the request has {len(refs)} image/video part(s) but vision is disabled; "
                                  "load the model with vision=True (CLI/server: --vision)")


__all__ = ["ByteLRU", "MediaError", "VisionPipeline", "reject_media"]
