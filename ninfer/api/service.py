"""What every protocol shares: prompt rendering, request building, admission, and the run lifecycle.

A protocol module turns its body into a :class:`ChatInput` (template messages and tools) and a
:class:`GenerationSpec` (limits and sampling fields); :meth:`Service.start` renders, tokenizes,
checks the context, submits to the engine and waits for admission, so that 429/503/400 can
still be answered as HTTP statuses before a stream starts. :class:`Run` yields the engine's
events and cancels the request when it is closed early (client gone, error), freeing its lane,
pages and slot.

Images and videos (server started with ``--vision``): the template messages carry canonical
media parts; :meth:`Service.prompt` expands the rendered ids with
``llm.vision.prompt_from_ids`` (media are fetched, decoded and preprocessed off the event loop,
the tower does not run, so token counting stays cheap) and :meth:`Service.request_for` runs the
tower off the event loop once the prompt has passed the context check, attaching
``MultimodalInputs`` to the engine request.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
from starlette.requests import Request as HTTPRequest

from ninfer.api.config import ServerConfig
from ninfer.api.convert import engine_failure
from ninfer.api.errors import APIError, invalid
from ninfer.api.metrics import Metrics
from ninfer.api.output import OutputStream
from ninfer.api.sampling import resolve
from ninfer.runtime.prefix_cache import chat_checkpoint_marks
from ninfer.runtime.sampling import preset_key
from ninfer.runtime.request import Request, RequestOutput, Status
from ninfer.runtime.scheduler import AdmissionError, QueueFull

log = logging.getLogger("ninfer.api")
_POLL_S = 0.02  # admission polling interval


class ClientGone(Exception):
    """The client disconnected while its request waited or ran; nothing is answered."""


@dataclass
class ChatInput:
    """A conversation ready for the chat template."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None  # OpenAI chat-format definitions, as the template expects
    tool_choice: str = "auto"  # "auto" or "none"
    thinking: bool | None = None  # None: the server default
    preserve_thinking: bool | None = None
    reasoning_effort: str | None = None
    prefill: str | None = None  # text the assistant turn starts with (Anthropic prefill)


@dataclass
class Prompt:
    """A rendered, tokenized prompt; ``media`` is a ``ninfer.vision.MultimodalPrompt`` when it has images/videos."""

    ids: list[int]
    thinking: bool
    media: Any = None


def media_error(err: Exception, param: str = "messages") -> APIError:
    """A ``ninfer.vision.MediaError`` as a 400 naming the limit or the problem."""
    from ninfer.vision import error_code

    limit = getattr(err, "limit", None)
    return APIError(400, str(err), code=error_code(err), param=limit or param)  # type: ignore[arg-type]


@dataclass
class GenerationSpec:
    max_tokens: int | None = None  # None: the server default
    stop: list[str] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)  # only the fields the client set
    logprobs: int | None = None  # None: off; else the number of top alternatives


