"""The step's last stage: each sampled token into its request's output events, and the end of a request.

A request ends when its output processor reports a stop, at its token budget, on cancel, or when one of its
stages failed (``finish_reason="error"``, the error in the event); ending gives its lane, pages, slots and
pause snapshot back and, after a normal end, lets the prefix cache keep where its computation stopped.
"""
from __future__ import annotations

import logging
import time

from ninfer.runtime.isolation import error_message
from ninfer.runtime.output import OutputProcessor
from ninfer.runtime.pause import Pauser
from ninfer.runtime.prefix_cache import PrefixCache
from ninfer.runtime.request import Request, RequestOutput, Status
from ninfer.runtime.sampler import Sampler, TokenLogprobs
from ninfer.runtime.scheduler import Scheduler
from ninfer.runtime.speculative import SpecStats

log = logging.getLogger("ninfer.engine")


class Postprocessor:
    """Over the engine's tables of live requests (``requests``, ``outputs``: the engine adds to them, this
    removes from them) and the collaborators that hold a request's resources."""

    def __init__(self, *, scheduler: Scheduler, sampler: Sampler, pauser: Pauser, prefix: PrefixCache | None,
                 requests: dict[str, Request], outputs: dict[str, OutputProcessor], spec_totals: SpecStats) -> None:
        self.scheduler, self.sampler, self.pauser, self.prefix = scheduler, sampler, pauser, prefix
        self.requests, self.outputs, self.spec_totals = requests, outputs, spec_totals

    def append(self, req: Request, token: int, logprobs: TokenLogprobs | None = None) -> list[RequestOutput]:
        """A token the request committed: its event (none while text is held back), or its final event."""
        req.output_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        processor = self.outputs[req.request_id]
        try:
            event = processor.push(token)
        except Exception as err:
            return self.fail(req, "detokenization", err)
        if logprobs is not None:
            event.logprobs = [logprobs]
        if req.think_end is not None and (token == req.think_end or not processor.reasoning_open):
            req.think_end = None  # the reasoning closed: the budget has nothing left to force
        if processor.finish_reason is not None:
            return [self.finish(req, processor.finish_reason, event)]
        if len(req.output_ids) >= req.max_new_tokens:
            return [self.finish(req, "length", event)]
        return [event] if event.token_ids else []

    def fail(self, req: Request, stage: str, err: Exception, logged: bool = False) -> list[RequestOutput]:
        """End one request whose ``stage`` raised ``err``: its error event (none if it had already ended)."""
        if not logged:
            log.error("request %s failed in %s", req.request_id, stage, exc_info=err)
        if req.status is Status.FINISHED or req.request_id not in self.requests:
            return []
        return [self.finish(req, "error", error=error_message(stage, err))]

    def finish(self, req: Request, reason: str, event: RequestOutput | None = None,
               error: str | None = None) -> RequestOutput:
        """Release the request's lane, pages, slots and snapshot, and build its final event (``error``: why it
        failed; its held-back text is dropped then, the output processor may be what failed)."""
        if self.prefix is not None and reason in ("stop", "length") and req.slot is not None and req.prefill_done:
            # The next turn of a conversation resends all of this: checkpoint where computation stopped.
            self.prefix.insert(req.tokens(0, req.num_computed), req.slot, req.pages, req.media_keys)
        if req.spec_stats is not None:
            self.spec_totals.add(req.spec_stats)
        self.pauser.discard(req)  # a request cancelled while paused gives its snapshot's host memory back
        self.scheduler.finish(req)
        self.sampler.finish(req)
        req.finish_reason, req.finish_time = reason, time.perf_counter()
        processor = self.outputs.pop(req.request_id)
        self.requests.pop(req.request_id, None)
        if error is None:
            try:
                return processor.finish(event, reason)
            except Exception as err:
                log.error("request %s failed in finishing its output", req.request_id, exc_info=err)
                error = error_message("output processing", err)
                req.finish_reason = "error"
        return RequestOutput(req.request_id, [], finished=True, finish_reason="error", error=error)
