"""What every protocol shares: prompt rendering, request building, admission, and the run lifecycle.

A protocol module turns its body into a :class:`ChatInput` (template messages and tools) and a
:class:`GenerationSpec` (limits and sampling fields); :meth:`Service.start` renders, tokenizes,
checks the context, submits to the engine and waits for admission, so that 429/503/400 can
still be answered as HTTP statuses before a stream starts. :class:`~ninfer.api.run.Run` yields
the engine's events and cancels the request when it is closed early (client gone, error),
freeing its lane, pages and slot.

Images and videos (server started with ``--vision``): the template messages carry canonical
media parts; :meth:`Service.prompt` expands the rendered ids with
``llm.vision.prompt_from_ids`` (media are fetched, decoded and preprocessed on the pipeline's own
media pool, off the event loop and the default executor, and the fetches stop when the client
disconnects; the tower does not run, so token counting stays cheap) and :meth:`Service.request_for` runs the
tower off the event loop once the prompt has passed the context check, attaching
``MultimodalInputs`` to the engine request.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
import unicodedata
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
from starlette.requests import Request as HTTPRequest

from ninfer.api.config import ServerConfig
from ninfer.api.errors import APIError, invalid
from ninfer.api.metrics import Metrics
from ninfer.api.output import OutputStream
from ninfer.api.run import ClientGone, Run, watch_disconnect
from ninfer.api.sampling import resolve
from ninfer.api.shutdown import Drain
from ninfer.api.structured import grammar_for
from ninfer.runtime.prefix_cache import chat_checkpoint_marks
from ninfer.runtime.request import Request
from ninfer.runtime.sampling import preset_key

__all__ = ["ChatInput", "ClientGone", "GenerationSpec", "Prompt", "Run", "Service"]  # protocols import all from here
# Text prompts up to this many characters (about 2k tokens) are rendered and tokenized on the event loop
# when no other request is in flight.
INLINE_PROMPT_CHARS = 8192
# Longer prompts (and media) are prepared on worker threads, at most this many at a time.
CONCURRENT_LONG_PROMPTS = 2


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
    structured: Any = None  # a ninfer.runtime.structured.Constraint on the answer (api/structured.py)
    n: int = 1  # samples of the prompt (they share its prefill: ninfer.api.samples)
    ignore_eos: bool = False  # generate past the model's end-of-sequence tokens (stops still apply)
    stop_token_ids: frozenset[int] = frozenset()  # vLLM's: the request ends after any of these tokens


class Service:
    def __init__(self, llm: Any, config: ServerConfig, engine: Any, metrics: Metrics, model_id: str,
                 served_names: tuple[str, ...] = (), chat_template: str | None = None,
                 strict_names: bool = False) -> None:
        self.llm, self.config, self.engine, self.metrics = llm, config, engine, metrics
        self.tokenizer = llm.tokenizer
        self.model_id = model_id
        self.served_names = served_names or (model_id,)  # what /v1/models lists; the first is the default
        self.chat_template = chat_template  # replaces the checkpoint's template when set
        self.strict_names = strict_names  # a request naming another model is a 404 (else it is served anyway)
        self.max_context: int = llm.engine.config.max_context
        self.lanes: int = llm.engine.config.max_concurrency
        self.in_flight = 0
        self.drain = Drain()  # open runs, for the graceful shutdown
        template = chat_template or getattr(self.tokenizer.hf, "chat_template", None) or ""
        self.template_has_effort = "reasoning_effort" in template
        self.preset = preset_key(model_id, str(llm.model_dir))
        self.created = int(time.time())
        self.preparing = 0  # requests reading, parsing and tokenizing, not yet submitted
        self._long_prompts = asyncio.Semaphore(CONCURRENT_LONG_PROMPTS)
        self.max_token_bytes = _longest_token_bytes(self.tokenizer)
        self._normalize = _normalizer(self.tokenizer)

    # -- admission of the work before the engine ---------------------------------------------------
    @property
    def held(self) -> int:
        """Requests that hold a place: submitted (queued or running) or being prepared."""
        return self.in_flight + self.preparing

    @contextlib.asynccontextmanager
    async def preparing_request(self) -> AsyncIterator[None]:
        """Hold a place while a request's body is read, parsed and tokenized: that work counts against the
        same lanes + pending limit as queued requests (429 past it), so many huge bodies cannot pile up."""
        self._check_room()
        self.preparing += 1
        try:
            yield
        finally:
            self.preparing -= 1

    def _check_room(self, extra: int = 0) -> None:
        if self.held + extra >= self.lanes + self.config.max_pending:
            self.metrics.rejected("overloaded")
            raise APIError(429, f"the server is overloaded: {self.lanes} lanes and {self.config.max_pending} "
                                f"queue places are taken; retry later", code="server_overloaded")

    def model_name(self, asked: str | None) -> str:
        """The model name a response reports: the one the request asked for (any name is served, unless
        ``strict_model_names``: then a name not served is a 404 ``model_not_found``), else the first served."""
        if asked is None or asked == "":
            return self.served_names[0]
        if self.strict_names and asked not in self.served_names:
            raise APIError(404, f"the model {asked!r} does not exist; this server serves "
                                f"{', '.join(map(repr, self.served_names))}", code="model_not_found", param="model")
        return asked

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
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
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

    async def prompt(self, chat: ChatInput, http: HTTPRequest | None = None) -> Prompt:
        """Render and tokenize; expand media pads. A short text prompt arriving while no other request is
        in flight is done right here: the two thread hops would cost more than the work, and neither
        a stream nor an engine step waits on this thread meanwhile. Otherwise, and for media and long
        prompts, a worker thread does it: fetching, decoding and tokenizing release the GIL, and the
        event loop stays free to deliver other requests' tokens (rendering inline under load also
        kept the engine thread from the GIL until the next request was queued: on CPU, two
        simultaneous requests then shared one prefill step instead of the first starting alone).
        Media go to the vision pipeline's pool; ``http`` gone meanwhile stops their fetches (ClientGone)."""
        from ninfer.vision import FetchCancelled, MediaError, collect_media, reject_media

        try:
            refs = collect_media(chat.messages)
        except MediaError as err:
            raise media_error(err) from None

        def work() -> Prompt:
            text, thinking = self.render(chat)
            self.check_prompt_size(text)
            ids = self.tokenizer.encode(text)
            if not refs:
                return Prompt(ids, thinking)
            try:
                if self.vision is None:
                    reject_media(chat.messages)
                media = self.vision.prompt_from_ids(ids, refs, self.tokenizer.encode)
            except MediaError as err:
                raise media_error(err) from None
            return Prompt(list(media.input_ids), thinking, media)
        short = not refs and _text_chars((chat.messages, chat.tools, chat.prefill)) <= INLINE_PROMPT_CHARS
        if short and self.in_flight == 0 and self.preparing <= 1:
            return work()
        if refs and self.vision is not None:
            watch = watch_disconnect(http)
            try:
                return await self.vision.jobs.run(work, watch)
            except FetchCancelled:
                raise ClientGone() from None
            finally:
                if watch is not None:
                    watch.cancel()
        if short:
            return await asyncio.to_thread(work)
        async with self._long_prompts:  # waiting here still holds the request's place (preparing)
            return await asyncio.to_thread(work)

    def check_prompt_size(self, text: str, param: str = "messages") -> None:
        """A cheap early bound before tokenizing: one token covers at most ``max_token_bytes`` bytes of the
        normalized text, so text of more than ``max_context * max_token_bytes`` bytes is certainly too long."""
        limit = self.max_context * self.max_token_bytes
        if len(text) * 4 < limit:  # at most 4 UTF-8 bytes per character: cannot be over
            return
        normalized = self._normalize(text)
        at_least = -(-len(normalized.encode("utf-8", "replace")) // self.max_token_bytes)
        if at_least >= self.max_context:
            raise APIError(400, f"the prompt has at least {at_least} tokens but the context limit is "
                                f"{self.max_context} tokens", code="context_length_exceeded", param=param)

    async def prompt_ids(self, chat: ChatInput) -> tuple[list[int], bool]:
        prompt = await self.prompt(chat)
        return prompt.ids, prompt.thinking

    async def request_for(self, prompt: Prompt, spec: GenerationSpec) -> Request:
        """The engine request of a prompt; media are encoded by the vision tower off the event loop."""
        req = self.request(prompt.ids, prompt.thinking, spec)
        if spec.structured is not None:
            req.params = dataclasses.replace(req.params, structured=spec.structured)
            req.grammar = await grammar_for(self.llm, spec.structured, prompt.thinking)
        if prompt.media is not None:
            from ninfer.vision import MediaError, MultimodalInputs

            try:
                embeds = await asyncio.to_thread(self.vision.encode, prompt.media)
            except MediaError as err:
                raise media_error(err) from None
            req.mm = MultimodalInputs(prompt.media, embeds)
            req.rope_delta = req.mm.rope_delta
        return req

    def check_context(self, n: int, param: str = "messages") -> None:
        if n >= self.max_context:
            raise APIError(400, f"the prompt has {n} tokens but the context limit is {self.max_context} tokens "
                                f"(room is needed for at least one generated token)",
                           code="context_length_exceeded", param=param)

    def request(self, prompt_ids: list[int], thinking: bool | None, spec: GenerationSpec,
                param: str = "messages") -> Request:
        """The engine request of sample 0; ``thinking`` None: a raw prompt (no preset, no reasoning split)."""
        if not prompt_ids:
            raise invalid("the prompt is empty: at least one token is needed", param, code="invalid_prompt")
        self.check_context(len(prompt_ids), param)
        if spec.logprobs is not None and not self.supports_logprobs:
            raise invalid("'logprobs' is not supported by this engine yet", "logprobs",
                          code="unsupported_parameter")
        params = resolve(self.llm.sampling_params(), self.preset if thinking is not None else None, bool(thinking),
                         self.config.sampling, spec.sampling, spec.logprobs, spec.ignore_eos)
        if params.thinking_budget is not None and thinking is None:
            raise invalid("'thinking_budget' applies to chat replies (a raw prompt has no reasoning)", "thinking_budget")
        # Without a budget of its own, a request gets the server's default, raised to its min_tokens.
        limit = max(self.config.default_max_tokens, params.min_tokens) if spec.max_tokens is None \
            else spec.max_tokens
        limit = max(1, min(limit, self.max_context - len(prompt_ids)))
        marks = chat_checkpoint_marks(prompt_ids, self.tokenizer.token_id("<|im_start|>")) if thinking is not None \
            else ()
        return Request(prompt_ids=prompt_ids, params=params, max_new_tokens=limit, stop_token_ids=spec.stop_token_ids,
                       stop_strings=tuple(spec.stop), thinking=thinking, checkpoint_marks=marks)

    def stop_ids(self, req: Request) -> frozenset[int]:
        """The end-of-sequence ids that end ``req`` (none with ``ignore_eos``)."""
        return frozenset() if getattr(req.params, "ignore_eos", False) else self.llm.stop_ids

    def output(self, req: Request, chat: ChatInput | None) -> OutputStream:
        return OutputStream(req, self.tokenizer, self.stop_ids(req), self.tool_schemas(chat) if chat else None)

    # -- running ---------------------------------------------------------------------------------
    async def start(self, req: Request, http: HTTPRequest | None, siblings: int = 0) -> Run:
        """Submit ``req`` and wait until the engine admits it; raises 429, 503 or 400 as APIError.
        ``siblings``: more samples of the same prompt that will follow (their places are checked now)."""
        if not self.alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        self._check_room(siblings)
        run = Run(self, req)
        await run.admit(http)
        return run

    def open_sibling(self, req: Request) -> Run:
        """Submit a further sample of an admitted request (its place was checked by :meth:`start`)."""
        if not self.alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        return Run(self, req)


def _text_chars(value: Any, limit: int = INLINE_PROMPT_CHARS) -> int:
    """Characters in the strings of ``value`` (nested lists, tuples, dicts); stops counting past ``limit``."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def _normalizer(tokenizer: Any) -> Callable[[str], str]:
    """The tokenizer's text normalization; a Unicode normal form runs as ``unicodedata.normalize`` (the
    tokenizers library's own took 6.5 s on 30 MB, where this takes milliseconds)."""
    backend = getattr(tokenizer.hf, "backend_tokenizer", None)
    normalizer = getattr(backend, "normalizer", None)
    if normalizer is None:
        return lambda text: text
    form = type(normalizer).__name__
    if form in ("NFC", "NFD", "NFKC", "NFKD"):
        return functools.partial(unicodedata.normalize, form)
    return normalizer.normalize_str


def _longest_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes of any vocabulary entry (byte-level entries are at least as long as the text
    they stand for), special tokens included."""
    vocab = tokenizer.hf.get_vocab()
    return max((len(token.encode("utf-8", "replace")) for token in vocab), default=1) or 1