class Service:
    def __init__(self, llm: Any, config: ServerConfig, engine: Any, metrics: Metrics, model_id: str) -> None:
        self.llm, self.config, self.engine, self.metrics = llm, config, engine, metrics
        self.tokenizer = llm.tokenizer
        self.model_id = model_id
        self.max_context: int = llm.engine.config.max_context
        self.lanes: int = llm.engine.config.max_concurrency
        self.in_flight = 0
        template = getattr(self.tokenizer.hf, "chat_template", None) or ""
        self.template_has_effort = "reasoning_effort" in template
        self.preset = preset_key(model_id, str(llm.model_dir))
        self.created = int(time.time())

    # -- capabilities -------------------------------------------------------------------------
    @property
    def supports_logprobs(self) -> bool:
        inner = getattr(self.engine, "engine", None) or self.llm.engine
        return bool(getattr(inner, "supports_logprobs", False))

    @property
    def alive(self) -> bool:
        thread = getattr(self.engine, "_thread", None)
        return thread is None or thread.is_alive()

    # -- prompts --------------------------------------------------------------------------------
    def thinking_for(self, chat: ChatInput) -> bool:
        return self.config.thinking if chat.thinking is None else chat.thinking

    @staticmethod
    def tool_schemas(chat: ChatInput) -> dict[str, Any] | None:
        """Declared tool name -> parameters schema, or None when tool calls are not parsed."""
        if not chat.tools or chat.tool_choice == "none":
            return None
        return {t["function"]["name"]: t["function"].get("parameters") or {} for t in chat.tools}

    def render(self, chat: ChatInput) -> tuple[str, bool]:
        """Prompt text and the thinking mode the request really runs with."""
        thinking = self.thinking_for(chat) and chat.prefill is None  # a prefilled answer skips thinking
        kwargs: dict[str, Any] = {}
        preserve = self.config.preserve_thinking if chat.preserve_thinking is None else chat.preserve_thinking
        if preserve:
            kwargs["preserve_thinking"] = True
        if chat.reasoning_effort is not None and self.template_has_effort:
            kwargs["reasoning_effort"] = chat.reasoning_effort
        tools = chat.tools if chat.tools and chat.tool_choice != "none" else None
        try:
            prompt = self.tokenizer.apply_chat_template(chat.messages, tools=tools, enable_thinking=thinking, **kwargs)
        except (TemplateError, ValueError, TypeError, KeyError) as err:  # bad history shapes are the client's
            raise invalid(f"the messages cannot be rendered by the chat template: {err}", "messages",
                          code="invalid_prompt") from None
        if chat.prefill is not None:
            prompt += chat.prefill
        return prompt, thinking

    @property
    def vision(self) -> Any:
        """The ``ninfer.vision.VisionPipeline`` when images and videos are served, else None."""
        return getattr(self.llm, "vision", None)

    async def prompt(self, chat: ChatInput) -> Prompt:
        """Render and tokenize off the event loop (long prompts take milliseconds); expand media pads."""
        from ninfer.vision import MediaError, collect_media, reject_media

        def work() -> Prompt:
            text, thinking = self.render(chat)
            ids = self.tokenizer.encode(text)
            try:
                refs = collect_media(chat.messages)
                if not refs:
                    return Prompt(ids, thinking)
                if self.vision is None:
                    reject_media(chat.messages)
                media = self.vision.prompt_from_ids(ids, refs, self.tokenizer.encode)
            except MediaError as err:
                raise media_error(err) from None
            return Prompt(list(media.input_ids), thinking, media)
        return await asyncio.to_thread(work)

    async def prompt_ids(self, chat: ChatInput) -> tuple[list[int], bool]:
        prompt = await self.prompt(chat)
        return prompt.ids, prompt.thinking

    async def request_for(self, prompt: Prompt, spec: GenerationSpec) -> Request:
        """The engine request of a prompt; media are encoded by the vision tower off the event loop."""
        req = self.request(prompt.ids, prompt.thinking, spec)
        if prompt.media is not None:
            from ninfer.vision import MediaError, MultimodalInputs

            try:
                embeds = await asyncio.to_thread(self.vision.encode, prompt.media)
            except MediaError as err:
                raise media_error(err) from None
            req.mm = MultimodalInputs(prompt.media, embeds)
            req.rope_delta = req.mm.rope_delta
        return req

    def check_context(self, n: int) -> None:
        if n >= self.max_context:
            raise APIError(400, f"the prompt has {n} tokens but the context limit is {self.max_context} tokens "
                                f"(room is needed for at least one generated token)",
                           code="context_length_exceeded", param="messages")

    def request(self, prompt_ids: list[int], thinking: bool, spec: GenerationSpec) -> Request:
        if not prompt_ids:
            raise invalid("the prompt is empty: at least one token is needed", "messages", code="invalid_prompt")
        self.check_context(len(prompt_ids))
        if spec.logprobs is not None and not self.supports_logprobs:
            raise invalid("'logprobs' is not supported by this engine yet", "logprobs",
                          code="unsupported_parameter")
        params = resolve(self.llm.sampling_params(), self.preset, thinking, self.config.sampling, spec.sampling,
                         spec.logprobs)
        limit = self.config.default_max_tokens if spec.max_tokens is None else spec.max_tokens
        limit = max(1, min(limit, self.max_context - len(prompt_ids)))
        return Request(prompt_ids=prompt_ids, params=params, max_new_tokens=limit,
                       stop_strings=tuple(spec.stop), thinking=thinking,
                       checkpoint_marks=chat_checkpoint_marks(prompt_ids, self.tokenizer.token_id("<|im_start|>")))

    def output(self, req: Request, chat: ChatInput) -> OutputStream:
        return OutputStream(req, self.tokenizer, self.llm.stop_ids, self.tool_schemas(chat))

    # -- running ---------------------------------------------------------------------------------
    async def start(self, req: Request, http: HTTPRequest | None) -> Run:
        """Submit ``req`` and wait until the engine admits it; raises 429, 503 or 400 as APIError."""
        if not self.alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        if self.in_flight >= self.lanes + self.config.max_pending:
            self.metrics.rejected("overloaded")
            raise APIError(429, f"the server is overloaded: {self.lanes} lanes and {self.config.max_pending} "
                                f"queue places are taken; retry later", code="server_overloaded")
        run = Run(self, req)
        await run.admit(http)
        return run


