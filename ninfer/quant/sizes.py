"""Weight bytes of a text model under a recipe, computed from shapes alone (no weights needed).

``disk``: what a converted checkpoint stores (quantized tensors, bf16 casts, other tensors at their
source dtype, taken as bf16 here). ``resident``: what the loaded model holds on the GPU (quantized
tensors as stored, float tensors in bf16, A_log and dt_bias in fp32). Vision and MTP weights are
not counted (they are optional components).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ninfer.checkpoint import FP32_PARAMS
from ninfer.config import parse_config
from ninfer.quant.formats import get_format
from ninfer.quant.linear import weight_shapes
from ninfer.quant.recipe import Recipe, resolve_plan

# Reference geometries (reference §3.1) as text-only config.json contents.
REFERENCE_CONFIGS: dict[str, dict[str, Any]] = {
    "27B": {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
            "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
            "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "tie_word_embeddings": False},
    "35B-A3B": {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
                "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512, "tie_word_embeddings": False},
}


@dataclass(frozen=True)
class WeightBytes:
    params: int
    disk: int
    resident: int
    quantized_params: int


def text_weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Weight names (recipe naming) and shapes of the text model a config.json describes."""
    from ninfer.models.qwen3_5 import Qwen3_5TextModel

    with torch.device("meta"):
        model = Qwen3_5TextModel(parse_config(config))
    return weight_shapes(model)


def recipe_bytes(recipe: Recipe, shapes: dict[str, tuple[int, ...]]) -> WeightBytes:
    plan = resolve_plan(recipe, shapes)
    params = disk = resident = quantized = 0
    for name, shape in shapes.items():
        numel = 1
        for d in shape:
            numel *= d
        params += numel
        fmt = plan.get(name, "bf16")
        if fmt == "bf16":
            disk += 2 * numel
            resident += (4 if FP32_PARAMS.search("." + name) else 2) * numel
        else:
            nbytes = get_format(fmt).nbytes(shape)
            disk += nbytes
            resident += nbytes
            quantized += numel
    return WeightBytes(params, disk, resident, quantized)
