"""Split a chat completion's text stream into reasoning and content (reference §13.2).

With thinking on, the prompt ends with ``<|im_start|>assistant\\n<think>\\n``, so the output
starts inside the reasoning and looks like ``reasoning\\n</think>\\n\\nanswer``. With thinking
off the prompt already closed the think block and everything is content.

Rules (applied identically to a stream and to a whole text, whatever the delta boundaries):

* ``</think>`` ends the reasoning; the tag is not emitted and the newlines right after it are
  dropped (the answer starts after ``</think>`` plus any following ``"\\n"``).
* A ``<tool_call>`` while the reasoning is open ends it implicitly; ``<tool_call>`` and what
  follows go to content, for the tool-call parser.
* A model that writes ``<think>`` itself as the first non-whitespace output: the tag (and the
  whitespace before it) is dropped and the text is reasoning until ``</think>``, in both modes.
* Reasoning text is whitespace-stripped at both ends; trailing whitespace is held back until more reasoning text follows, and dropped when
  the reasoning ends.
* After the reasoning ends, tags are plain text (a later ``</think>`` goes to content verbatim).

Tags may arrive split over deltas ("</thi" + "nk>"): a tail that could still become a tag is
held back. Cost per delta is O(len(delta)) plus a bounded tag check.
"""
from __future__ import annotations

from typing import Literal

Channel = Literal["reasoning", "content"]
Piece = tuple[Channel, str]

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
_REASONING_ENDS = (THINK_END, TOOL_CALL_START)
_MAX_TAG = max(len(t) for t in _REASONING_ENDS)

# States of the splitter.
_START = "start"  # nothing but whitespace seen yet: may still be a model-written <think>
_REASONING = "reasoning"
_AFTER_THINK = "after_think"  # just after </think>: drop newlines
_CONTENT = "content"


