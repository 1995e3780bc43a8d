"""Incremental detokenization: one generated token in, the new UTF-8-safe text out.

Byte-level BPE (Qwen's tokenizer) can split one character over several tokens: "😀" may arrive
as three tokens, the first two of which decode to U+FFFD on their own. Streaming must never show
those replacement characters, and the concatenated stream must equal the one-shot decode of all
ids. This module uses the prefix-window scheme of vLLM/TGI, restated in terms of a single
decode per token:

* keep a short window of the most recent ids and ``emitted``, the number of characters of
  ``decode(window)`` already handed out;
* after each push, decode the window; if it ends with U+FFFD the last character may still be an
  incomplete UTF-8 sequence, so hold that one character back; hand out everything else past
  ``emitted``;
* at a clean point (decoded text does not end with U+FFFD) the decoder is in its initial state,
  so the window can be cut to its last few ids without changing anything that follows.

Why this is exact (for a byte-level decoder; transformers' decode is the Rust decode, which for
BPE does no clean-up): the Rust decoder joins every id's bytes and applies
``String::from_utf8_lossy``, which replaces each maximal ill-formed subsequence with one U+FFFD.
That is prefix-stable except for its last character: if ``decode(B)`` ends with U+FFFD, then
``decode(B)[:-1]`` is a prefix of ``decode(B + C)`` for every continuation ``C`` (an incomplete
tail is at most 3 bytes and produces exactly one U+FFFD); if it does not, ``decode(B)`` itself is.
UTF-8 self-synchronises at any complete character, so a window starting mid-stream decodes the
bytes after its first complete character exactly as the whole stream does. Skipped special
tokens contribute no bytes, so a character split around ``<|im_end|>`` still decodes (as it does
in ``tokenizer.decode(ids, skip_special_tokens=True)``).

Cost per token: one decode of at most ``_SLIDE_AT`` ids (a few microseconds), plus a second
decode each time the window slides.
"""
from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"

# Window management. At a clean point, a window longer than _SLIDE_AT ids is cut to its last
# _CONTEXT ids (context keeps tokenizers whose decode depends on the previous token, e.g. a
# SentencePiece leading space, exact too). A window that reaches _HARD_CAP ids without a clean
# point (the model keeps producing invalid UTF-8) is cut to its last _CAP_KEEP ids while holding
# back the one trailing character: exact as long as those ids hold the incomplete tail's (at
# most 3) bytes, i.e. unless nearly all of them are skipped special tokens.
_CONTEXT = 4
_SLIDE_AT = 16
_HARD_CAP = 64
_CAP_KEEP = 16


class SupportsDecode(Protocol):
    """What the detokenizer needs from ``ninfer.tokenizer.Tokenizer`` (or an HF tokenizer)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas that never split a character.

    ``"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids, skip_special_tokens=...)``.
    With ``skip_special_tokens=True`` the control tokens (``<|im_end|>``, ``<|endoftext|>``, ...)
    produce no text; ``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``,
    ``<tool_response>`` are added tokens that are *not* special in Qwen tokenizers, so they still
    appear as text for the reasoning and tool-call parsers. Ids outside the vocabulary decode to
    nothing (as in ``tokenizer.decode``).

    One instance per request (per sequence); it keeps only a short window of ids, not the output.
    """

    def __init__(self, tokenizer: SupportsDecode, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._window: list[int] = []  # the most recent ids; decode(window) is the reference text
        self._emitted = 0  # characters of decode(window) already returned
        self.num_tokens = 0  # ids pushed so far (for the caller's bookkeeping)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (possibly ``""``)."""
        return self.push_many((token_id,))

    def push_many(self, token_ids: list[int] | tuple[int, ...]) -> str:
        """Add several ids at once (e.g. accepted speculative tokens); one decode for all of them."""
        if not token_ids:
            return ""
        self._window.extend(token_ids)
        self.num_tokens += len(token_ids)
        text = self._decode(self._window)
        clean = not text.endswith(REPLACEMENT_CHAR)
        # A trailing U+FFFD may be an incomplete character that later ids complete: hold it.
        stable = len(text) if clean else len(text) - 1
        delta = text[self._emitted:stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        if clean and len(self._window) > _SLIDE_AT:
            # Everything is emitted and the decoder is at a character boundary: restart the
            # window on the last few ids; all of their text counts as emitted.
            del self._window[:-_CONTEXT]
            self._emitted = len(self._decode(self._window))
        elif len(self._window) > _HARD_CAP:
            # Pathological run without a clean point: keep only the trailing ids and the one
            # held-back character, so the per-token cost stays bounded.
            held = len(text) - self._emitted
            del self._window[:-_CAP_KEEP]
            self._emitted = max(0, len(self._decode(self._window)) - held)
        return delta

    def flush(self) -> str:
        """End of stream: return the held-back text (an incomplete character becomes U+FFFD)."""
        text = self._decode(self._window)
        delta = text[self._emitted:]
        self._emitted = len(text)
        return delta
