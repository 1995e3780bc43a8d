"""The memory plan made at startup: how many KV pages fit, from sizes rather than trial allocation.

Order of claims on device memory: weights (already resident), DeltaNet state slots (one per lane),
a workspace estimate for the largest prefill chunk and the logits, plus the buffer that quantized
prefill GEMMs dequantize weights into (:mod:`ninfer.kernels.quant_gemm.dequant`, allocated on first use
and kept), a fixed headroom, then the KV pool takes what is left (``kv_capacity="auto"``) or exactly
what was asked for.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ninfer.config import ModelConfig
from ninfer.kernels.quant_gemm.dequant import workspace_bytes as dequant_bytes
from ninfer.quant.linear import QuantLinear
from ninfer.runtime.chunk_graphs import chunk_graph_tokens
from ninfer.runtime.draft_vocab import read_token_map
from ninfer.runtime.engine_config import EngineConfig

HEADROOM_BYTES = 1 << 30
KV_ELEMENT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.0, "int8": 1.0}


@dataclass(frozen=True)
class MemoryPlan:
    num_pages: int
    page_bytes: int
    slot_bytes: int
    workspace_bytes: int

    def describe(self, page_size: int) -> str:
        gib = 1 << 30
        return (f"KV pool {self.num_pages} pages x {page_size} tokens ({self.num_pages * self.page_bytes / gib:.2f} GiB), "
                f"state {self.slot_bytes / (1 << 20):.1f} MiB per slot, workspace ~{self.workspace_bytes / gib:.2f} GiB")


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str, model_dtype: torch.dtype, mtp: bool = False) -> float:
    """K and V of every full-attention layer (plus the MTP layer's when speculating)."""
    elem = KV_ELEMENT_BYTES.get(kv_dtype, torch.finfo(model_dtype).bits / 8)
    scale = {"fp8": 4 / cfg.head_dim, "int8": 4 / 64}.get(kv_dtype, 0.0)  # fp32 scales per row / per 64 values
    return (len(cfg.attention_layers) + int(mtp)) * 2 * cfg.num_key_value_heads * cfg.head_dim * (elem + scale)


def state_bytes_per_slot(cfg: ModelConfig, model_dtype: torch.dtype) -> int:
    conv = cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * (torch.finfo(model_dtype).bits // 8)
    recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return len(cfg.deltanet_layers) * (conv + recurrent)


def workspace_bytes(cfg: ModelConfig, engine: EngineConfig, model_dtype: torch.dtype) -> int:
    """A generous bound on activations of one prefill chunk plus the logits of a decode batch, and those of the
    prompt-chunk graph where the engine captures one (:func:`chunk_graph_tokens`): its memory pool holds them
    for good."""
    logits = (engine.max_concurrency * (engine.draft_tokens + 1) + 1) * cfg.vocab_size * 4 * 2
    return (_activation_bytes(cfg, engine.prefill_chunk + chunk_graph_tokens(engine), model_dtype) + logits
            + draft_head_bytes(cfg, engine, model_dtype))


def draft_head_bytes(cfg: ModelConfig, engine: EngineConfig, model_dtype: torch.dtype) -> int:
    """The drafts' LM head rows where a draft vocabulary narrows it (``runtime.draft_vocab``), in the model dtype."""
    source = engine.draft_vocab if engine.draft_tokens else None
    if source is None:
        return 0
    rows = source if isinstance(source, int) else len(set(read_token_map(source)))
    if rows >= cfg.vocab_size:  # the whole vocabulary: the drafts use the LM head itself
        return 0
    return rows * cfg.hidden_size * (torch.finfo(model_dtype).bits // 8)


def _activation_bytes(cfg: ModelConfig, tokens: int, model_dtype: torch.dtype) -> int:
    elem = torch.finfo(model_dtype).bits // 8
    widest = max(cfg.conv_dim + cfg.value_dim, 2 * cfg.num_attention_heads * cfg.head_dim,
                 2 * (cfg.intermediate_size or 0), cfg.num_experts_per_tok * 2 * cfg.moe_intermediate_size)
    return tokens * (widest + 4 * cfg.hidden_size) * max(elem, 4) * 4


def dequant_workspace_bytes(modules: Iterable[nn.Module | None], model_dtype: torch.dtype) -> int:
    """The dequantization buffer of quantized prefill GEMMs: the largest ``QuantLinear`` weight that the
    tuner may send down that path (``kernels.quant_gemm.dequant``; not the LM head), in the activation dtype.
    0 without quantized linear layers."""
    layers = [m for root in modules if root is not None for m in root.modules()]
    shapes = [m.shape for m in layers if isinstance(m, QuantLinear)]
    return dequant_bytes(shapes, model_dtype)


def plan_memory(cfg: ModelConfig, engine: EngineConfig, device: torch.device, model_dtype: torch.dtype,
                dequant_bytes: int = 0) -> MemoryPlan:
    """``dequant_bytes``: :func:`dequant_workspace_bytes` of the model (part of the workspace)."""
    per_token = kv_bytes_per_token(cfg, engine.kv_dtype, model_dtype, mtp=engine.draft_tokens > 0)
    page_bytes = max(1, int(per_token * engine.page_size))
    slot_bytes = state_bytes_per_slot(cfg, model_dtype)
    workspace = workspace_bytes(cfg, engine, model_dtype) + dequant_bytes
    capacity = engine.kv_capacity
    if capacity is None:
        tokens = engine.max_concurrency * engine.max_context
    elif capacity == "auto":
        if device.type != "cuda":
            raise ValueError("kv_capacity='auto' sizes the pool from free GPU memory; give a token count on CPU")
        # Blocks torch's allocator caches but no tensor uses (loading and quantizing leave
        # some) are usable for the pool but not "free" to the driver until released.
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        budget = free - HEADROOM_BYTES - engine.num_state_slots * slot_bytes - workspace
        if budget < page_bytes:
            raise ValueError(f"no GPU memory left for the KV pool: {free / (1 << 30):.2f} GiB free before it")
        tokens = (budget // page_bytes) * engine.page_size
    elif isinstance(capacity, int) and capacity > 0:
        tokens = capacity
    else:
        raise ValueError(f"kv_capacity must be a positive token count, 'auto' or None, got {capacity!r}")
    return MemoryPlan(num_pages=-(-tokens // engine.page_size), page_bytes=page_bytes, slot_bytes=slot_bytes,
                      workspace_bytes=workspace)
