"""Engine events to protocol-neutral pieces: reasoning text, answer text and parsed tool calls.

Each protocol module renders these pieces in its own grammar; :class:`OutputStream` also keeps
what every protocol reports at the end: the finish reason, the stop sequence that hit, usage.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ninfer.api.tool_parser import ToolCall, ToolCallParser
from ninfer.runtime.request import Request, RequestOutput
from ninfer.runtime.stops import StopStringMatcher

PieceKind = Literal["reasoning", "text", "tool_call"]
Piece = tuple[PieceKind, Any]


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    accepted_prediction_tokens: int = 0  # speculative decoding: drafts the target confirmed
    rejected_prediction_tokens: int = 0  # drafts it did not

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Collected:
    """A whole (non-streaming) generation."""

    reasoning: str | None
    text: str
    tool_calls: list[ToolCall]
    finish_reason: str
    stop_sequence: str | None
    usage: Usage
    logprobs: list[Any] = field(default_factory=list)


class OutputStream:
    """Feeds a request's events through the tool-call parser and accumulates totals."""

    def __init__(self, req: Request, tokenizer: Any, stop_ids: frozenset[int], tools: dict[str, Any] | None) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids | req.stop_token_ids
        self.parser = ToolCallParser(tools) if tools is not None else None
        self.token_ids: list[int] = []
        self.reasoning_parts: list[str] = []
        self.text_parts: list[str] = []
        self.logprobs: list[Any] = []
        self.finish_reason: str | None = None
        self.error: str | None = None

    @property
    def saw_reasoning(self) -> bool:
        return bool(self.req.thinking) or bool(self.reasoning_parts)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.parser.calls if self.parser is not None else []

    def push(self, event: RequestOutput) -> list[Piece]:
        """Pieces of one engine event (the finished event also flushes what was held back)."""
        self.token_ids.extend(event.token_ids)
        if event.logprobs:
            self.logprobs.extend(event.logprobs)
        pieces: list[Piece] = []
        if event.reasoning:
            self.reasoning_parts.append(event.reasoning)
            pieces.append(("reasoning", event.reasoning))
        if event.text:
            pieces.extend(self._content(event.text))
        if event.finished:
            if self.parser is not None:
                pieces.extend(self._record(self.parser.flush()))
            self.finish_reason = event.finish_reason or "stop"
            self.error = event.error
        return pieces

    def _content(self, text: str) -> list[Piece]:
        if self.parser is None:
            self.text_parts.append(text)
            return [("text", text)]
        return self._record(self.parser.feed(text))

    def _record(self, pieces: list[tuple[str, Any]]) -> list[Piece]:
        for kind, value in pieces:
            if kind == "text":
                self.text_parts.append(value)
        return pieces  # type: ignore[return-value]

    @property
    def reasoning(self) -> str | None:
        return "".join(self.reasoning_parts) if self.saw_reasoning else None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def stop_sequence(self) -> str | None:
        """The stop string that ended the request (the engine reports only "stop"): re-run the matcher."""
        if self.finish_reason != "stop" or not self.req.stop_strings:
            return None
        if self.token_ids and self.token_ids[-1] in self.stop_ids:
            return None  # an end-of-sequence token, not a stop string
        matcher = StopStringMatcher(self.req.stop_strings)
        # As the engine matched: a stop string completed within the first min_tokens tokens does not count.
        n = min(getattr(self.req.params, "min_tokens", 0), len(self.token_ids))
        head = self.tokenizer.decode(self.token_ids[:n], skip_special_tokens=True) if n else ""
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if head and text.startswith(head):
            matcher.feed(head, armed=False)
            text = text[len(head):]
        matcher.feed(text)
        return matcher.matched

    def usage(self) -> Usage:
        reasoning = "".join(self.reasoning_parts)
        # An estimate: the reasoning text re-tokenized, never more than was generated.
        reasoning_tokens = min(len(self.tokenizer.encode(reasoning)), len(self.token_ids)) if reasoning else 0
        spec = getattr(self.req, "spec_stats", None)
        return Usage(prompt_tokens=len(self.req.prompt_ids), completion_tokens=len(self.token_ids),
                     reasoning_tokens=reasoning_tokens,
                     cached_tokens=int(getattr(self.req, "cached_tokens", 0) or 0),
                     accepted_prediction_tokens=spec.accepted if spec is not None else 0,
                     rejected_prediction_tokens=spec.drafted - spec.accepted if spec is not None else 0)

    def collected(self) -> Collected:
        return Collected(self.reasoning, self.text, list(self.tool_calls), self.finish_reason or "stop",
                         self.stop_sequence(), self.usage(), list(self.logprobs))
