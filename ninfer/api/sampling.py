"""Per-request sampling: request field > server flag > model preset > generation_config.json.

Presets (feature bar §7) are chosen by model name and the resolved thinking mode; a model with
no preset uses its ``generation_config.json`` defaults through ``llm.sampling_params()``.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from ninfer.api.config import SamplingOverrides
from ninfer.api.errors import APIError, invalid
from ninfer.runtime.sampling import (INT32_MAX, INT64_MAX, INT64_MIN, PRESETS, REPETITION_PENALTY_RANGE,
                                     SamplingParams, check_stop_strings)

FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "seed")
# What a request may set: the above and vLLM's min_tokens (no server flag for it).
REQUEST_FIELDS = (*FIELDS, "min_tokens")
# Values that mean "off": a field the engine lacks may still be sent with these.
_NEUTRAL: dict[str, Any] = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                            "repetition_penalty": 1.0, "logprobs": None}


@dataclass(frozen=True)
class ServerSamplingParams(SamplingParams):
    """The engine's parameters plus ``ignore_eos``, which the engine's output processor reads (through
    ``LLM.stop_ids_for``) to keep generating past the model's end-of-sequence tokens."""

    ignore_eos: bool = False


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample ``index`` of ``n``: the derivation ``ninfer.SamplingParams.sample_seed`` uses, so the
    server's ``n`` samples of a seeded request are the Python API's."""
    if seed is None or index == 0:
        return seed
    return random.Random(f"{seed}:{index}").getrandbits(62)


def supported_fields() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(SamplingParams))


def resolve(base: SamplingParams, preset: str | None, thinking: bool, overrides: SamplingOverrides,
            request: dict[str, Any], logprobs: int | None = None, ignore_eos: bool = False) -> SamplingParams:
    """Merge the layers; ``request`` holds only the fields the client set (paths as keys' names)."""
    values: dict[str, Any] = {"temperature": base.temperature, "top_p": base.top_p, "top_k": base.top_k,
                              "seed": base.seed}
    if base.greedy:
        values["temperature"] = 0.0
    if preset is not None:
        values.update(PRESETS[preset][thinking])
    for name in FIELDS:
        value = getattr(overrides, name)
        if value is not None:
            values[name] = value
    if overrides.greedy:
        values["temperature"] = 0.0
    known = supported_fields()
    for name, value in request.items():
        if value is None:
            continue
        if name not in known and value != _NEUTRAL.get(name):
            raise invalid(f"'{name}' is not supported by this engine", name, code="unsupported_parameter")
        values[name] = value
    if logprobs is not None:
        values["logprobs"] = logprobs
    if values.get("top_k", 0) < 0:
        values["top_k"] = 0  # -1 means "off", as in vLLM
    kwargs = {k: v for k, v in values.items() if k in known}
    try:
        return ServerSamplingParams(**kwargs, ignore_eos=ignore_eos) if ignore_eos else SamplingParams(**kwargs)
    except ValueError as err:  # the message names the field
        raise APIError(400, str(err), code="invalid_request_error", param=str(err).split()[0]) from None


def parse_fields(f: Any, names: tuple[str, ...] = REQUEST_FIELDS, temperature_max: float = 2.0) -> dict[str, Any]:
    """The sampling fields a request sets, range-checked (``f`` is a ``validation.Fields``)."""
    getters = {
        "temperature": lambda: f.float("temperature", lo=0, hi=temperature_max),
        "top_p": lambda: f.float("top_p", lo=0, hi=1, lo_open=True),
        "top_k": lambda: f.int("top_k", lo=-1, hi=INT32_MAX),
        "min_p": lambda: f.float("min_p", lo=0, hi=1),
        "presence_penalty": lambda: f.float("presence_penalty", lo=-2, hi=2),
        "frequency_penalty": lambda: f.float("frequency_penalty", lo=-2, hi=2),
        "repetition_penalty": lambda: f.float("repetition_penalty", lo=REPETITION_PENALTY_RANGE[0],
                                              hi=REPETITION_PENALTY_RANGE[1]),
        "seed": lambda: f.int("seed", lo=INT64_MIN, hi=INT64_MAX),
        "min_tokens": lambda: f.int("min_tokens", lo=0, hi=INT32_MAX),
    }
    values = {name: getters[name]() for name in names}
    return {k: v for k, v in values.items() if v is not None}


def check_min_tokens(sampling: dict[str, Any], max_tokens: int | None, max_name: str = "max_tokens") -> None:
    """vLLM's rule: ``min_tokens`` may not exceed the request's own token budget (a 400 naming it)."""
    least = sampling.get("min_tokens")
    if least and max_tokens is not None and least > max_tokens:
        raise invalid(f"'min_tokens' ({least}) must be at most '{max_name}' ({max_tokens})", "min_tokens")


def stop_strings(f: Any, name: str, max_items: int) -> list[str]:
    """A string or an array of strings (``f`` is a ``validation.Fields``), bounded in count and length."""
    stops = f.str_or_list(name, max_items=max_items)
    try:
        check_stop_strings(stops, name=f.path(name))
    except ValueError as err:
        field, _, rest = str(err).partition(" ")
        raise invalid(f"'{field}' {rest}", field) from None
    return stops


def logit_bias(f: Any, vocab_size: int) -> dict[int, float]:
    """``logit_bias``: token id strings in [0, vocab_size) mapped to numbers in [-100, 100] (OpenAI's range)."""
    bias = f.dict("logit_bias") or {}
    out: dict[int, float] = {}
    for key, value in bias.items():
        path = f"{f.path('logit_bias')}[{key[:40]!r}]" if not key.isdigit() else f"{f.path('logit_bias')}.{key}"
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
            raise invalid(f"'{path}': logit_bias keys must be token ids in [0, {vocab_size})", path)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise invalid(f"'{path}' must be a number in [-100, 100], got {value!r}"[:200], path)
        out[int(key)] = float(value)
    return out