class Run:
    """One submitted request: its event stream, admission, and cancellation on early close."""

    def __init__(self, service: Service, req: Request) -> None:
        self.service, self.req = service, req
        self._events = service.engine.generate(req)
        self._next: asyncio.Future | None = None
        self.finished = False  # the engine sent the finished event
        self.closed = False  # accounted for (in-flight count, metrics)
        self.generated = 0
        self._start = time.perf_counter()
        service.in_flight += 1

    async def admit(self, http: HTTPRequest | None) -> None:
        """Wait for admission; a client that disconnects meanwhile withdraws its request (ClientGone)."""
        svc = self.service
        loop = asyncio.get_running_loop()
        deadline = loop.time() + svc.config.pending_timeout_ms / 1000
        self._next = asyncio.ensure_future(self._events.__anext__())
        watch = _watch_disconnect(http)
        try:
            while True:
                await asyncio.wait({self._next, watch} if watch else {self._next}, timeout=_POLL_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                if self._next.done():
                    self._check_first()
                    break
                if watch is not None and watch.done():
                    self.close()
                    raise ClientGone()
                if self.req.status is not Status.WAITING:
                    break
                if loop.time() > deadline:
                    self.close("queue_timeout", count=False)
                    svc.metrics.rejected("queue_timeout")
                    raise APIError(503, f"the request waited {svc.config.pending_timeout_ms} ms without "
                                        f"being admitted (pending timeout)", code="request_queue_timeout")
        finally:
            if watch is not None:
                watch.cancel()
        svc.metrics.queue_time.observe(time.perf_counter() - self._start)
        svc.metrics.prompt_tokens.inc(len(self.req.prompt_ids))
        svc.metrics.prompt_tokens_cached.inc(int(getattr(self.req, "cached_tokens", 0) or 0))

    def _check_first(self) -> None:
        """Turn an admission failure delivered as the first event into an HTTP error."""
        assert self._next is not None
        err = self._next.exception()
        if err is None:
            return
        self._next = None
        self.finished = True  # the stream is over: nothing to cancel
        self._account("rejected", count=False)
        if isinstance(err, QueueFull):
            self.service.metrics.rejected("overloaded")
            raise APIError(429, f"the server is overloaded: {err}; retry later", code="server_overloaded")
        self.service.metrics.rejected("invalid")
        if isinstance(err, AdmissionError):
            raise APIError(400, str(err), code="context_length_exceeded", param="messages")
        if isinstance(err, StopAsyncIteration):
            raise APIError(500, "the engine closed the request without an event", code="engine_error")
        raise APIError(500, f"the engine rejected the request: {type(err).__name__}", code="engine_error")

    async def events(self, http: HTTPRequest | None = None) -> AsyncIterator[RequestOutput]:
        """Engine events until the finished one; with ``http``, a disconnect cancels (ClientGone)."""
        watch = _watch_disconnect(http)
        try:
            while not self.finished:
                if self._next is None:
                    self._next = asyncio.ensure_future(self._events.__anext__())
                while not self._next.done():
                    await asyncio.wait({self._next, watch} if watch else {self._next}, timeout=1.0,
                                       return_when=asyncio.FIRST_COMPLETED)
                    if watch is not None and watch.done():
                        self.close()
                        raise ClientGone()
                    if not self._next.done() and not self.service.alive:
                        self.close("error")
                        raise APIError(500, "the engine stopped while the request ran", code="engine_error")
                task, self._next = self._next, None
                try:
                    event = task.result()
                except StopAsyncIteration:
                    self.finished = True
                    self._account("error")
                    raise APIError(500, "the engine ended the stream without a finished event",
                                   code="engine_error") from None
                self.generated += len(event.token_ids)
                if event.finished:
                    self.finished = True
                    await self._events.aclose()
                    self._account(event.finish_reason or "stop")
                yield event
        finally:
            if watch is not None:
                watch.cancel()

    async def collect(self, out: OutputStream, http: HTTPRequest | None = None) -> Any:
        """Run a non-streaming request to its end and return the collected output; an engine failure raises."""
        try:
            async for event in self.events(http):
                out.push(event)
        finally:
            self.close()
        if (err := engine_failure(out.finish_reason, out.error)) is not None:
            raise err
        return out.collected()

    def close(self, outcome: str = "cancelled", count: bool = True) -> None:
        """Cancel the request if it still runs. Idempotent, and never awaits: safe while being cancelled."""
        if not self.finished:
            self.finished = True
            self.service.engine.cancel(self.req.request_id)
            if self._next is not None and not self._next.done():
                self._next.cancel()  # the engine stream's own cleanup runs in its task
            else:
                _close_soon(self._events)
        self._account(outcome, count)

    def _account(self, outcome: str, count: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        self.service.in_flight -= 1
        if not count:
            return
        req, elapsed = self.req, time.perf_counter() - self._start
        ttft = req.first_token_time - req.arrival if req.first_token_time is not None else None
        self.service.metrics.finished(outcome, self.generated, ttft, elapsed)
        log.info("request %s %s: prompt %d tok, generated %d tok, %.3f s", req.request_id, outcome,
                 len(req.prompt_ids), self.generated, elapsed)


def _close_soon(agen: Any) -> None:
    try:
        asyncio.get_running_loop().create_task(agen.aclose())
    except RuntimeError:  # no running loop: the generator is finalized when collected
        pass


def _watch_disconnect(http: HTTPRequest | None) -> asyncio.Task | None:
    """A task that ends when the client disconnects (the body must already have been read)."""
    if http is None:
        return None

    async def wait() -> None:
        while True:
            message = await http.receive()
            if message["type"] == "http.disconnect":
                return
    return asyncio.ensure_future(wait())
