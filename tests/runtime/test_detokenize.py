"""IncrementalDetokenizer: streamed deltas concatenate to the one-shot decode, never a partial char."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ninfer.default_model import SPECIAL_TOKENS, TEXT_TAGS, build_tokenizer, special_token_ids
from ninfer.runtime import detokenize
from ninfer.runtime.detokenize import IncrementalDetokenizer
from ninfer.tokenizer import Tokenizer

IDS = special_token_ids()
N_IDS = 448 + len(SPECIAL_TOKENS)  # 481 ids the tiny tokenizer knows
HYP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tiny_tok")
    build_tokenizer(Path(path))
    return Tokenizer(Path(path))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def byte_id(tok: Tokenizer) -> dict[int, int]:
    """Byte value -> id of the single-byte token."""
    table = {b: tok.hf.convert_tokens_to_ids(ch) for b, ch in _bytes_to_unicode().items()}
    assert sorted(table.values()) == list(range(256))
    return table


def stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    """All deltas of a token-by-token stream, the flush last."""
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    return [d.push(i) for i in ids] + [d.flush()]


def byte_ids(byte_id: dict[int, int], text: str) -> list[int]:
    return [byte_id[b] for b in text.encode("utf-8")]


# -- exactness -------------------------------------------------------------------------------

@HYP
@given(ids=st.lists(st.integers(0, N_IDS - 1), max_size=80), skip=st.booleans())
def test_random_ids_concatenate_to_decode(tok: Tokenizer, ids: list[int], skip: bool) -> None:
    assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


@HYP
@given(data=st.data(), skip=st.booleans())
def test_random_bytes_and_specials_concatenate_to_decode(
        tok: Tokenizer, byte_id: dict[int, int], data: st.DataObject, skip: bool) -> None:
    # Mostly raw bytes, biased towards UTF-8 lead/continuation bytes, with special tokens mixed
    # in: characters split across tokens, interrupted and invalid sequences.
    interesting = [byte_id[b] for b in (0x80, 0x82, 0x98, 0x9F, 0xAC, 0xBF, 0xC3, 0xE2, 0xE4, 0xF0, 0xFF)]
    token = st.one_of(st.sampled_from(interesting), st.integers(0, N_IDS - 1),
                      st.sampled_from(list(IDS.values())))
    ids = data.draw(st.lists(token, max_size=120))
    assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


@HYP
@given(text=st.text(max_size=60))
@example(text="\ufffd")  # a replacement character in the text itself (CI's hypothesis found it)
def test_any_text_roundtrips_without_partial_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas = stream(tok, ids, skip=False)  # special-token text in ``text`` encodes to its id
    assert "".join(deltas) == tok.decode(ids)
    if "\ufffd" not in text:  # valid UTF-8 in, no replacement char out (unless the text holds one itself)
        assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("text", [
    "héllo wörld, naïve café", "中文的文本，还有日本語のテキスト", "emoji 😀👍🏽 and 👨‍👩‍👧 family",
    "mixed: e\u0301 (combining), ß, Ω, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "tabs\tand\nnewlines\r\n",
])
def test_unicode_text_token_by_token(tok: Tokenizer, byte_id: dict[int, int], text: str) -> None:
    for ids in (tok.encode(text), byte_ids(byte_id, text)):  # BPE tokens, and one byte per token
        deltas = stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids)
        assert all("\ufffd" not in d for d in deltas)
    assert "".join(stream(tok, byte_ids(byte_id, text))) == text


def test_multibyte_character_is_held_until_complete(tok: Tokenizer, byte_id: dict[int, int]) -> None:
    assert stream(tok, byte_ids(byte_id, "a😀b")) == ["a", "", "", "", "😀", "b", ""]


def test_incomplete_character_at_end_is_flushed_as_replacement(tok: Tokenizer, byte_id: dict[int, int]) -> None:
    ids = byte_ids(byte_id, "x€")[:-1]  # "x" + the first two bytes of "€"
    assert stream(tok, ids) == ["x", "", "", "\ufffd"]
    assert tok.decode(ids) == "x\ufffd"


def test_character_split_around_a_skipped_special_token(tok: Tokenizer, byte_id: dict[int, int]) -> None:
    e = byte_ids(byte_id, "€")
    ids = [e[0], IDS["<|im_end|>"], e[1], e[2]]
    assert "".join(stream(tok, ids, skip=True)) == tok.decode(ids, skip_special_tokens=True) == "€"
    assert "".join(stream(tok, ids, skip=False)) == tok.decode(ids, skip_special_tokens=False)


# -- special tokens --------------------------------------------------------------------------

def test_control_tokens_skipped_but_tags_kept(tok: Tokenizer) -> None:
    hi = tok.encode("Hi")
    ids = [IDS["<think>"], *hi, IDS["</think>"], IDS["<tool_call>"], *hi, IDS["</tool_call>"],
           IDS["<|im_end|>"], IDS["<|endoftext|>"]]
    deltas = stream(tok, ids, skip=True)
    assert "".join(deltas) == "<think>Hi</think><tool_call>Hi</tool_call>"
    assert deltas[-3:] == ["", "", ""]  # <|im_end|>, <|endoftext|>, flush
    assert "".join(stream(tok, ids, skip=False)).endswith("</tool_call><|im_end|><|endoftext|>")
    for tag in TEXT_TAGS:
        assert stream(tok, [IDS[tag]], skip=True) == [tag, ""]
    for special in set(SPECIAL_TOKENS) - TEXT_TAGS:
        assert stream(tok, [IDS[special]], skip=True) == ["", ""]
        assert stream(tok, [IDS[special]], skip=False) == [special, ""]


# -- window management and API ---------------------------------------------------------------

def test_window_stays_bounded_and_exact_on_long_streams(tok: Tokenizer) -> None:
    import random

    rng = random.Random(0)
    ids = [rng.randrange(N_IDS) for _ in range(3000)]
    d = IncrementalDetokenizer(tok)
    out = []
    for i in ids:
        out.append(d.push(i))
        assert len(d._window) <= detokenize._HARD_CAP
    assert "".join(out) + d.flush() == tok.decode(ids, skip_special_tokens=True)
    assert d.num_tokens == len(ids)


@pytest.mark.parametrize("junk", [[0x80], [0xF0, 0x9F], [0xE2, 0x82, 0xE2]])
def test_endless_invalid_utf8_is_exact_and_bounded(tok: Tokenizer, byte_id: dict[int, int], junk: list[int]) -> None:
    # A model stuck on bytes that never form a character: no clean point for hundreds of tokens.
    ids = [byte_id[b] for b in junk] * 300 + byte_ids(byte_id, "ok€")
    d = IncrementalDetokenizer(tok)
    out = []
    for i in ids:
        out.append(d.push(i))
        assert len(d._window) <= detokenize._HARD_CAP
    assert "".join(out) + d.flush() == tok.decode(ids)
    assert sum(1 for x in out if x) > 100  # text keeps flowing, it is not all held to the end


@HYP
@given(ids=st.lists(st.integers(0, N_IDS - 1), max_size=60), cuts=st.lists(st.integers(1, 5), max_size=30))
def test_push_many_matches_push(tok: Tokenizer, ids: list[int], cuts: list[int]) -> None:
    d = IncrementalDetokenizer(tok)
    out, i = [], 0
    for n in cuts + [len(ids)]:
        out.append(d.push_many(ids[i:i + n]))
        i += n
    assert "".join(out) + d.flush() == tok.decode(ids, skip_special_tokens=True)


def test_accepts_a_transformers_tokenizer(tok: Tokenizer) -> None:
    ids = tok.encode("plain <think> text 😀")
    d = IncrementalDetokenizer(tok.hf, skip_special_tokens=True)
    assert "".join(d.push(i) for i in ids) + d.flush() == tok.decode(ids, skip_special_tokens=True)
