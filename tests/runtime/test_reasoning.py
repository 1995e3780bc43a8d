"""ReasoningSplitter / split_final: reasoning vs content, whatever the delta boundaries."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.runtime.reasoning import ReasoningSplitter, split_final

HYP = settings(max_examples=400, deadline=None)


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def stream(deltas: list[str], thinking: bool) -> tuple[str | None, str, list[tuple[str, str]]]:
    s = ReasoningSplitter(thinking)
    pieces = []
    for d in deltas:
        pieces += s.feed(d)
    pieces += s.flush()
    reasoning = "".join(t for c, t in pieces if c == "reasoning")
    content = "".join(t for c, t in pieces if c == "content")
    return (reasoning if s.saw_reasoning else None), content, pieces


# Texts built from tag fragments, whitespace and words, so tags are often split and adjacent.
FRAGMENTS = st.sampled_from([
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<", "</", "</th", "ink>", "<thi", "nk>",
    "<tool", "_call>", "\n", "\n\n", " ", "\t", "a", "word", "é😀", ">", "/",
])
TEXT = st.lists(FRAGMENTS, max_size=25).map("".join)
CUTS = st.lists(st.integers(0, 120), max_size=25)


@HYP
@given(text=TEXT, thinking=st.booleans(), cuts=CUTS)
def test_random_splits_give_the_same_result(text: str, thinking: bool, cuts: list[int]) -> None:
    whole = split_final(text, thinking)
    assert stream(split(text, cuts), thinking)[:2] == whole
    assert stream(list(text), thinking)[:2] == whole


@HYP
@given(text=TEXT, thinking=st.booleans(), cuts=CUTS)
def test_pieces_are_well_formed(text: str, thinking: bool, cuts: list[int]) -> None:
    reasoning, content, pieces = stream(split(text, cuts), thinking)
    assert all(t for _, t in pieces)  # no empty pieces
    if reasoning is not None:
        assert reasoning == reasoning.strip()
    # Once content started, no more reasoning.
    channels = [c for c, _ in pieces]
    if "content" in channels:
        assert "reasoning" not in channels[channels.index("content"):]


@pytest.mark.parametrize("text, thinking, expected", [
    ("Let me think.\n</think>\n\nThe answer is 4.", True, ("Let me think.", "The answer is 4.")),
    ("still thinking when it stopped\n", True, ("still thinking when it stopped", "")),
    ("\n</think>\n\nAnswer", True, ("", "Answer")),
    ("Answer only", False, (None, "Answer only")),
    ("  Answer with </think> inside", False, (None, "  Answer with </think> inside")),
    ("r</think>\n\n a\n</think>b", True, ("r", " a\n</think>b")),  # later tags are plain text
    ("<think>\nmodel opened it\n</think>\n\nok", True, ("model opened it", "ok")),
    ("\n<think>\nmodel opened it\n</think>\n\nok", False, ("model opened it", "ok")),
    ("<think>never closed", False, ("never closed", "")),
    ("plan the call\n<tool_call>\n<function=f>\n</function>\n</tool_call>", True,
     ("plan the call", "<tool_call>\n<function=f>\n</function>\n</tool_call>")),
    ("done\n</think>\n\n<tool_call>\n</tool_call>", True, ("done", "<tool_call>\n</tool_call>")),
    ("x <thin", True, ("x <thin", "")),  # an unfinished tag at the end is text
    ("<thin", False, (None, "<thin")),
    ("<thinking>", False, (None, "<thinking>")),
    ("a <think> b</think>c", True, ("a <think> b", "c")),  # <think> only counts at the start
    ("", True, ("", "")),
    ("", False, (None, "")),
])
def test_examples(text: str, thinking: bool, expected: tuple[str | None, str]) -> None:
    assert split_final(text, thinking) == expected
    assert stream(list(text), thinking)[:2] == expected


def test_streaming_holds_split_tags_and_whitespace() -> None:
    s = ReasoningSplitter(thinking=True)
    assert s.feed("\nStep one") == [("reasoning", "Step one")]
    assert s.feed(".\n\n") == [("reasoning", ".")]  # trailing whitespace held
    assert s.feed("Step two\n</thi") == [("reasoning", "\n\nStep two")]
    assert s.state == "reasoning" and not s.reasoning_done
    assert s.feed("nk>") == []
    assert s.reasoning_done and s.state == "after_think"
    assert s.feed("\n") == []
    assert s.feed("\nHello") == [("content", "Hello")]
    assert s.feed(" world\n") == [("content", " world\n")]
    assert s.flush() == []


def test_tag_prefix_that_is_not_a_tag_is_released() -> None:
    s = ReasoningSplitter(thinking=True)
    assert s.feed("a <tool") == [("reasoning", "a")]
    assert s.feed("box> b") == [("reasoning", " <toolbox> b")]
    assert s.feed(" </tool") == [("reasoning", " </tool")]  # not a prefix of any tag


def test_one_delta_can_hold_both_channels() -> None:
    s = ReasoningSplitter(thinking=True)
    assert s.feed("why\n</think>\n\nbecause") == [("reasoning", "why"), ("content", "because")]


def test_model_written_think_split_over_deltas() -> None:
    s = ReasoningSplitter(thinking=False)
    assert s.feed(" \n") == []
    assert s.feed("<th") == []
    assert s.feed("ink>\nhmm") == [("reasoning", "hmm")]
    assert s.saw_reasoning
    assert s.feed("</think>\n\nyes") == [("content", "yes")]


def test_thinking_off_leading_whitespace_kept() -> None:
    s = ReasoningSplitter(thinking=False)
    assert s.feed("\n\n") == []  # could still be followed by <think>
    assert s.feed("Hi") == [("content", "\n\nHi")]
    assert not s.saw_reasoning
