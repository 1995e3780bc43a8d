"""Sampling parameters of a request, and the model-aware presets; the sampling op is ninfer.kernels.sampling.

Every field is bounded to what the engine stores (fp32 floats, an int32 ``top_k``, an int64 seed)
and to a sane range, so a bad value is a ValueError naming the field here, never an error inside
the engine step.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ninfer.kernels.sampling import MAX_LOGPROBS

INT32_MAX = (1 << 31) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_TEMPERATURE = 100.0
# Below this a positive temperature is greedy: the limit t -> 0 of sampling, and 1/t stays finite in fp32.
GREEDY_TEMPERATURE = 1e-5
# 1e9 already forbids every seen token; the bounds keep the penalised fp32 logits finite.
REPETITION_PENALTY_RANGE = (1e-9, 1e9)
# Stop strings: the matcher keeps the longest one's length of text per step, so each and all are bounded.
MAX_STOP_CHARS = 1024
MAX_STOP_TOTAL_CHARS = 8192


def _number(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value}")


def _integer(name: str, value: Any, lo: int, hi: int, what: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}]{what}, got {value}")


def check_stop_strings(stop: Sequence[str], max_count: int | None = None, name: str = "stop") -> None:
    """Stop strings: non-empty strings, each at most MAX_STOP_CHARS and all together MAX_STOP_TOTAL_CHARS."""
    if max_count is not None and len(stop) > max_count:
        raise ValueError(f"{name} has {len(stop)} entries; at most {max_count} are allowed")
    total = 0
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise ValueError(f"{name}[{i}] must be a string, got {type(s).__name__}")
        if not s:
            raise ValueError(f"{name}[{i}] is empty: a stop string needs at least one character")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"{name}[{i}] has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed")
        total += len(s)
    if total > MAX_STOP_TOTAL_CHARS:
        raise ValueError(f"{name} has {total} characters in all; at most {MAX_STOP_TOTAL_CHARS} are allowed")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``greedy`` (or a temperature below 1e-5) takes the argmax."""

    temperature: float = 1.0  # [0, 100]
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # [0, 2^31 - 1], 0 = off
    greedy: bool = False
    seed: int | None = None  # int64
    min_p: float = 0.0  # [0, 1]
    presence_penalty: float = 0.0  # [-2, 2], OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # [1e-9, 1e9], HF semantics, over prompt and generated tokens
    logprobs: int | None = None  # report the sampled token's logprob and this many top alternatives (0..20)
    structured: Any = None  # a ninfer.runtime.structured.Constraint the answer must match
    # Tokens generated before a stop may end the request: stop ids get -inf logits and stop strings do not
    # match until then (vLLM semantics); [0, 2^31 - 1].
    min_tokens: int = 0
    # Chat replies with thinking on: once this many reasoning tokens are out and the model has not closed
    # its reasoning, the next token is ``</think>`` (the answer follows); None = no limit; [0, 2^31 - 1].
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        _number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _integer("top_k", self.top_k, 0, INT32_MAX, " (0 = off)")
        if not isinstance(self.greedy, bool):
            raise ValueError(f"greedy must be a boolean, got {type(self.greedy).__name__}")
        if self.seed is not None:
            _integer("seed", self.seed, INT64_MIN, INT64_MAX, " (a 64-bit signed integer)")
        _number("min_p", self.min_p, 0.0, 1.0)
        for name in ("presence_penalty", "frequency_penalty"):
            _number(name, getattr(self, name), -2.0, 2.0)
        _number("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _integer("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.thinking_budget is not None:
            _integer("thinking_budget", self.thinking_budget, 0, INT32_MAX)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature < GREEDY_TEMPERATURE


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
