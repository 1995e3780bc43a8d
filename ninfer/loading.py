"""``ninfer.load(...)``: read a Qwen3.5-family checkpoint into an :class:`ninfer.llm.LLM`."""
from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ninfer.checkpoint import load_weights, materialize, resolve_model_path
from ninfer.config import ModelConfig, load_config
from ninfer.llm import LLM
from ninfer.models.qwen3_5 import Qwen3_5TextModel
from ninfer.runtime import startup
from ninfer.runtime.engine_config import EngineConfig
from ninfer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from ninfer.models.mtp import MTPHead


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load(
    path_or_hub_id: str | os.PathLike[str] | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    quantize: str | None = None,
    vision: bool = False,
    vision_limits: Any = None,
    chat_template: str | None = None,
    progress: bool = True,
    **options: Any,
) -> LLM:
    """Load a Qwen3.5-family checkpoint (local directory or Hub id; the bundled default model if None).

    Defaults: CUDA when available else CPU; bf16 on GPU, fp32 on CPU. ``options`` are the engine's
    (:class:`ninfer.runtime.engine_config.EngineConfig` defines each one, its default and its check;
    docs/python-api.md lists them): the engine serves up to ``max_concurrency`` (1-8, default 4)
    sequences of at most ``max_context`` tokens each (default 8192) from one KV pool of
    ``kv_capacity`` tokens (default ``max_concurrency * max_context``; ``"auto"`` fills free GPU
    memory); ``kv_dtype`` is "auto" (model dtype), "bf16", "fp8" or "int8"; KV pages hold
    ``page_size`` tokens; prompts prefill in chunks of up to ``prefill_chunk`` tokens while no sequence
    decodes, and of ``prefill_tokens_while_decoding`` while others do (it bounds their stall); decode steps
    replay CUDA graphs unless ``cuda_graphs=False``; on CUDA the engine compiles and autotunes its kernels
    at start-up unless ``warmup=False``. The prefix cache (on unless ``prefix_cache=False``)
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
    (``vision_limits``: a ``ninfer.vision.VisionLimits``). ``chat_template`` (Jinja text) replaces
    the tokenizer's chat template.

    ``spec="mtp"`` turns on speculative decoding with the checkpoint's MTP head: each step drafts
    ``draft_tokens`` (1-7, default 3; only with ``spec``) tokens and verifies them in one target pass;
    outputs are those of plain decoding (greedy: token for token; sampling: the same distribution).
    """
    engine_config = EngineConfig.from_options(options)  # before anything is read: a bad option fails fast
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
    startup.begin()  # each phase below times itself into the report printed when ready
    with startup.phase("tokenizer"):
        tokenizer = Tokenizer(model_dir)
        if chat_template is not None:
            tokenizer.set_chat_template(chat_template)
    with startup.phase("model build/quantize"):
        with torch.device("meta"):
            model = Qwen3_5TextModel(config)
        plan, mtp_plan, translate = _stored_quantization(model_dir)
        if plan:
            from ninfer.quant.linear import prepare_model_

            prepare_model_(model, plan, dtype=dtype)
        materialize(model, device, dtype)
    with startup.phase("weights read"):
        report = load_weights(model, model_dir, device, tied_lm_head=config.tie_word_embeddings,
                              progress=progress, translate=translate)
    if quantize is not None:
        if plan or mtp_plan:
            raise ValueError(f"quantize={quantize!r}: {model_dir} is already quantized; load it without quantize=")
        from ninfer.quant.linear import quantize_model_, recipe_plans
        from ninfer.quant.recipe import load_recipe

        with startup.phase("model build/quantize"):
            plan, mtp_plan = recipe_plans(load_recipe(quantize), model, _meta_head(model, engine_config))
            quantize_model_(model, plan, dtype=dtype)
    model.register_buffer("inv_freq", _inv_freq(config, device), persistent=False)
    mtp_head = None
    if engine_config.draft_tokens:
        from ninfer.models.mtp import MTPHead

        # A quantized checkpoint's head loads packed; with quantize= the recipe's mtp.* rules quantize it after.
        mtp_head = MTPHead.from_report(model, report.mtp, plan=None if quantize else mtp_plan)
        if quantize is not None:
            quantize_model_(mtp_head, mtp_plan, dtype=dtype)
        report.mtp = {}  # the head holds its weights now; the report's tensors would stay resident beside it
    elif report.mtp and device.type != "cpu":
        # No head is built here: its tensors wait in host memory (``MTPHead.from_report`` moves them back), so the
        # engine's memory plan does not lose 0.85 GB (27B) to 1.6 GB (35B-A3B) of the device to them.
        report.mtp = {name: tensor.cpu() for name, tensor in report.mtp.items()}
    pipeline = None
    if vision:
        from ninfer.vision import VisionPipeline

        if config.vision is None:
            raise ValueError(f"vision=True: {model_dir} has no vision_config (a text-only checkpoint)")
        with startup.phase("vision tower"):
            pipeline = VisionPipeline.from_checkpoint(model_dir, config, tokenizer.token_id, device, dtype,
                                                      vision_limits)
    with startup.phase("engine set-up"):  # KV pool, buffers, grammar compiler (graphs and warm-up: their own)
        llm = LLM(model.eval(), tokenizer, model_dir, report, engine_config, vision=pipeline, mtp_head=mtp_head)
    llm.startup = startup.finish(sys.stderr if progress else None)
    return llm


def _signature() -> inspect.Signature:
    """``load``'s signature with the engine options spelt out (``help(ninfer.load)``, IDEs)."""
    sig = inspect.signature(load)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(opt.name, inspect.Parameter.KEYWORD_ONLY, default=opt.default)
               for opt in EngineConfig.options()]
    return sig.replace(parameters=params)


load.__signature__ = _signature()  # type: ignore[attr-defined]


def _stored_quantization(model_dir: Path) -> tuple[dict[str, str], dict[str, str], Any]:
    """The weight -> format plans of an already-quantized checkpoint (text model, MTP head), and how to
    translate its tensors."""
    from ninfer.checkpoint import checkpoint_files
    from ninfer.quant.convert import manifest_plan, read_manifest
    from ninfer.quant.imports import scan_checkpoint

    manifest = read_manifest(model_dir)
    if manifest is not None:
        return manifest_plan(manifest, "text"), manifest_plan(manifest, "mtp"), None
    imported = scan_checkpoint(checkpoint_files(model_dir))
    return (imported.plan("text"), imported.plan("mtp"), imported.translate) if imported else ({}, {}, None)


def _meta_head(model: Qwen3_5TextModel, engine_config: EngineConfig) -> MTPHead | None:
    """The MTP head on the meta device (its weights' names and shapes) where the config describes one or the
    engine drafts with it, else None: a recipe then quantizes the head as ``ninfer convert`` does."""
    if not (model.config.mtp_num_hidden_layers or engine_config.draft_tokens):
        return None
    from ninfer.models.mtp import MTPHead

    with torch.device("meta"):
        return MTPHead(model.config, model)


def _inv_freq(config: ModelConfig, device: torch.device) -> torch.Tensor:
    from ninfer.kernels.rope import rope_inv_freq

    return rope_inv_freq(config.rotary_dim, config.rope_theta).to(device)
