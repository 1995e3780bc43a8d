"""``ninfer.AsyncLLM``: the engine on its own thread, streamed from asyncio.

``async for out in llm.generate_async(prompt, params)`` yields :class:`StreamOutput` deltas (answer
text, reasoning, completed tool calls, token ids, logprobs) and, on each sample's last delta, its
finish reason and usage. Leaving the ``async for`` early (``break``, an exception, the task being
cancelled) cancels the request in the engine and frees its lane. Generations started together
batch in the engine. The synchronous ``LLM`` calls step the same engine on the caller's thread,
so they first stop this thread (restarted by the next async call) and refuse while a stream is open.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ninfer.outputs import StreamOutput
from ninfer.params import SamplingParams
from ninfer.prompts import parse_prompts, tool_schemas
from ninfer.results import RequestResults
from ninfer.runtime.async_engine import AsyncEngine
from ninfer.runtime.prefix_cache import chat_checkpoint_marks
from ninfer.runtime.request import Request

if TYPE_CHECKING:
    from ninfer.llm import LLM


class AsyncLLM:
    """The async API of one :class:`ninfer.LLM` (``llm.async_llm``, or ``await AsyncLLM.load(...)``)."""

    def __init__(self, llm: LLM) -> None:
        if llm._async is not None:
            raise ValueError("this LLM already has its AsyncLLM: use llm.async_llm")
        self.llm = llm
        llm._async = self
        self._engine: AsyncEngine | None = None
        self._open = 0  # streams not yet closed

    @classmethod
    async def load(cls, *args: Any, **kwargs: Any) -> AsyncLLM:
        """``ninfer.load(*args, **kwargs)`` off the event loop, then its async API."""
        from ninfer.loading import load

        return (await asyncio.to_thread(load, *args, **kwargs)).async_llm

    # -- generation ---------------------------------------------------------------------------
    async def generate(self, prompt: Any, sampling_params: SamplingParams | None = None, *,
                       request_id: str | None = None) -> AsyncIterator[StreamOutput]:
        """Stream one raw prompt's completion (text, token ids or a prompt dict; ``sampling_params``
        default: :meth:`ninfer.LLM.get_default_sampling_params`). With ``n > 1`` the samples' deltas
        interleave, told apart by ``index``."""
        items, single = parse_prompts(prompt, self.llm.tokenizer.encode, self.llm.config.vocab_size)
        if not single:
            raise ValueError("generate() of the async API takes one prompt: start one generation per prompt "
                             "(concurrent generations batch in the engine)")
        params = self._params(sampling_params, None)
        reqs = self.llm._requests(items[0].token_ids, params)
        async with contextlib.aclosing(self._stream(reqs, request_id, None)) as stream:  # closed with this one
            async for out in stream:
                yield out

    async def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None, *,
                   tools: list[dict[str, Any]] | None = None, enable_thinking: bool | None = None,
                   chat_template_kwargs: dict[str, Any] | None = None,
                   request_id: str | None = None) -> AsyncIterator[StreamOutput]:
        """Stream one conversation's reply: reasoning and answer deltas, and tool calls as each completes."""
        from ninfer.llm import thinking_mode
        from ninfer.prompts import parse_conversations

        conversations, single = parse_conversations(messages)
        if not single:
            raise ValueError("chat() of the async API takes one conversation (a list of messages)")
        thinking = thinking_mode(enable_thinking, chat_template_kwargs)
        schemas = tool_schemas(tools)
        params = self._params(sampling_params, thinking)
        # Rendering may fetch and encode media: off the event loop.
        ids, mm, _ = await asyncio.to_thread(self.llm._chat_prompt, conversations[0], tools, thinking)
        marks = chat_checkpoint_marks(ids, self.llm.tokenizer.token_id("<|im_start|>"))
        reqs = self.llm._requests(ids, params, thinking=thinking, mm=mm, marks=marks)
        async with contextlib.aclosing(self._stream(reqs, request_id, schemas)) as stream:  # closed with this one
            async for out in stream:
                yield out

    def _params(self, sampling_params: SamplingParams | None, thinking: bool | None) -> SamplingParams:
        if sampling_params is None:
            return self.llm.get_default_sampling_params(thinking)
        return self.llm._params_per_prompt(sampling_params, 1, {})[0]

    async def _stream(self, reqs: list[Request], request_id: str | None,
                      tools: dict[str, Any] | None) -> AsyncIterator[StreamOutput]:
        """The merged deltas of one prompt's samples. Sample 0 goes first; the others are submitted once its
        first token shows its prompt prefilled (and checkpointed by the prefix cache), so they reuse it."""
        engine = self._started()
        group = request_id or reqs[0].request_id
        results = [RequestResults(r, self.llm.tokenizer, self.llm.stop_ids_for(r), tools) for r in reqs]
        events: asyncio.Queue = asyncio.Queue()
        tasks: list[asyncio.Task] = []

        def start(i: int) -> None:
            tasks.append(asyncio.create_task(_pump(engine, i, reqs[i], events)))

        start(0)
        waiting = list(range(1, len(reqs)))
        if self.llm.engine.prefix is None:  # nothing to share: all at once
            for i in waiting:
                start(i)
            waiting = []
        self._open += 1
        try:
            remaining = len(reqs)
            while remaining:
                i, event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                if i == 0 and waiting:
                    for j in waiting:
                        start(j)
                    waiting = []
                delta = results[i].push(event)
                delta.request_id, delta.index = group, i
                if event.finished:
                    remaining -= 1
                yield delta
        finally:
            self._open -= 1
            for task in tasks:  # a sample still running is cancelled in the engine by its generator
                task.cancel()
            # Wait until the cancellations are sent, so that whatever the caller sends next comes after them.
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- the engine thread --------------------------------------------------------------------
    def _started(self) -> AsyncEngine:
        if self._engine is None or not self._engine.alive:
            self._engine = AsyncEngine(self.llm.engine)
        return self._engine

    async def is_idle(self) -> bool:
        """Whether the engine holds no request and no memory beyond the prefix cache's, asked on the engine
        thread after every command sent before (cancellations included)."""
        if self._engine is None or not self._engine.alive:
            return self.llm.engine.is_idle()
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()

        def ask(engine: Any) -> None:
            idle = engine.is_idle()
            loop.call_soon_threadsafe(lambda: answer.done() or answer.set_result(idle))

        self._engine.call(ask)
        return await answer

    def stop_if_idle(self) -> None:
        """Stop the engine thread so that the caller's thread may step the engine (the synchronous API)."""
        if self._open:
            raise RuntimeError(f"{self._open} async generation(s) are still open on this model: finish or close "
                               f"them (contextlib.aclosing) before calling the synchronous API")
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the engine thread; requests still in the engine are cancelled. The next async call restarts it."""
        if self._engine is None:
            return
        engine, self._engine = self._engine, None
        engine.shutdown()
        inner = self.llm.engine
        inner.on_admit = inner.on_launched = None
        for request_id in list(inner.requests):
            inner.cancel(request_id)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()


async def _pump(engine: AsyncEngine, index: int, req: Request, events: asyncio.Queue) -> None:
    """Forward one request's engine events (or its failure) to the merged queue."""
    try:
        async with contextlib.aclosing(engine.generate(req)) as stream:
            async for event in stream:
                events.put_nowait((index, event))
    except asyncio.CancelledError:
        raise
    except Exception as err:  # admission errors, a stopped engine: the reader raises them
        events.put_nowait((index, err))
