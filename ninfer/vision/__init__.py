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
from ninfer.vision.fetch_policy import address_refusal, host_allowed
from ninfer.vision.jobs import MediaJobs
from ninfer.vision.media import (
    FetchCancelled,
    MediaError,
    MediaFetchError,
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
    "ByteLRU", "FetchCancelled", "MediaError", "MediaFetchError", "MediaJobs", "MediaLimitError", "MediaRef",
    "MultimodalInputs", "MultimodalPrompt", "MultimodalRunner", "PreparedMedia", "ProcessorConfig",
    "VisionDisabledError", "VisionLimits", "VisionPipeline", "VisionTokens", "address_refusal", "build_prompt",
    "build_vision_tower", "canonical_part", "chunk_embeds", "collect_media", "encode_media", "error_code",
    "has_media", "host_allowed", "iter_vision_tensors", "load_processor_config", "load_vision_tensors",
    "load_vision_tower", "preprocess_image", "preprocess_video", "rebase_local_paths", "reject_media", "rope_index",
]
