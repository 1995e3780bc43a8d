"""Forced tool calls: whatever the random tiny model writes, a finished answer is one call in the
Qwen3-Coder XML format that the tool-call parser turns into arguments satisfying the schema."""
from __future__ import annotations

import pytest

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ninfer  # noqa: E402
from ninfer.api.tool_parser import parse_text  # noqa: E402
from ninfer.runtime.sampling import SamplingParams  # noqa: E402
from ninfer.runtime.structured import Constraint, StructuredError  # noqa: E402

MAX_NEW = 110
FINISHED: list[str] = []  # finished answers of the property test, checked by the test after it


@pytest.fixture(scope="module")
def llm(dense_ckpt) -> ninfer.LLM:
    return ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=4, progress=False)


_VALUES = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-9, 9), st.integers(0, 30)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 3)),
    st.builds(lambda vals: {"enum": vals}, st.lists(st.sampled_from(["a", "bc", "d e"]), min_size=1, max_size=3,
                                                    unique=True)),
    st.just({"type": "array", "items": {"type": "boolean"}, "maxItems": 2}),
)
PARAMS = st.dictionaries(st.sampled_from(["x", "y", "z_1"]), _VALUES, min_size=1, max_size=2).flatmap(
    lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
        lambda req: {"type": "object", "properties": props,
                     "required": [n for n, keep in zip(props, req) if keep]}))


def _tools(p1: dict, p2: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "first", "parameters": p1}},
            {"type": "function", "function": {"name": "second_fn", "parameters": p2}}]


def _calls(llm, tools: list[dict], constraints: list[Constraint]) -> list[tuple[str, str]]:
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "call"}], tools=tools, enable_thinking=False))
    reqs = [llm._request(prompt, MAX_NEW, SamplingParams(temperature=1.0, seed=seed, structured=c), thinking=False)
            for seed, c in enumerate(constraints)]
    return [(out.text, out.finish_reason) for out in llm._run(reqs)]


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(p1=PARAMS, p2=PARAMS)
def test_forced_calls_parse_into_valid_arguments(llm, p1: dict, p2: dict) -> None:
    tools = _tools(p1, p2)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    named = Constraint.tool_call(tools, "second_fn")
    required = Constraint.tool_call(tools, parallel=False)
    for (text, reason), c in zip(_calls(llm, tools, [named, required, named, required]),
                                 [named, required, named, required]):
        if reason != "stop":
            assert reason == "length"
            continue
        pieces = parse_text(text, schemas).pieces
        assert [kind for kind, _ in pieces] == ["tool_call"], text
        call = pieces[0][1]
        if c is named:
            assert call.name == "second_fn"
        jsonschema.validate(call.arguments, schemas[call.name])
        FINISHED.append(text)


def test_the_property_test_saw_finished_calls() -> None:
    """The bounded schemas leave the random model room to finish most calls within MAX_NEW tokens."""
    assert len(FINISHED) >= 4, FINISHED


def test_a_named_function_must_be_declared() -> None:
    with pytest.raises(StructuredError) as err:
        Constraint.tool_call(_tools({"type": "object"}, {"type": "object"}), "third", param="tool_choice.name")
    assert err.value.param == "tool_choice.name"


def test_tool_schemas_follow_the_keyword_rules() -> None:
    with pytest.raises(StructuredError) as err:
        Constraint.tool_call(_tools({"type": "object", "properties": {"a": {"type": "string", "not": {}}}},
                                    {"type": "object"}))
    assert "'tools[0].function.parameters.properties.a.not'" in str(err.value)
