"""The public entry point: ``llm = ninfer.load(...)``, then ``generate``, ``chat`` and ``score``."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ninfer.checkpoint import LoadReport, load_weights, materialize, resolve_model_path
from ninfer.config import ModelConfig, load_config
from ninfer.models.qwen3_5 import Qwen3_5TextModel
from ninfer.runtime.sampling import SamplingParams, make_generator, sample_reference
from ninfer.runtime.sequence import SequenceRunner
from ninfer.tokenizer import Tokenizer, split_reasoning, stop_token_ids

SCORE_SLICE = 256  # rows of logits materialised at once while scoring (V is 248k wide)


@dataclass
class Completion:
    """One generated continuation."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (an end-of-sequence or stop token) or "length" (max_new_tokens)
    prompt_tokens: int
    reasoning: str | None = None
    ttft_s: float = 0.0
    decode_s: float = 0.0

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
    """A loaded Qwen3.5 checkpoint with its tokenizer."""

    def __init__(self, model: Qwen3_5TextModel, tokenizer: Tokenizer, model_dir: Path, report: LoadReport) -> None:
        self.model = model
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.load_report = report
        self.stop_ids = stop_token_ids(model_dir, tokenizer, self.config.eos_token_ids)
        self.valid_vocab = min(self.config.vocab_size, tokenizer.vocab_size)
        self.defaults = _generation_defaults(model_dir)
        self.runner = SequenceRunner(model)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def sampling_params(self, temperature: float | None = None, top_p: float | None = None,
                        top_k: int | None = None, seed: int | None = None, greedy: bool = False) -> SamplingParams:
        """Explicit arguments override the checkpoint's generation_config.json."""
        d = self.defaults
        return SamplingParams(
            temperature=d.get("temperature", 1.0) if temperature is None else temperature,
            top_p=d.get("top_p", 1.0) if top_p is None else top_p,
            top_k=d.get("top_k", 0) if top_k is None else top_k,
            greedy=greedy or not d.get("do_sample", True), seed=seed,
        )

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
    ) -> Completion | list[Completion]:
        """Continue raw prompt text (no chat template); a list of prompts gives a list of completions."""
        params = self.sampling_params(temperature, top_p, top_k, seed, greedy)
        prompts = [prompt_or_prompts] if isinstance(prompt_or_prompts, str) else list(prompt_or_prompts)
        results = [self.generate_ids(self.tokenizer.encode(p), max_new_tokens, params, stop_token_ids)
                   for p in prompts]
        return results[0] if isinstance(prompt_or_prompts, str) else results

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        enable_thinking: bool = True,
        max_new_tokens: int = 1024,
        **sampling: Any,
    ) -> Completion:
        """Apply the chat template, generate, and split the reasoning from the answer."""
        prompt = self.tokenizer.apply_chat_template(messages, tools=tools, enable_thinking=enable_thinking)
        params = self.sampling_params(**sampling)
        completion = self.generate_ids(self.tokenizer.encode(prompt), max_new_tokens, params)
        completion.reasoning, completion.text = split_reasoning(completion.text, enable_thinking)
        return completion

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                     stop_token_ids: list[int] | None = None) -> Completion:
        if not prompt_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        stops = self.stop_ids | set(stop_token_ids or ())
        generator = make_generator(params, self.device)
        start = time.perf_counter()
        self.runner.start(len(prompt_ids) + max_new_tokens)
        hidden = self.runner.extend(prompt_ids)[-1:]
        out: list[int] = []
        finish = "length"
        ttft = 0.0
        while True:
            logits = self.model.logits(hidden)[0, : self.valid_vocab]
            token = sample_reference(logits, params, generator)
            out.append(token)
            if len(out) == 1:
                ttft = time.perf_counter() - start
            if token in stops:
                finish = "stop"
                break
            if len(out) == max_new_tokens:
                break
            hidden = self.runner.extend([token])
        text_ids = out[:-1] if finish == "stop" else out
        return Completion(text=self.tokenizer.decode(text_ids), token_ids=out, finish_reason=finish,
                          prompt_tokens=len(prompt_ids), ttft_s=ttft,
                          decode_s=time.perf_counter() - start - ttft)

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
    progress: bool = True,
) -> LLM:
    """Load a Qwen3.5-family checkpoint (local directory or Hub id; the bundled default model if None).

    Defaults: CUDA when available else CPU; bf16 on GPU, fp32 on CPU.
    """
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
    materialize(model, device, dtype)
    report = load_weights(model, model_dir, device, dtype=dtype, tied_lm_head=config.tie_word_embeddings,
                          progress=progress)
    model.register_buffer("inv_freq", _inv_freq(config, device), persistent=False)
    return LLM(model.eval(), tokenizer, model_dir, report)


def _inv_freq(config: ModelConfig, device: torch.device) -> torch.Tensor:
    from ninfer.kernels.rope import rope_inv_freq

    return rope_inv_freq(config.rotary_dim, config.rope_theta).to(device)
