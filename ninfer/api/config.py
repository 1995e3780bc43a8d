"""Server settings that are not engine settings (the engine's are fixed by ``ninfer.load``)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingOverrides:
    """Process-level sampling flags: override the model preset, are overridden by request fields."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    greedy: bool = False  # forces temperature 0 unless the request sets a temperature


@dataclass(frozen=True)
class ServerConfig:
    model_id: str | None = None  # public model alias; default: the checkpoint directory name
    api_key: str | None = None  # checked on "Authorization: Bearer" and "x-api-key"
    max_pending: int = 16  # waiting requests beyond the lanes; more is 429 (Anthropic 529)
    pending_timeout_ms: int = 30_000  # deadline for admission; past it 503 (Anthropic 504)
    max_request_bytes: int = 64 << 20  # body limit (a data-URI image of ~45 MiB still fits); more is 413
    default_max_tokens: int = 8192  # output limit when the request gives none
    thinking: bool = True  # default thinking mode of chat requests
    preserve_thinking: bool = False  # default: keep the reasoning of closed assistant turns in prompts
    cors: bool = False  # permissive CORS
    keepalive_s: float = 5.0  # SSE ": keep-alive" comment interval
    response_store_max_records: int = 1024
    response_store_max_bytes: int = 256 << 20
    max_stop: int = 4  # stop strings per OpenAI request
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)
