"""StopStringMatcher: cut at the first stop string, whatever the delta boundaries."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.runtime.stops import StopStringMatcher

HYP = settings(max_examples=300, deadline=None)


def oracle(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Independent reference: the first position where some stop string ends; longest wins ties."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[:end - len(stop)], stop
    return text, None


def run(stops: list[str], deltas: list[str], **kw: bool) -> tuple[str, str | None, list[str]]:
    m = StopStringMatcher(stops, **kw)
    outs = []
    for d in deltas:
        text, hit = m.feed(d)
        outs.append(text)
        assert hit == (m.matched is not None)
    outs.append(m.flush())
    return "".join(outs), m.matched, outs


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


ALPHABET = st.sampled_from(list("abc<>/\n ") + ["ab", "</s>", "END", "😀", "é"])
STOPS = st.lists(st.text(alphabet="abc<>/\n ", min_size=0, max_size=5), max_size=4)


@HYP
@given(parts=st.lists(ALPHABET, max_size=40), stops=STOPS, cuts=st.lists(st.integers(0, 80), max_size=20))
def test_random_splits_match_the_oracle(parts: list[str], stops: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    expected, matched = oracle(text, stops)
    out, got_matched, _ = run(stops, split(text, cuts))
    assert (out, got_matched) == (expected, matched)
    assert run(stops, [text])[:2] == (expected, matched)  # whole text at once
    assert run(stops, list(text))[:2] == (expected, matched)  # one character at a time


@HYP
@given(parts=st.lists(ALPHABET, max_size=30), stops=STOPS, cuts=st.lists(st.integers(0, 60), max_size=20))
def test_include_stop_str(parts: list[str], stops: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    expected, matched = oracle(text, stops)
    out, got, _ = run(stops, split(text, cuts), include_stop_str=True)
    assert got == matched and out == expected + (matched or "")


def test_stop_split_over_deltas() -> None:
    m = StopStringMatcher(["</answer>"])
    assert m.feed("The result</ans") == ("The result", False)  # "</ans" held back
    assert m.feed("wer> trailing") == ("", True)
    assert m.matched == "</answer>" and m.stopped
    assert m.feed("more") == ("", True)  # ignored after the hit
    assert m.flush() == ""


def test_held_text_released_when_disambiguated() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("xx ST") == ("xx ", False)
    assert m.feed("OX") == ("STOX", False)
    assert m.feed("S") == ("", False)
    assert m.flush() == "S"
    assert m.matched is None


def test_text_before_stop_in_the_same_delta() -> None:
    m = StopStringMatcher(["\n\n", "###"])
    assert m.feed("line one\nline two\n\nline three") == ("line one\nline two", True)
    assert m.matched == "\n\n"


def test_first_ending_stop_wins_then_longest() -> None:
    assert oracle("xabc", ["xabc", "ab"]) == ("x", "ab")
    assert run(["xabc", "ab"], ["xabc"])[:2] == ("x", "ab")
    assert run(["bc", "abc"], ["zabcd"])[:2] == ("z", "abc")


def test_no_stop_strings_pass_through() -> None:
    m = StopStringMatcher(["", ""])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_stop_at_very_start() -> None:
    assert run(["<"], ["<a"])[:2] == ("", "<")


@pytest.mark.parametrize("deltas", [["ab", "cab", "cd"], ["a", "b", "c", "a", "b", "c", "d"]])
def test_overlapping_prefix_restarts(deltas: list[str]) -> None:
    # "abcabcd": the first "abc" is not followed by "d"; the match restarts inside the held text.
    assert run(["abcd"], deltas)[:2] == ("abc", "abcd")


def _fed(m: StopStringMatcher, text: str, step: int) -> tuple[str, bool]:
    outs, hit = [], False
    for i in range(0, len(text), step):
        out, hit = m.feed(text[i:i + step])
        outs.append(out)
        if hit:
            break
    return "".join(outs), hit


@pytest.mark.slow
def test_huge_and_many_stop_strings_use_linear_memory_and_bounded_time() -> None:
    # A 1,000,000-character stop string once cost gigabytes (every prefix stored); the matcher must stay
    # linear in the stop strings' length, even when the stream runs deep into one of them and then diverges.
    import time
    import tracemalloc

    huge = "ab" * 500_000
    mid = [f"{i:04d}" + "xy" * 2_000 for i in range(200)]  # 200 stop strings of 4,004 characters
    text = "hello " + huge[:100_000] + "c" + " 0042" + "xy" * 1_000 + " tail"
    tracemalloc.start()
    start = time.perf_counter()
    try:
        m = StopStringMatcher([huge, *mid])
        out, hit = _fed(m, text, 4)  # token-sized deltas
        out += m.flush()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    elapsed = time.perf_counter() - start
    assert (out, hit, m.matched) == (text, False, None)  # nothing completed, nothing lost
    total = len(huge) + sum(map(len, mid))
    # A few bytes per stop character (about 2 MB here); storing every prefix would take terabytes.
    assert peak < 8 * total, f"peak {peak / 1e6:.1f} MB for {total / 1e6:.1f} M stop characters"
    assert elapsed < 20, f"{elapsed:.1f} s"


@pytest.mark.slow
def test_huge_stop_string_still_matches_across_deltas() -> None:
    huge = "ab" * 500_000
    m = StopStringMatcher([huge, "zz"])
    text = "pre " + "ab" * 10 + " " + huge + " post"
    out, hit = _fed(m, text, 7)
    assert hit and m.matched == huge and out == "pre " + "ab" * 10 + " "
