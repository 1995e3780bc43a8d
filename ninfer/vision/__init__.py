"""Images and videos for Qwen3.5: media loading, preprocessing, prompt construction, multimodal prefill.

Layering: this package sits beside ``ninfer.runtime`` (it uses ``ninfer.models``, including the
tower in :mod:`ninfer.models.vision`); ``ninfer.llm`` and the servers call it. See docs/vision.md.
"""
from ninfer.vision.loader import (
    build_vision_tower,
    iter_vision_tensors,
    load_vision_tensors,
    load_vision_tower,
)
from ninfer.vision.media import (
    MediaError,
    MediaLimitError,
    MediaRef,
    VisionDisabledError,
    VisionLimits,
    error_code,
)
from ninfer.vision.pipeline import ByteLRU, VisionPipeline, reject_media
from ninfer.vision.prefill import (
    MultimodalInputs,
    MultimodalRunner,
    chunk_embeds,
    encode_media,
)
from ninfer.vision.processor import (
    ProcessorConfig,
    load_processor_config,
    preprocess_image,
    preprocess_video,
)
from ninfer.vision.prompt import (
    MultimodalPrompt,
    PreparedMedia,
    VisionTokens,
    build_prompt,
    canonical_part,
    collect_media,
    has_media,
    rebase_local_paths,
    rope_index,
)

__all__ = [
    "ByteLRU", "MediaError", "MediaLimitError", "MediaRef", "MultimodalInputs", "MultimodalPrompt", "MultimodalRunner",
    "PreparedMedia", "ProcessorConfig", "VisionDisabledError", "VisionLimits", "VisionPipeline", "VisionTokens",
    "build_prompt", "build_vision_tower", "canonical_part", "chunk_embeds", "collect_media", "encode_media", "error_code",
    "has_media", "iter_vision_tensors", "load_processor_config", "load_vision_tensors", "load_vision_tower",
    "preprocess_image", "preprocess_video", "rebase_local_paths", "reject_media", "rope_index",
]
