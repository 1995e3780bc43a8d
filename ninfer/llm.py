"""The public entry point: ``llm = ninfer.load(...)``, then ``generate``, ``chat``, ``score`` and the async API."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ninfer.checkpoint import LoadReport
from ninfer.config import ModelConfig
from ninfer.models.qwen3_5 import Qwen3_5TextModel
from ninfer.outputs import Completion, RequestOutput, StreamOutput
from ninfer.params import REQUEST_FIELDS, SamplingParams
from ninfer.prompts import PromptInput, parse_conversations, parse_prompts, tool_schemas
from ninfer.results import RequestResults
from ninfer.runtime.engine import Engine, EngineConfig
from ninfer.runtime.output import OutputProcessor
from ninfer.runtime.prefix_cache import chat_checkpoint_marks
from ninfer.runtime.request import Request, Status
from ninfer.runtime.sampling import PRESETS, check_stop_strings, preset_key
from ninfer.runtime.sampling import SamplingParams as EngineSamplingParams
from ninfer.runtime.scheduler import QueueFull
from ninfer.runtime.sequence import SequenceRunner
from ninfer.runtime.structured import Constraint, StructuredCompiler
from ninfer.tokenizer import Tokenizer, stop_token_ids

if TYPE_CHECKING:
    from ninfer.async_llm import AsyncLLM

SCORE_SLICE = 256  # rows of logits materialised at once while scoring (V is 248k wide)
KEYWORD_MAX_TOKENS = {"generate": 256, "chat": 1024}  # ninfer's keyword-style defaults (SamplingParams: 16)


@dataclass(frozen=True)
class ScoreWindow:
    """One sliding window of :meth:`LLM.score`: tokens ``[start, end)`` read, ``[first_target, end)`` scored."""

    start: int
    end: int
    first_target: int
    logprobs: torch.Tensor


class LLM:
    """A loaded Qwen3.5 checkpoint with its tokenizer and its batching engine.

    Two calling conventions: vLLM's (``generate(prompts, SamplingParams(...))`` gives a list of
    :class:`RequestOutput`, one per prompt, each with its ``n`` completions) and ninfer's keywords
    (``generate("text", max_new_tokens=..., temperature=...)`` gives one :class:`Completion`, or a
    list for a list of prompts). See docs/python-api.md.
    """

    def __init__(self, model: Qwen3_5TextModel, tokenizer: Tokenizer, model_dir: Path, report: LoadReport,
                 engine_config: EngineConfig, vision: Any = None, mtp_head: Any = None) -> None:
        self.model = model
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.load_report = report
        self.startup: Any = None  # the runtime.startup.StartupReport of ninfer.load (phases, compilations)
        self.stop_ids = frozenset(stop_token_ids(model_dir, tokenizer, self.config.eos_token_ids))
        self.valid_vocab = min(self.config.vocab_size, tokenizer.vocab_size)
        self.defaults = _generation_defaults(model_dir)
        self.engine = Engine(model, lambda req: OutputProcessor(req, tokenizer, self.stop_ids_for(req)),
                             engine_config, vocab_limit=self.valid_vocab, mtp_head=mtp_head)
        self.runner = SequenceRunner(model, kv_dtype=engine_config.kv_dtype)  # scoring runs outside the engine's pool
        self.vision = vision  # a ninfer.vision.VisionPipeline when loaded with vision=True
        self._async: AsyncLLM | None = None
        # Structured output (SamplingParams.structured): grammars over the model's padded vocabulary.
        self.structured = StructuredCompiler(tokenizer.hf, self.config.vocab_size, sorted(self.stop_ids),
                                             tokenizer.token_id("</think>"))

    @property
    def device(self) -> torch.device:
        return self.model.device

    def stop_ids_for(self, req: Request) -> frozenset[int]:
        """The model's end-of-sequence ids that end ``req`` (none with ``ignore_eos``)."""
        return frozenset() if getattr(req.params, "ignore_eos", False) else self.stop_ids

    # -- sampling parameters ------------------------------------------------------------------
    def sampling_params(self, temperature: float | None = None, top_p: float | None = None,
                        top_k: int | None = None, seed: int | None = None, greedy: bool = False,
                        thinking: bool | None = None, **extra: Any) -> EngineSamplingParams:
        """Explicit arguments override the model's preset for the thinking mode (chats of known Qwen
        models), which overrides the checkpoint's generation_config.json. ``extra``: min_p,
        presence/frequency/repetition penalties, logprobs."""
        values: dict[str, Any] = {"temperature": self.defaults.get("temperature", 1.0),
                                  "top_p": self.defaults.get("top_p", 1.0), "top_k": self.defaults.get("top_k", 0)}
        preset = preset_key(str(self.model_dir)) if thinking is not None else None
        if preset is not None:
            values.update(PRESETS[preset][thinking])
        given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, **extra}
        values.update({k: v for k, v in given.items() if v is not None})
        return EngineSamplingParams(greedy=greedy or not self.defaults.get("do_sample", True), seed=seed, **values)

    def get_default_sampling_params(self, thinking: bool | None = None) -> SamplingParams:
        """vLLM's defaults (``max_tokens=16``) with the sampling values of the model's generation_config.json
        (and of its preset for a chat's ``thinking`` mode)."""
        return SamplingParams.from_engine(self.sampling_params(thinking=thinking))

    def _keyword_params(self, kind: str, max_new_tokens: int | None, thinking: bool | None,
                        sampling: dict[str, Any]) -> SamplingParams:
        """ninfer's keyword convention: sampling keywords over the model's defaults, request keywords as given."""
        request = {k: sampling.pop(k) for k in REQUEST_FIELDS if k in sampling}
        for vllm_name, ours in (("max_tokens", "max_new_tokens"), ("n", None)):
            if vllm_name in request:
                hint = f"use {ours}=" if ours else "pass ninfer.SamplingParams(n=...): the samples come back as " \
                                                   "RequestOutput.outputs"
                raise TypeError(f"{kind}() got the keyword {vllm_name!r}: {hint}")
        max_tokens = KEYWORD_MAX_TOKENS[kind] if max_new_tokens is None else max_new_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_tokens!r}")
        return SamplingParams.from_engine(self.sampling_params(thinking=thinking, **sampling), max_tokens=max_tokens,
                                          **request)

    @staticmethod
    def _params_per_prompt(sampling_params: Any, count: int, keywords: dict[str, Any]) -> list[SamplingParams]:
        given = sorted(k for k, v in keywords.items() if v is not None and v is not False)
        if given:
            raise TypeError(f"pass sampling settings either in SamplingParams or as keywords, not both: {given}")
        many = isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, bytes))
        params = list(sampling_params) if many else [sampling_params] * count
        if len(params) != count:
            raise ValueError(f"sampling_params has {len(params)} entries for {count} prompts "
                             f"(give one, or one per prompt)")
        for i, p in enumerate(params):
            if not isinstance(p, EngineSamplingParams):
                where = f"sampling_params[{i}]" if many else "sampling_params"
                raise TypeError(f"{where} must be a ninfer.SamplingParams, got {type(p).__name__} (ninfer's "
                                f"keyword style passes max_new_tokens=, temperature=, ... by name)")
        return [SamplingParams.from_engine(p) for p in params]

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 max_new_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, seed: int | None = None, greedy: bool = False,
                 stop_token_ids: list[int] | None = None, stop: str | list[str] | None = None,
                 on_delta: Callable[[StreamOutput], None] | None = None,
                 **sampling: Any) -> list[RequestOutput] | Completion | list[Completion]:
        """Continue raw prompts (no chat template): text, token ids, ``{"prompt_token_ids": [...]}``, or a list
        of these (mixed freely); all run concurrently in the engine.

        With ``sampling_params`` (one, or one per prompt): a list of :class:`RequestOutput` (vLLM's
        convention). Otherwise ninfer's keywords (``max_new_tokens`` default 256; ``sampling`` takes
        min_p, presence/frequency/repetition penalties, logprobs, ignore_eos) over the model's
        generation_config.json defaults, and a :class:`Completion` per prompt (a list for a list).
        ``on_delta`` is called with each :class:`StreamOutput` as it is produced (its ``request_id`` tells
        the prompts apart), so a caller can show the text while it is generated.
        """
        items, single = parse_prompts(prompts, self.tokenizer.encode, self.config.vocab_size)
        keywords = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                    "seed": seed, "greedy": greedy, "stop_token_ids": stop_token_ids, "stop": stop, **sampling}
        if sampling_params is not None:
            return self._outputs(items, self._params_per_prompt(sampling_params, len(items), keywords),
                                 on_delta=on_delta)
        params = self._keyword_params("generate", max_new_tokens, None, {
            "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed, "greedy": greedy,
            "stop_token_ids": stop_token_ids, "stop": stop, **sampling})
        completions = [out.outputs[0] for out in self._outputs(items, [params] * len(items), on_delta=on_delta)]
        return completions[0] if single else completions

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             tools: list[dict[str, Any]] | None = None, enable_thinking: bool | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, max_new_tokens: int | None = None,
             stop: str | list[str] | None = None, on_delta: Callable[[StreamOutput], None] | None = None,
             **sampling: Any) -> list[RequestOutput] | Completion | list[Completion]:
        """Apply the chat template to one conversation (a list of messages) or a list of them, generate, split
        the reasoning from the answer and, with ``tools`` (OpenAI function tools), parse the tool calls.

        Message content may be a string or OpenAI-style parts: ``text``, ``image_url`` and
        ``video_url`` (a path, an http(s) URL or a data URI) when the model was loaded with vision.
        Thinking is on unless ``enable_thinking=False`` (or vLLM's ``chat_template_kwargs={"enable_thinking":
        False}``). Results as for :meth:`generate` (``max_new_tokens`` default 1024; the model's
        preset for the thinking mode under the keywords; ``on_delta`` as for :meth:`generate`).
        """
        conversations, single = parse_conversations(messages)
        thinking = thinking_mode(enable_thinking, chat_template_kwargs)
        schemas = tool_schemas(tools)
        prompts = [self._chat_prompt(c, tools, thinking) for c in conversations]
        if sampling_params is not None:
            keywords = {"max_new_tokens": max_new_tokens, "stop": stop, **sampling}
            params = self._params_per_prompt(sampling_params, len(prompts), keywords)
        else:
            params = [self._keyword_params("chat", max_new_tokens, thinking, {"stop": stop, **sampling})] * len(prompts)
        turn_start = self.tokenizer.token_id("<|im_start|>")
        outs = self._outputs([PromptInput(ids, text) for ids, _, text in prompts], params, thinking=thinking,
                             media=[mm for _, mm, _ in prompts], tools=schemas,
                             marks=[chat_checkpoint_marks(ids, turn_start) for ids, _, _ in prompts],
                             on_delta=on_delta)
        if sampling_params is not None:
            return outs
        completions = [out.outputs[0] for out in outs]
        return completions[0] if single else completions

    def count_tokens(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                     enable_thinking: bool = True) -> int:
        """Prompt tokens of a chat, media tokens included."""
        from ninfer.vision import collect_media, reject_media

        if collect_media(messages):
            if self.vision is None:
                reject_media(messages)
            return self.vision.count_tokens(messages, self.tokenizer, tools=tools, enable_thinking=enable_thinking)
        return len(self.tokenizer.encode(
            self.tokenizer.apply_chat_template(messages, tools=tools, enable_thinking=enable_thinking)))

    def _chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     enable_thinking: bool) -> tuple[list[int], Any, str | None]:
        """Prompt ids, multimodal inputs (None without media) and the rendered text (None with media)."""
        from ninfer.vision import MultimodalInputs, collect_media, reject_media

        if not collect_media(messages):
            text = self.tokenizer.apply_chat_template(messages, tools=tools, enable_thinking=enable_thinking)
            return self.tokenizer.encode(text), None, text
        if self.vision is None:
            reject_media(messages)
        prompt = self.vision.prompt_from_messages(messages, self.tokenizer, tools=tools,
                                                  enable_thinking=enable_thinking)
        return list(prompt.input_ids), MultimodalInputs(prompt, self.vision.encode(prompt)), None

    def stream(self, prompt: Any, max_new_tokens: int = 256, **sampling: Any) -> Iterator[str]:
        """Yield text deltas of one raw-prompt completion as they are produced (see :meth:`generate_async`
        for reasoning, tool calls, logprobs and usage)."""
        self._release_async()
        items, single = parse_prompts(prompt, self.tokenizer.encode, self.config.vocab_size)
        if not single:
            raise ValueError("stream() takes one prompt")
        params = self._keyword_params("generate", max_new_tokens, None, dict(sampling))
        req = self._requests(items[0].token_ids, params)[0]
        self.engine.add_request(req)
        try:
            while req.status != Status.FINISHED:
                for event in self.engine.step():
                    if event.request_id == req.request_id and event.text:
                        yield event.text
        finally:
            if req.status != Status.FINISHED:
                self.engine.cancel(req.request_id)

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int, params: EngineSamplingParams,
                     stop_token_ids: list[int] | None = None) -> Completion:
        return self._run([self._request(prompt_ids, max_new_tokens, params, stop_token_ids)])[0]

    # -- the async API ------------------------------------------------------------------------
    @property
    def async_llm(self) -> AsyncLLM:
        """This model's :class:`ninfer.AsyncLLM` (created on first use)."""
        if self._async is None:
            from ninfer.async_llm import AsyncLLM

            AsyncLLM(self)  # registers itself as self._async
        assert self._async is not None
        return self._async

    def generate_async(self, prompt: Any, sampling_params: SamplingParams | None = None, *,
                       request_id: str | None = None) -> AsyncIterator[StreamOutput]:
        """``async for out in llm.generate_async(prompt, params)``: see :meth:`ninfer.AsyncLLM.generate`."""
        return self.async_llm.generate(prompt, sampling_params, request_id=request_id)

    def chat_async(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None,
                   **kwargs: Any) -> AsyncIterator[StreamOutput]:
        """``async for out in llm.chat_async(messages, params)``: see :meth:`ninfer.AsyncLLM.chat`."""
        return self.async_llm.chat(messages, sampling_params, **kwargs)

    def _release_async(self) -> None:
        """The synchronous calls step the engine on this thread: stop the async API's engine thread first."""
        if self._async is not None:
            self._async.stop_if_idle()

    # -- requests -----------------------------------------------------------------------------
    def _request(self, prompt_ids: list[int], max_new_tokens: int, params: EngineSamplingParams,
                 stop_token_ids: Sequence[int] | None = None, stop: Sequence[str] | None = None,
                 thinking: bool | None = None, mm: Any = None) -> Request:
        if not prompt_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_stop_strings(stop or ())
        if params.thinking_budget is not None and thinking is None:
            raise ValueError("thinking_budget applies to chat replies (LLM.chat): a raw prompt has no reasoning "
                             "to limit")
        req = Request(prompt_ids=prompt_ids, params=params, max_new_tokens=max_new_tokens,
                      stop_token_ids=frozenset(stop_token_ids or ()), stop_strings=tuple(stop or ()),
                      thinking=thinking, mm=mm, rope_delta=mm.rope_delta if mm is not None else 0)
        if params.structured is not None:
            req.grammar = self.structured.state(params.structured, bool(thinking))
        return req

    def _requests(self, prompt_ids: list[int], params: SamplingParams, thinking: bool | None = None,
                  mm: Any = None, marks: tuple[int, ...] = ()) -> list[Request]:
        """The ``params.n`` requests of one prompt; sample ``i > 0`` draws from its own derived seed."""
        max_tokens = params.max_tokens if params.max_tokens is not None else self.engine.config.max_context
        reqs = []
        for i in range(params.n):
            sample = params if i == 0 else dataclasses.replace(params, seed=params.sample_seed(i))
            req = self._request(list(prompt_ids), max_tokens, sample, params.stop_token_ids, params.stop,
                                thinking=thinking, mm=mm)
            req.checkpoint_marks = marks
            reqs.append(req)
        return reqs

    def _outputs(self, items: list[PromptInput], params: list[SamplingParams], *, thinking: bool | None = None,
                 media: list[Any] | None = None, tools: dict[str, Any] | None = None,
                 marks: list[tuple[int, ...]] | None = None,
                 on_delta: Callable[[StreamOutput], None] | None = None) -> list[RequestOutput]:
        groups = [self._requests(item.token_ids, p, thinking, media[i] if media else None, marks[i] if marks else ())
                  for i, (item, p) in enumerate(zip(items, params))]
        leaders = {r.request_id: g[0] for g in groups for r in g[1:]}
        completions = iter(self._run([r for g in groups for r in g], tools=tools, leaders=leaders,
                                     on_delta=on_delta))
        outs = []
        for item, group in zip(items, groups):
            samples = [next(completions) for _ in group]
            for index, sample in enumerate(samples):
                sample.index = index
            outs.append(RequestOutput(group[0].request_id, item.text, list(item.token_ids), samples))
        return outs

    def _run(self, requests: list[Request], tools: dict[str, Any] | None = None,
             leaders: dict[str, Request] | None = None,
             on_delta: Callable[[StreamOutput], None] | None = None) -> list[Completion]:
        """Run requests to completion through the engine (queueing those beyond its lanes). A request with a
        leader (another sample of its prompt) waits until the leader has prefilled, so that it starts from
        the leader's prefix-cache checkpoint instead of prefilling the prompt again. If anything fails (or
        the caller interrupts), every request of the call is cancelled: the engine is left clean."""
        self._release_async()
        leaders = leaders if self.engine.prefix is not None else None
        results = {r.request_id: RequestResults(r, self.tokenizer, self.stop_ids_for(r), tools) for r in requests}
        pending, added = list(requests), []
        try:
            while pending or self.engine.has_work:
                self._submit_ready(pending, added, leaders or {})
                for event in self.engine.step():
                    result = results.get(event.request_id)
                    if result is not None:
                        delta = result.push(event)
                        if on_delta is not None:
                            on_delta(delta)
        except BaseException:
            for req in added:
                self.engine.cancel(req.request_id)
            raise
        return [results[r.request_id].completion() for r in requests]

    def _submit_ready(self, pending: list[Request], added: list[Request], leaders: dict[str, Request]) -> None:
        """Submit in order until the queue is full or a sample's leader has not prefilled yet (what follows
        waits too, so that the samples of one prompt run together while its checkpoint is fresh)."""
        while pending:
            lead = leaders.get(pending[0].request_id)
            if lead is not None and not (lead.output_ids or lead.status is Status.FINISHED or not self.engine.has_work):
                return
            try:
                self.engine.add_request(pending[0])
            except QueueFull:
                return
            added.append(pending.pop(0))

    # -- scoring ------------------------------------------------------------------------------
    def score(self, token_ids: list[int], context: int | None = None, stride: int | None = None) -> torch.Tensor:
        """Log-probability (fp32) of each token ``1..n-1`` given its prefix.

        Sequences longer than ``context`` are read in sliding windows that advance by ``stride``
        (default ``context // 2``); each window starts from an empty state and scores only tokens
        no earlier window scored, so every token after the first is scored exactly once.
        """
        return torch.cat([w.logprobs for w in self.score_windows(token_ids, context, stride)])

    def score_windows(self, token_ids: list[int], context: int | None = None,
                      stride: int | None = None) -> Iterator[ScoreWindow]:
        n = len(token_ids)
        if n < 2:
            raise ValueError(f"scoring needs at least 2 tokens, got {n}")
        context = n if context is None else context
        stride = max(1, context // 2) if stride is None else stride
        if context < 2:
            raise ValueError(f"context must be >= 2, got {context}")
        if not 1 <= stride <= context:
            raise ValueError(f"stride must be in [1, context={context}], got {stride}")
        scored_until, start = 1, 0
        while scored_until < n:
            end = min(start + context, n)
            self.runner.start(end - start)
            hidden = self.runner.extend(token_ids[start:end])
            targets = torch.tensor(token_ids[scored_until:end], device=self.device)
            rows = hidden[scored_until - 1 - start: end - 1 - start]
            logprobs = torch.cat([
                self.model.logits(rows[i:i + SCORE_SLICE]).float().log_softmax(-1)
                .gather(-1, targets[i:i + SCORE_SLICE, None])[:, 0]
                for i in range(0, rows.shape[0], SCORE_SLICE)
            ])
            yield ScoreWindow(start, end, scored_until, logprobs.cpu())
            scored_until, start = end, start + stride


def thinking_mode(enable_thinking: bool | None, chat_template_kwargs: dict[str, Any] | None) -> bool:
    """The chat's thinking switch from ``enable_thinking`` or vLLM's ``chat_template_kwargs``."""
    kwargs = dict(chat_template_kwargs or {})
    unknown = sorted(set(kwargs) - {"enable_thinking"})
    if unknown:
        raise ValueError(f"chat_template_kwargs: unsupported key(s) {unknown} (supported: 'enable_thinking')")
    templated = kwargs.get("enable_thinking")
    if templated is not None and not isinstance(templated, bool):
        raise TypeError(f"chat_template_kwargs['enable_thinking'] must be a bool, got {templated!r}")
    if enable_thinking is not None and templated is not None and enable_thinking != templated:
        raise ValueError("enable_thinking and chat_template_kwargs['enable_thinking'] disagree")
    for value in (enable_thinking, templated):
        if value is not None:
            return bool(value)
    return True


def _generation_defaults(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {k: raw[k] for k in ("temperature", "top_p", "top_k", "do_sample") if raw.get(k) is not None}
