"""The public entry point: ``llm = ninfer.load(...)``, then ``generate``, ``chat`` and ``score``."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ninfer.checkpoint import LoadReport, load_weights, materialize, resolve_model_path
from ninfer.config import ModelConfig, load_config
from ninfer.models.qwen3_5 import Qwen3_5TextModel
from ninfer.runtime.engine import Engine, EngineConfig
from ninfer.runtime.output import OutputProcessor
from ninfer.runtime.prefix_cache import chat_checkpoint_marks
from ninfer.runtime.request import Request, Status
from ninfer.runtime.sampling import PRESETS, SamplingParams, preset_key
from ninfer.runtime.scheduler import QueueFull
from ninfer.runtime.sequence import SequenceRunner
from ninfer.runtime.structured import Constraint, StructuredCompiler
from ninfer.tokenizer import Tokenizer, stop_token_ids

SCORE_SLICE = 256  # rows of logits materialised at once while scoring (V is 248k wide)


@dataclass
class Completion:
    """One generated continuation (``text`` is the answer; ``reasoning`` the thinking of a chat reply)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (an end-of-sequence or stop token) or "length" (max_new_tokens)
    prompt_tokens: int
    reasoning: str | None = None
    ttft_s: float = 0.0
    decode_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    speculation: dict[str, Any] | None = None  # with spec="mtp": rounds, drafted, accepted, acceptance

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.token_ids) - 1
        return steps / self.decode_s if self.decode_s > 0 and steps > 0 else 0.0


@dataclass(frozen=True)
class ScoreWindow:
    """One sliding window of :meth:`LLM.score`: tokens ``[start, end)`` read, ``[first_target, end)`` scored."""

    start: int
    end: int
    first_target: int
    logprobs: torch.Tensor


class LLM:
    """A loaded Qwen3.5 checkpoint with its tokenizer and its batching engine."""

    def __init__(self, model: Qwen3_5TextModel, tokenizer: Tokenizer, model_dir: Path, report: LoadReport,
                 engine_config: EngineConfig, vision: Any = None, mtp_head: Any = None) -> None:
        self.model = model
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.load_report = report
        self.stop_ids = frozenset(stop_token_ids(model_dir, tokenizer, self.config.eos_token_ids))
        self.valid_vocab = min(self.config.vocab_size, tokenizer.vocab_size)
        self.defaults = _generation_defaults(model_dir)
        self.engine = Engine(model, lambda req: OutputProcessor(req, tokenizer, self.stop_ids), engine_config,
                             vocab_limit=self.valid_vocab, mtp_head=mtp_head)
        self.runner = SequenceRunner(model, kv_dtype=engine_config.kv_dtype)  # scoring runs outside the engine's pool
        self.vision = vision  # a ninfer.vision.VisionPipeline when loaded with vision=True
        # Structured output (SamplingParams.structured): grammars over the model's padded vocabulary.
        self.structured = StructuredCompiler(tokenizer.hf, self.config.vocab_size, sorted(self.stop_ids),
                                             tokenizer.token_id("</think>"))

    @property
    def device(self) -> torch.device:
        return self.model.device

    def sampling_params(self, temperature: float | None = None, top_p: float | None = None,
                        top_k: int | None = None, seed: int | None = None, greedy: bool = False,
                        thinking: bool | None = None, **extra: Any) -> SamplingParams:
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
        return SamplingParams(greedy=greedy or not self.defaults.get("do_sample", True), seed=seed, **values)

    def generate(
        self,
        prompt_or_prompts: str | list[str],
        max_new_tokens: int = 256,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        greedy: bool = False,
        stop_token_ids: list[int] | None = None,
        stop: list[str] | None = None,
        structured: Constraint | None = None,
    ) -> Completion | list[Completion]:
        """Continue raw prompt text (no chat template); a list of prompts runs concurrently and gives a list.
        ``structured``: a :class:`~ninfer.runtime.structured.Constraint` every completion must match."""
        params = self.sampling_params(temperature, top_p, top_k, seed, greedy, structured=structured)
        prompts = [prompt_or_prompts] if isinstance(prompt_or_prompts, str) else list(prompt_or_prompts)
        requests = [self._request(self.tokenizer.encode(p), max_new_tokens, params, stop_token_ids, stop)
                    for p in prompts]
        results = self._run(requests)
        return results[0] if isinstance(prompt_or_prompts, str) else results

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        enable_thinking: bool = True,
        max_new_tokens: int = 1024,
        stop: list[str] | None = None,
        **sampling: Any,
    ) -> Completion:
        """Apply the chat template, generate, and split the reasoning from the answer.

        Message content may be a string or OpenAI-style parts: ``text``, ``image_url`` and
        ``video_url`` (a path, an http(s) URL or a data URI) when the model was loaded with vision.
        """
        prompt_ids, mm = self._chat_prompt(messages, tools, enable_thinking)
        params = self.sampling_params(thinking=enable_thinking, **sampling)
        req = self._request(prompt_ids, max_new_tokens, params, None, stop,
                            thinking=enable_thinking, mm=mm)
        req.checkpoint_marks = chat_checkpoint_marks(prompt_ids, self.tokenizer.token_id("<|im_start|>"))
        return self._run([req])[0]

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
                     enable_thinking: bool) -> tuple[list[int], Any]:
        from ninfer.vision import MultimodalInputs, collect_media, reject_media

        if not collect_media(messages):
            text = self.tokenizer.apply_chat_template(messages, tools=tools, enable_thinking=enable_thinking)
            return self.tokenizer.encode(text), None
        if self.vision is None:
            reject_media(messages)
        prompt = self.vision.prompt_from_messages(messages, self.tokenizer, tools=tools,
                                                  enable_thinking=enable_thinking)
        return list(prompt.input_ids), MultimodalInputs(prompt, self.vision.encode(prompt))

    def stream(self, prompt: str, max_new_tokens: int = 256, **sampling: Any) -> Iterator[str]:
        """Yield text deltas of one raw-prompt completion as they are produced."""
        req = self._request(self.tokenizer.encode(prompt), max_new_tokens, self.sampling_params(**sampling))
        self.engine.add_request(req)
        try:
            while req.status != Status.FINISHED:
                for event in self.engine.step():
                    if event.request_id == req.request_id and event.text:
                        yield event.text
        finally:
            if req.status != Status.FINISHED:
                self.engine.cancel(req.request_id)

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                     stop_token_ids: list[int] | None = None) -> Completion:
        return self._run([self._request(prompt_ids, max_new_tokens, params, stop_token_ids)])[0]

    def _request(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                 stop_token_ids: list[int] | None = None, stop: list[str] | None = None,
                 thinking: bool | None = None, mm: Any = None) -> Request:
        if not prompt_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        req = Request(prompt_ids=prompt_ids, params=params, max_new_tokens=max_new_tokens,
                      stop_token_ids=frozenset(stop_token_ids or ()), stop_strings=tuple(stop or ()),
                      thinking=thinking, mm=mm, rope_delta=mm.rope_delta if mm is not None else 0)
        if params.structured is not None:
            req.grammar = self.structured.state(params.structured, bool(thinking))
        return req

    def _run(self, requests: list[Request]) -> list[Completion]:
        """Run requests to completion through the engine (queueing those beyond its lanes)."""
        pending = list(requests)
        texts = {r.request_id: ["", ""] for r in requests}
        while pending or self.engine.has_work:
            while pending:
                try:
                    self.engine.add_request(pending[0])
                except QueueFull:
                    break
                pending.pop(0)
            for event in self.engine.step():
                texts[event.request_id][0] += event.text
                texts[event.request_id][1] += event.reasoning
        return [_completion(r, *texts[r.request_id]) for r in requests]

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


