"""The Qwen3-Coder XML tool-call parser: typing by schema, degradation to text, split invariance."""
from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.api.tool_parser import ToolCall, ToolCallParser, convert_value, parse_text

TOOLS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "tags": {"type": "array"}, "opts": {"type": "object"},
        "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}},
    "noop": {"type": "object", "properties": {}},
}


def call_xml(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def calls(pieces) -> list[ToolCall]:
    return [v for k, v in pieces if k == "tool_call"]


def text(pieces) -> str:
    return "".join(v for k, v in pieces if k == "text")


def test_values_are_typed_by_the_schema() -> None:
    xml = call_xml("get_weather", {"city": "Paris", "days": "3", "metric": "true", "ratio": "0.5",
                                   "tags": '["a", "b"]', "opts": '{"x": 1}', "maybe": "null"})
    result = parse_text("Let me check.\n\n" + xml, TOOLS)
    assert text(result.pieces) == "Let me check."
    [call] = calls(result.pieces)
    assert call.name == "get_weather" and call.index == 0 and call.declared
    assert call.arguments == {"city": "Paris", "days": 3, "metric": True, "ratio": 0.5, "tags": ["a", "b"],
                              "opts": {"x": 1}, "maybe": None}
    assert json.loads(call.arguments_json) == call.arguments


def test_mismatching_values_are_kept_as_strings() -> None:
    assert convert_value("three", {"type": "integer"}) == "three"
    assert convert_value("{not json", {"type": "object"}) == "{not json"
    assert convert_value("nan", {"type": "number"}) == "nan"
    assert convert_value("42", {"type": ["integer", "string"]}) == 42
    assert convert_value("42", {"type": "string"}) == "42"
    assert convert_value("42", None) == "42"


def test_multiline_values_keep_inner_newlines() -> None:
    xml = call_xml("get_weather", {"city": "line one\n\nline two"})
    [call] = calls(parse_text(xml, TOOLS).pieces)
    assert call.arguments == {"city": "line one\n\nline two"}


def test_several_calls_and_whitespace_between_them() -> None:
    xml = call_xml("noop", {}) + "\n" + call_xml("get_weather", {"city": "Oslo"}) + "\n"
    result = parse_text(xml, TOOLS)
    assert [c.name for c in calls(result.pieces)] == ["noop", "get_weather"]
    assert [c.index for c in calls(result.pieces)] == [0, 1]
    assert text(result.pieces) == ""


def test_undeclared_tool_is_still_a_call_with_string_values() -> None:
    result = parse_text(call_xml("other", {"n": "5"}), TOOLS)
    [call] = calls(result.pieces)
    assert call.arguments == {"n": "5"} and not call.declared
    assert "undeclared_tool" in result.diagnostics


MALFORMED = [
    "<tool_call>\nno function here\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\n<parameter=days>\n3\n</parameter>\n</function>\n"
     "</tool_call>"),
    "<tool_call>\n<function=get_weather>\nstray text\n<parameter=city>\nP\n</parameter>\n</function>\n</tool_call>",
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n</parameter>\n"
     "</function>\n</tool_call>"),
    "<tool_call>\n<function=bad name>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis",  # cut off by the end of the stream
]


def test_malformed_calls_degrade_to_the_exact_text() -> None:
    for xml in MALFORMED:
        result = parse_text("Answer: " + xml, TOOLS)
        assert calls(result.pieces) == [], xml
        assert text(result.pieces) == "Answer: " + xml
        assert "malformed_structure" in result.diagnostics


def test_unterminated_block_with_complete_function_is_accepted_at_the_end() -> None:
    xml = call_xml("noop", {})[: -len("</tool_call>")]
    assert [c.name for c in calls(parse_text(xml, TOOLS).pieces)] == ["noop"]


def test_plain_text_with_angle_brackets_passes_through() -> None:
    s = "a < b and <tool_ is not a tag; <tool_call is not either"
    assert parse_text(s, TOOLS).pieces == [("text", s)]


def _stream(s: str, cuts: list[int]) -> list:
    parser = ToolCallParser(TOOLS)
    bounds = sorted({c % (len(s) + 1) for c in cuts} | {0, len(s)})
    pieces = []
    for a, b in itertools.pairwise(bounds):
        pieces += parser.feed(s[a:b])
    pieces += parser.flush()
    merged: list = []
    for kind, value in pieces:
        if kind == "text" and merged and merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + value)
        else:
            merged.append((kind, value))
    return merged


_segments = st.one_of(
    st.text(alphabet="ab <>/=\n_tolcapremfuni", max_size=12),
    st.sampled_from([call_xml("get_weather", {"city": "Rome", "days": "2"}), call_xml("noop", {}), *MALFORMED[:6],
                     "<tool_call>", "</tool_call>", "<function=noop>", "</parameter>", "\n\n"]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_segments, max_size=6), st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_streaming_splits_never_change_the_result(segments: list[str], cuts: list[int]) -> None:
    s = "".join(segments)
    whole = parse_text(s, TOOLS).pieces
    streamed = _stream(s, cuts)
    assert [(k, v if k == "text" else (v.name, v.arguments, v.index)) for k, v in streamed] == \
        [(k, v if k == "text" else (v.name, v.arguments, v.index)) for k, v in whole]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80), st.lists(st.integers(min_value=0, max_value=200), max_size=8))
def test_text_without_calls_is_unchanged(s: str, cuts: list[int]) -> None:
    if "<tool_call>" in s:
        return
    assert text(_stream(s, cuts)) == s


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
                       st.text(max_size=30).filter(lambda v: "</parameter>" not in v and "<parameter=" not in v
                                                   and "</tool_call>" not in v),
                       max_size=4))
def test_rendered_calls_round_trip(params: dict[str, str]) -> None:
    [call] = calls(parse_text(call_xml("noop", params), TOOLS).pieces)
    assert call.arguments == params
