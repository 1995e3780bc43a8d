"""One request's engine events turned into the Python API's results: a :class:`Completion` at the end,
a :class:`StreamOutput` per event. Reasoning comes split by the engine's output processor; tool calls
are parsed, and usage and stop sequences found, by the server's :class:`ninfer.api.output.OutputStream`
(the same rules over HTTP and in Python)."""
from __future__ import annotations

from typing import Any

from ninfer.outputs import Completion, StreamOutput, convert_logprobs
from ninfer.runtime.request import Request, RequestOutput


class RequestResults:
    """Accumulates the events of one request (``tools``: declared name -> parameters schema, or None)."""

    def __init__(self, req: Request, tokenizer: Any, stop_ids: frozenset[int], tools: dict[str, Any] | None) -> None:
        from ninfer.api.output import OutputStream  # lazily: `import ninfer` does not load the HTTP server

        self.req = req
        self.tokenizer = tokenizer
        self.stream = OutputStream(req, tokenizer, stop_ids, tools)
        self.wants_logprobs = req.params.logprobs is not None
        self._decoded: dict[int, str] = {}

    def push(self, event: RequestOutput) -> StreamOutput:
        """Feed one engine event; what it added, as a delta of sample ``index`` 0 (the caller sets it)."""
        pieces = self.stream.push(event)
        delta = StreamOutput(
            request_id=self.req.request_id, token_ids=list(event.token_ids),
            text="".join(v for kind, v in pieces if kind == "text"),
            reasoning="".join(v for kind, v in pieces if kind == "reasoning"),
            tool_calls=[v for kind, v in pieces if kind == "tool_call"],
            logprobs=self._logprobs(event.logprobs or []) if self.wants_logprobs else None,
        )
        if event.finished:
            delta.finished, delta.finish_reason, delta.error = True, event.finish_reason, event.error
            delta.stop_reason, delta.usage = self.stop_reason(), self.stream.usage()
        return delta

    def stop_reason(self) -> str | int | None:
        """vLLM's ``stop_reason``: the stop string or requested stop token that ended the request, else None."""
        if self.stream.finish_reason != "stop":
            return None
        ids = self.req.output_ids
        if ids and ids[-1] in self.req.stop_token_ids:
            return ids[-1]
        return self.stream.stop_sequence()

    def completion(self) -> Completion:
        """The whole result, once the request has finished."""
        req, stream = self.req, self.stream
        ttft = (req.first_token_time or req.arrival) - req.arrival
        decode = (req.finish_time or req.arrival) - (req.first_token_time or req.arrival)
        return Completion(
            text=stream.text, token_ids=list(req.output_ids), finish_reason=req.finish_reason or "error",
            prompt_tokens=len(req.prompt_ids), reasoning="".join(stream.reasoning_parts) if req.thinking else None,
            ttft_s=ttft, decode_s=decode, cached_tokens=req.cached_tokens,
            speculation=req.spec_stats.as_dict() if req.spec_stats is not None else None,
            logprobs=self._logprobs(stream.logprobs) if self.wants_logprobs else None,
            tool_calls=list(stream.tool_calls), stop_reason=self.stop_reason())

    def _logprobs(self, entries: list[Any]) -> list[dict]:
        return convert_logprobs(entries, self._decode)

    def _decode(self, token_id: int) -> str:
        text = self._decoded.get(token_id)
        if text is None:
            text = self._decoded[token_id] = self.tokenizer.decode([token_id])
        return text
