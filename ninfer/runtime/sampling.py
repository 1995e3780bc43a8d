"""Sampling parameters of a request, and the model-aware presets; the sampling op is ninfer.kernels.sampling."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``greedy`` (or ``temperature == 0``) takes the argmax."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt and generated tokens
    logprobs: int | None = None  # report the sampled token's logprob and this many top alternatives (0..20)
    structured: Any = None  # a ninfer.runtime.structured.Constraint the answer must match

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


_THINKING = {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "presence_penalty": 0.0}
_NON_THINKING = {"temperature": 0.7, "top_p": 0.80, "top_k": 20, "min_p": 0.0, "presence_penalty": 1.5}
# Model-aware defaults by thinking mode (the Qwen model cards' recommendations), keyed by a name fragment.
PRESETS: dict[str, dict[bool, dict[str, float]]] = {
    "qwen3.6-27b": {True: _THINKING, False: _NON_THINKING},
    "qwen3.8-27b": {True: _THINKING, False: _NON_THINKING},
    "qwen3.6-35b-a3b": {True: {**_THINKING, "presence_penalty": 1.5}, False: _NON_THINKING},
}


def preset_key(*names: str | None) -> str | None:
    """The preset matching any of the given model names (alias, path, Hub id), longest key first."""
    for key in sorted(PRESETS, key=len, reverse=True):
        if any(name and key in name.lower() for name in names):
            return key
    return None
