"""SamplingParams bounds every field to what the engine stores, so bad values fail here, not in a step."""
from __future__ import annotations

import math

import pytest

import ninfer
from ninfer.runtime.sampling import (GREEDY_TEMPERATURE, INT32_MAX, INT64_MAX, INT64_MIN, MAX_STOP_CHARS,
                                     MAX_STOP_TOTAL_CHARS, SamplingParams, check_stop_strings)

BAD = [
    ("top_k", 2**31), ("top_k", 2**40), ("top_k", -1), ("top_k", 1.5), ("top_k", True),
    ("seed", 2**63), ("seed", 2**64 - 1), ("seed", -(2**63) - 1), ("seed", "7"),
    ("repetition_penalty", 1e39), ("repetition_penalty", 0.0), ("repetition_penalty", 1e-40),
    ("repetition_penalty", math.inf),
    ("temperature", -0.1), ("temperature", 1e39), ("temperature", math.nan), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("min_p", -1e-9), ("min_p", 1.01),
    ("presence_penalty", 2.5), ("frequency_penalty", -math.inf), ("logprobs", 21), ("logprobs", -1),
    ("logprobs", 2.0), ("greedy", 1),
]


@pytest.mark.parametrize(("name", "value"), BAD)
def test_out_of_range_values_name_the_field(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        SamplingParams(**{name: value})


def test_the_engine_limits_themselves_are_accepted() -> None:
    SamplingParams(top_k=INT32_MAX, seed=INT64_MAX, repetition_penalty=1e9, temperature=100.0, logprobs=20)
    SamplingParams(seed=INT64_MIN, repetition_penalty=1e-9, top_p=1e-30, min_p=1.0, presence_penalty=-2.0)


def test_a_tiny_positive_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 2).is_greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).is_greedy
    assert SamplingParams(temperature=0).is_greedy


def test_stop_strings_are_bounded_in_count_and_length() -> None:
    check_stop_strings(["a" * MAX_STOP_CHARS], max_count=1)
    with pytest.raises(ValueError, match="at most 1 are allowed"):
        check_stop_strings(["a", "b"], max_count=1)
    with pytest.raises(ValueError, match=r"stop\[0\] has 1025 characters"):
        check_stop_strings(["a" * (MAX_STOP_CHARS + 1)])
    with pytest.raises(ValueError, match="in all"):
        check_stop_strings(["a" * MAX_STOP_CHARS] * (MAX_STOP_TOTAL_CHARS // MAX_STOP_CHARS + 1))
    with pytest.raises(ValueError, match=r"stop\[1\] is empty"):
        check_stop_strings(["x", ""])
    with pytest.raises(ValueError, match=r"stop\[0\] must be a string"):
        check_stop_strings([3])  # type: ignore[list-item]


@pytest.fixture(scope="module")
def tiny() -> ninfer.LLM:
    return ninfer.load(device="cpu", max_concurrency=1, progress=False)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"top_k": 2**40}, "top_k"), ({"seed": 2**63}, "seed"), ({"temperature": 1e39}, "temperature"),
    ({"stop": ["ok", ""]}, r"stop\[1\]"), ({"max_new_tokens": "8"}, "max_new_tokens"),
])
def test_the_library_api_raises_before_the_engine(tiny: ninfer.LLM, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}"):
        tiny.generate("Hello", **{"max_new_tokens": 2, **kwargs})
    assert tiny.engine.is_idle()
    assert tiny.generate("Hello", max_new_tokens=2, top_k=INT32_MAX, seed=INT64_MAX).finish_reason  # still serves


def test_chat_sampling_extras_are_checked_too(tiny: ninfer.LLM) -> None:
    with pytest.raises(ValueError, match="^repetition_penalty"):
        tiny.chat([{"role": "user", "content": "Hi"}], max_new_tokens=2, repetition_penalty=1e39)
