"""Pure pieces of the API layer: sampling precedence, the response store, error shapes, field parsing."""
from __future__ import annotations

import pytest

from ninfer.api.config import SamplingOverrides
from ninfer.api.errors import APIError
from ninfer.api.response_store import ResponseStore
from ninfer.api.sampling import resolve
from ninfer.runtime.sampling import preset_key
from ninfer.api.validation import Fields
from ninfer.runtime.sampling import SamplingParams

BASE = SamplingParams(temperature=0.6, top_p=0.95, top_k=20)  # what generation_config.json gives


def test_presets_are_chosen_by_model_name_and_thinking_mode() -> None:
    assert preset_key("Qwen/Qwen3.6-35B-A3B") == "qwen3.6-35b-a3b"
    assert preset_key(None, "/models/qwen3.6-27b-int4") == "qwen3.6-27b"
    assert preset_key("tiny", "/tmp/x") is None
    thinking = resolve(BASE, "qwen3.6-27b", True, SamplingOverrides(), {})
    plain = resolve(BASE, "qwen3.6-27b", False, SamplingOverrides(), {})
    assert (thinking.temperature, thinking.top_p, thinking.top_k) == (1.0, 0.95, 20)
    assert (plain.temperature, plain.top_p, plain.presence_penalty) == (0.7, 0.80, 1.5)
    assert resolve(BASE, "qwen3.6-35b-a3b", True, SamplingOverrides(), {}).presence_penalty == 1.5


def test_request_beats_flag_beats_preset_beats_generation_config() -> None:
    assert resolve(BASE, None, True, SamplingOverrides(), {}).temperature == 0.6
    flags = SamplingOverrides(temperature=0.2, top_k=5, seed=3)
    p = resolve(BASE, "qwen3.6-27b", True, flags, {})
    assert (p.temperature, p.top_k, p.seed, p.top_p) == (0.2, 5, 3, 0.95)
    p = resolve(BASE, "qwen3.6-27b", True, flags, {"temperature": 0.9, "seed": 11})
    assert (p.temperature, p.seed) == (0.9, 11)
    greedy = resolve(BASE, None, True, SamplingOverrides(greedy=True), {})
    assert greedy.is_greedy
    assert resolve(BASE, None, True, SamplingOverrides(greedy=True), {"temperature": 0.5}).temperature == 0.5
    assert resolve(BASE, None, True, SamplingOverrides(), {"top_k": -1}).top_k == 0


def test_engine_rejections_name_the_field() -> None:
    with pytest.raises(APIError) as err:
        resolve(BASE, None, True, SamplingOverrides(), {"min_p": 2.0})
    assert err.value.status == 400 and "min_p" in err.value.message


def test_response_store_is_bounded_lru() -> None:
    store = ResponseStore(max_records=2, max_bytes=10_000)
    for i in range(3):
        assert store.put({"id": f"r{i}", "output": []}, [])
    assert store.get("r0") is None and len(store) == 2
    store.get("r1")  # touch: r2 is now the least recently used
    store.put({"id": "r3", "output": []}, [])
    assert store.get("r2") is None and store.get("r1") is not None
    assert not store.put({"id": "huge", "output": ["x" * 20_000]}, [])
    small = ResponseStore(max_records=100, max_bytes=200)
    for i in range(10):
        small.put({"id": f"s{i}", "output": ["x" * 40]}, [])
    assert 0 < len(small) < 10 and small.get("s9") is not None
    assert store.delete("r1") and not store.delete("r1")


def test_error_shapes_and_anthropic_statuses() -> None:
    err = APIError(429, "busy", code="server_overloaded")
    assert err.body("openai") == {"error": {"message": "busy", "type": "rate_limit_error", "param": None,
                                            "code": "server_overloaded"}}
    assert err.status_for("anthropic") == 529
    assert err.body("anthropic") == {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    timeout = APIError(503, "late", code="request_queue_timeout")
    assert timeout.status_for("anthropic") == 504 and timeout.body("anthropic")["error"]["type"] == "timeout_error"


def test_fields_paths_and_types() -> None:
    f = Fields({"a": {"b": [1, {"c": True}]}, "n": 1.0, "flag": 1, "s": ["x", 2]})
    with pytest.raises(APIError, match=r"'a.b\[0\]' must be an object, got an integer"):
        f.sub("a").items("b")
    with pytest.raises(APIError, match="'n' must be an integer, got a number"):
        f.int("n")
    with pytest.raises(APIError, match="'flag' must be a boolean, got an integer"):
        f.bool("flag")
    with pytest.raises(APIError, match="'s' must be a string or an array of strings"):
        f.str_or_list("s", max_items=4)
    assert f.int("missing") is None
