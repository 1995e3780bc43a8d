"""Turns a request's sampled tokens into text events: detokenize, stop, split reasoning."""
from __future__ import annotations

from ninfer.runtime.detokenize import IncrementalDetokenizer
from ninfer.runtime.reasoning import THINK_END, ReasoningSplitter
from ninfer.runtime.request import Request, RequestOutput
from ninfer.runtime.stops import StopStringMatcher
from ninfer.tokenizer import Tokenizer


class OutputProcessor:
    """Per-request text pipeline: tokens -> UTF-8-safe text -> stop strings -> reasoning/content channels.

    ``finish_reason`` becomes "stop" when a stop token or stop string ends the request. Stop
    tokens count in ``token_ids`` but add no text; a stop string is cut from the text. A stop string
    completed within the first ``min_tokens`` tokens does not match (vLLM's rule); a stop token there
    still ends the request, as the sampler lets one through only when a grammar allows nothing else.
    """

    def __init__(self, req: Request, tokenizer: Tokenizer, stop_ids: frozenset[int]) -> None:
        self.request_id = req.request_id
        self.stop_ids = stop_ids | req.stop_token_ids
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self.stops = StopStringMatcher(list(req.stop_strings)) if req.stop_strings else None
        self.splitter = ReasoningSplitter(bool(req.thinking)) if req.thinking is not None else None
        self.finish_reason: str | None = None
        self.grammar = req.grammar
        self.min_tokens = req.params.min_tokens
        self.count = 0  # tokens pushed
        budget = req.params.thinking_budget if req.thinking else None
        self.think_end_id = tokenizer.token_id(THINK_END) if budget is not None else None

    @property
    def reasoning_open(self) -> bool:
        """Whether the reply is still in its reasoning (thinking on, no ``</think>`` or tool call yet)."""
        return self.splitter is not None and self.splitter.thinking and not self.splitter.reasoning_done

    def push(self, token: int) -> RequestOutput:
        event = RequestOutput(self.request_id, [token])
        self.count += 1
        if self.grammar is not None:
            self.grammar.accept(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return event
        text = self.detok.push(token)
        if self.stops is not None and text:
            text, hit = self.stops.feed(text, armed=self.count > self.min_tokens)
            if hit:
                self.finish_reason = "stop"
        self._route(event, text)
        return event

    def finish(self, last: RequestOutput | None, reason: str) -> RequestOutput:
        """The final event: the last tokens plus whatever text was held back, marked finished."""
        event = last or RequestOutput(self.request_id, [])
        stopped_by_string = self.stops is not None and self.stops.matched is not None
        if not stopped_by_string:
            tail = self.detok.flush()
            if self.stops is not None:
                tail, _ = self.stops.feed(tail, armed=self.count > self.min_tokens) if tail else ("", False)
                if self.stops.matched is None:
                    tail += self.stops.flush()
            self._route(event, tail)
        if self.splitter is not None:
            self._route_pieces(event, self.splitter.flush())
        event.finished, event.finish_reason = True, reason
        return event

    def _route(self, event: RequestOutput, text: str) -> None:
        if not text:
            return
        if self.splitter is None:
            event.text += text
        else:
            self._route_pieces(event, self.splitter.feed(text))

    @staticmethod
    def _route_pieces(event: RequestOutput, pieces: list[tuple[str, str]]) -> None:
        for channel, piece in pieces:
            if channel == "reasoning":
                event.reasoning += piece
            else:
                event.text += piece
