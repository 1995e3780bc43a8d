"""Tokenizer.encode and .decode: their fast backend paths give exactly what transformers' encode and decode give."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer.default_model import SPECIAL_TOKENS, build_tokenizer
from ninfer.tokenizer import Tokenizer

TEXTS = ["", "hello world", "  leading and trailing  ", "tabs\tand\nnew\r\nlines\n\n\n", "héllo ✓ 日本語 🙂",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", "<|im_start", "a" * 5000]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tiny_tok")
    build_tokenizer(Path(path))
    return Tokenizer(Path(path))


def _reference(tok: Tokenizer, text: str) -> list[int]:
    return tok.hf.encode(text, add_special_tokens=False)


def test_the_fast_path_is_taken(tok: Tokenizer) -> None:
    assert tok._backend is not None  # tokenizers has encode_batch_fast: the tests below compare it


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, text: str) -> None:
    assert tok.encode(text) == _reference(tok, text)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=40), st.sampled_from(sorted(SPECIAL_TOKENS))), max_size=8))
def test_encode_matches_transformers_on_mixed_text(tok: Tokenizer, parts: list[str]) -> None:
    text = "".join(parts)
    assert tok.encode(text) == _reference(tok, text)


def test_split_special_tokens_takes_the_transformers_path(tok: Tokenizer) -> None:
    text = "<|im_start|>user"
    tok.hf.split_special_tokens = True
    try:
        split = tok.encode(text)
        assert split == tok.hf.encode(text, add_special_tokens=False)
        assert len(split) > 2  # the marker was tokenized as text, not as its one id
    finally:
        tok.hf.split_special_tokens = False
    assert tok.encode(text) == _reference(tok, text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 600), max_size=24), st.booleans())
def test_decode_matches_transformers(tok: Tokenizer, ids: list[int], skip: bool) -> None:
    # ids past the vocabulary (a padded embedding's rows) and special tokens included; split UTF-8 sequences
    # decode to U+FFFD on both paths
    assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(ids, skip_special_tokens=skip)


def test_decode_takes_transformers_path_when_it_cleans_up_spaces(tok: Tokenizer,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[int]] = []
    real = tok.hf.decode
    monkeypatch.setattr(tok.hf, "clean_up_tokenization_spaces", True)
    monkeypatch.setattr(tok.hf, "decode", lambda ids, **kw: calls.append(list(ids)) or real(ids, **kw))
    tok.decode([1, 2, 3])
    assert calls == [[1, 2, 3]]