class ReasoningSplitter:
    """Routes a text stream to the ``"reasoning"`` or ``"content"`` channel.

    ``feed(delta)`` returns the pieces that are safe to emit now, as ``(channel, text)`` pairs
    in stream order (adjacent pieces of one channel merged, no empty pieces); ``flush()``
    returns what was held back at the end of the stream (an unfinished tag is plain text).
    ``saw_reasoning`` tells whether the stream had a reasoning part at all (always true with
    thinking on), ``reasoning_done`` whether that part has ended.
    """

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking
        self._state = _START
        self.saw_reasoning = thinking
        self.reasoning_done = False
        self._lead: list[str] = []  # _START: leading whitespace seen so far
        self._start_tag = ""  # _START: a non-empty proper prefix of "<think>"
        self._tag = ""  # _REASONING: held-back tail that may begin an end tag
        self._ws: list[str] = []  # _REASONING: held-back trailing whitespace
        self._reasoning_started = False  # _REASONING: leading whitespace is dropped until then

    @property
    def state(self) -> str:
        """``"start"``, ``"reasoning"``, ``"after_think"`` or ``"content"``."""
        return self._state

    def feed(self, delta: str) -> list[Piece]:
        """Process the next piece of text; return the ``(channel, text)`` pieces to emit now."""
        out: list[Piece] = []
        self._feed(delta, out)
        return _merge(out)

    def flush(self) -> list[Piece]:
        """End of stream: emit held-back text as plain text of the current channel."""
        out: list[Piece] = []
        if self._state == _START:
            text = "".join(self._lead) + self._start_tag
            self._lead, self._start_tag = [], ""
            self._begin_body(text, out)
        if self._state == _REASONING:
            tag, self._tag = self._tag, ""
            self._emit_reasoning(tag, out)
            self._ws = []  # trailing whitespace of the reasoning is stripped
        return _merge(out)

    # -- states ------------------------------------------------------------------------------

    def _feed(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self._state == _START:
            self._feed_start(text, out)
        elif self._state == _REASONING:
            self._feed_reasoning(text, out)
        elif self._state == _AFTER_THINK:
            text = text.lstrip("\n")
            if text:
                self._state = _CONTENT
                out.append(("content", text))
        else:
            out.append(("content", text))

    def _feed_start(self, text: str, out: list[Piece]) -> None:
        if self._start_tag:
            s = self._start_tag + text
        else:
            s = text.lstrip()
            if len(s) < len(text):
                self._lead.append(text[:len(text) - len(s)])
            if not s:
                return  # still only whitespace
        if s.startswith(THINK_START):
            # The model opened the think block itself: drop the tag and the whitespace before it.
            self._lead, self._start_tag = [], ""
            self._enter_reasoning()
            self._feed(s[len(THINK_START):], out)
        elif THINK_START.startswith(s):
            self._start_tag = s  # "<thi": wait for the next delta
        else:
            lead = "".join(self._lead)
            self._lead, self._start_tag = [], ""
            self._begin_body(lead + s, out)

    def _begin_body(self, text: str, out: list[Piece]) -> None:
        """Leave _START without a model-written <think>: the prompt decides the channel."""
        if self.thinking:
            self._enter_reasoning()
        else:
            self._state = _CONTENT
        self._feed(text, out)

    def _enter_reasoning(self) -> None:
        self._state = _REASONING
        self.saw_reasoning = True

    def _feed_reasoning(self, text: str, out: list[Piece]) -> None:
        s = self._tag + text
        self._tag = ""
        # The earliest end tag wins.
        found: tuple[int, str] | None = None
        for tag in _REASONING_ENDS:
            i = s.find(tag)
            if i >= 0 and (found is None or i < found[0]):
                found = (i, tag)
        if found is None:
            hold = _tag_prefix_len(s)
            self._tag = s[len(s) - hold:] if hold else ""
            self._emit_reasoning(s[:len(s) - hold], out)
            return
        i, tag = found
        self._emit_reasoning(s[:i], out)
        self._ws = []  # trailing whitespace of the reasoning is stripped
        self.reasoning_done = True
        if tag == THINK_END:
            self._state = _AFTER_THINK
            self._feed(s[i + len(tag):], out)
        else:  # <tool_call> closes the reasoning implicitly and belongs to the content
            self._state = _CONTENT
            out.append(("content", s[i:]))

    def _emit_reasoning(self, text: str, out: list[Piece]) -> None:
        """Emit reasoning text, stripped at the start and with trailing whitespace held back."""
        if not text:
            return
        if not self._reasoning_started:
            text = text.lstrip()
            if not text:
                return
            self._reasoning_started = True
        body = text.rstrip()
        if body:
            out.append(("reasoning", "".join(self._ws) + body))
            self._ws = []
        if len(body) < len(text):
            self._ws.append(text[len(body):])


def _tag_prefix_len(s: str) -> int:
    """Length of the longest suffix of ``s`` that is a proper prefix of a reasoning end tag."""
    start = s.find("<", max(0, len(s) - _MAX_TAG + 1))  # earliest candidate = longest suffix
    while start >= 0:
        tail = s[start:]
        if any(t.startswith(tail) for t in _REASONING_ENDS):
            return len(s) - start
        start = s.find("<", start + 1)
    return 0


def _merge(pieces: list[Piece]) -> list[Piece]:
    merged: list[Piece] = []
    for channel, text in pieces:
        if not text:
            continue
        if merged and merged[-1][0] == channel:
            merged[-1] = (channel, merged[-1][1] + text)
        else:
            merged.append((channel, text))
    return merged


def split_final(text: str, thinking: bool) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a whole completion, exactly as the streaming splitter splits it.

    ``reasoning`` is None when the output had no reasoning part (thinking off and no
    model-written ``<think>``); with thinking on it is a string, possibly empty.
    """
    splitter = ReasoningSplitter(thinking)
    reasoning: list[str] = []
    content: list[str] = []
    for channel, piece in splitter.feed(text) + splitter.flush():
        (reasoning if channel == "reasoning" else content).append(piece)
    return ("".join(reasoning) if splitter.saw_reasoning else None), "".join(content)