def _completion(req: Request, text: str, reasoning: str) -> Completion:
    ttft = (req.first_token_time or req.arrival) - req.arrival
    decode = (req.finish_time or req.arrival) - (req.first_token_time or req.arrival)
    return Completion(text=text, token_ids=list(req.output_ids), finish_reason=req.finish_reason or "error",
                      prompt_tokens=len(req.prompt_ids), reasoning=reasoning if req.thinking else None,
                      ttft_s=ttft, decode_s=decode, cached_tokens=req.cached_tokens,
                      speculation=req.spec_stats.as_dict() if req.spec_stats is not None else None)


def _generation_defaults(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {k: raw[k] for k in ("temperature", "top_p", "top_k", "do_sample") if raw.get(k) is not None}


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load(
    path_or_hub_id: str | os.PathLike[str] | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    max_concurrency: int = 4,
    max_context: int = 4096,
    kv_capacity: int | str | None = None,
    kv_dtype: str = "auto",
    prefill_chunk: int = 1024,
    page_size: int = 64,
    cuda_graphs: bool = True,
    prefix_cache: bool = True,
    checkpoint_slots: int = 4,
    checkpoint_interval: int = 4096,
    host_cache_gib: float = 0.0,
    pause_host_gib: float = 4.0,
    host_prepin_gib: float = 0.0,
    quantize: str | None = None,
    vision: bool = False,
    vision_limits: Any = None,
    spec: str | None = None,
    draft_tokens: int = 3,
    progress: bool = True,
) -> LLM:
    """Load a Qwen3.5-family checkpoint (local directory or Hub id; the bundled default model if None).

    Defaults: CUDA when available else CPU; bf16 on GPU, fp32 on CPU. The engine serves up to
    ``max_concurrency`` (1-8) sequences of at most ``max_context`` tokens each from one KV pool of
    ``kv_capacity`` tokens (default ``max_concurrency * max_context``; ``"auto"`` fills free GPU
    memory); ``kv_dtype`` is "auto" (model dtype), "bf16", "fp8" or "int8"; KV pages hold
    ``page_size`` tokens; prompts prefill in chunks of ``prefill_chunk`` tokens; decode steps replay
    CUDA graphs unless ``cuda_graphs=False``. The prefix cache (on unless ``prefix_cache=False``)
    reuses the KV pages and DeltaNet state of earlier prompts: checkpoints sit in
    ``checkpoint_slots`` extra state slots, one token before each prompt's end (or at a chat's
    assistant turn just before it), every
    ``checkpoint_interval`` prompt tokens, and at the end of each generation; evicted checkpoints
    move to ``host_cache_gib`` of pinned host memory and are copied back on a hit. Admission reserves
    KV pages for the prompt and a small margin; when growing sequences exhaust the pool the newest
    request is paused: its state and KV are snapshotted to at most ``pause_host_gib`` of pinned host
    memory (beyond that it is recomputed from its tokens) and it resumes when memory frees up.
    Host copies reuse blocks of pinned memory; ``host_prepin_gib`` of them are pinned while loading,
    since pinning fresh memory runs at ~1 GB/s and would otherwise slow the first copies.

    Quantized checkpoints (written by ``ninfer convert``, or NVFP4 / FP8 checkpoints in the ModelOpt
    and compressed-tensors layouts) load as they are; ``quantize="int4"`` (a recipe name or file, see
    ``ninfer convert --list-recipes``) quantizes a bf16 checkpoint while loading. ``vision=True``
    loads the vision tower of a composite checkpoint so chats may hold images and videos
    (``vision_limits``: a ``ninfer.vision.VisionLimits``).

    ``spec="mtp"`` turns on speculative decoding with the checkpoint's MTP head: each step drafts
    ``draft_tokens`` (1-7) tokens and verifies them in one target pass; outputs are those of
    plain decoding (greedy: token for token; sampling: the same distribution).
    """
    if spec not in (None, "mtp"):
        raise ValueError(f"spec must be None or 'mtp', got {spec!r}")
    if path_or_hub_id is None:
        from ninfer.default_model import default_model_path

        path_or_hub_id = default_model_path()
    model_dir = resolve_model_path(path_or_hub_id)
    config = load_config(model_dir)
    device = torch.device(device) if device is not None else _default_device()
    if isinstance(dtype, str):
        dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                 "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}[dtype]
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    tokenizer = Tokenizer(model_dir)
    with torch.device("meta"):
        model = Qwen3_5TextModel(config)
    plan, translate = _stored_quantization(model_dir)
    if plan:
        from ninfer.quant.linear import prepare_model_

        prepare_model_(model, plan, dtype=dtype)
    materialize(model, device, dtype)
    report = load_weights(model, model_dir, device, dtype=dtype, tied_lm_head=config.tie_word_embeddings,
                          progress=progress, translate=translate)
    if quantize is not None:
        if plan:
            raise ValueError(f"quantize={quantize!r}: {model_dir} is already quantized; load it without quantize=")
        from ninfer.quant.linear import quantize_model_, weight_shapes
        from ninfer.quant.recipe import load_recipe, resolve_plan

        quantize_model_(model, resolve_plan(load_recipe(quantize), weight_shapes(model)), dtype=dtype)
    model.register_buffer("inv_freq", _inv_freq(config, device), persistent=False)
    engine_config = EngineConfig(max_concurrency=max_concurrency, max_context=max_context, kv_capacity=kv_capacity,
                                 kv_dtype=kv_dtype, prefill_chunk=prefill_chunk, page_size=page_size,
                                 cuda_graphs=cuda_graphs, prefix_cache=prefix_cache, checkpoint_slots=checkpoint_slots,
                                 checkpoint_interval=checkpoint_interval,
                                 host_cache_bytes=int(host_cache_gib * (1 << 30)),
                                 draft_tokens=draft_tokens if spec else 0,
                                 pause_host_bytes=int(pause_host_gib * (1 << 30)),
                                 host_prepin_bytes=int(host_prepin_gib * (1 << 30)))
    mtp_head = None
    if spec == "mtp":
        from ninfer.models.mtp import MTPHead

        mtp_head = MTPHead.from_report(model, report.mtp)
    pipeline = None
    if vision:
        from ninfer.vision import VisionPipeline

        if config.vision is None:
            raise ValueError(f"vision=True: {model_dir} has no vision_config (a text-only checkpoint)")
        pipeline = VisionPipeline.from_checkpoint(model_dir, config, tokenizer.token_id, device, dtype, vision_limits)
    return LLM(model.eval(), tokenizer, model_dir, report, engine_config, vision=pipeline, mtp_head=mtp_head)


def _stored_quantization(model_dir: Path) -> tuple[dict[str, str], Any]:
    """The weight -> format plan of an already-quantized checkpoint, and how to translate its tensors."""
    from ninfer.checkpoint import checkpoint_files
    from ninfer.quant.convert import manifest_plan, read_manifest
    from ninfer.quant.imports import scan_checkpoint

    manifest = read_manifest(model_dir)
    if manifest is not None:
        return manifest_plan(manifest, "text"), None
    imported = scan_checkpoint(checkpoint_files(model_dir))
    return (imported.plan("text"), imported.translate) if imported else ({}, None)


def _inv_freq(config: ModelConfig, device: torch.device) -> torch.Tensor:
    from ninfer.kernels.rope import rope_inv_freq

    return rope_inv_freq(config.rotary_dim, config.rope_theta).to(device)
