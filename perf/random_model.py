"""Random-weight models at the real 27B / 35B-A3B shapes, for benchmarks (no checkpoint needed).

``random_model(shape, recipe=...)`` builds the text model one part at a time (embedding, each
decoder layer, final norm, LM head): the part gets device storage, random values, and, with a
recipe, is quantized in place right away by ``ninfer.quant.linear.quantize_model_`` (the function
``ninfer.load(..., quantize=...)`` calls) before the next part is allocated. Peak device memory is
the quantized model plus one bf16 layer, never a second full bf16 copy.

``random_vision_tower(shape)`` is the Qwen3.5 ViT of the 27B / 35B-A3B checkpoints (reference
§11.1: depth 27, width 1152, 16 heads, FFN 4304, patch 16, temporal patch 2, merge 2, 48x48
position grid) with random bf16 weights.

The ``tiny`` / ``tiny-moe`` shapes are for CPU smoke tests of the benchmark scripts only.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import ninfer
from ninfer.checkpoint import LoadReport, materialize
from ninfer.config import VisionConfig, parse_config
from ninfer.kernels.rope import rope_inv_freq
from ninfer.llm import LLM
from ninfer.models.qwen3_5 import Qwen3_5TextModel
from ninfer.runtime.engine import EngineConfig
from ninfer.tokenizer import Tokenizer

COMMON = dict(vocab_size=248320, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, eos_token_id=248044,
              max_position_embeddings=262144, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                               "mrope_section": [11, 11, 10], "mrope_interleaved": True})
# CPU smoke-test geometry: every K is a multiple of 64 so all shipped recipes apply.
TINY = dict(vocab_size=1024, head_dim=64, linear_num_key_heads=2, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, eos_token_id=900,
            max_position_embeddings=65536, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                             "mrope_section": [3, 3, 2], "mrope_interleaved": True})
SHAPES = {
    "27b": dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48, **COMMON),
    "35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                    num_key_value_heads=2, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512, **COMMON),
    "tiny": dict(model_type="qwen3_5_text", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, linear_num_value_heads=4, **TINY),
    "tiny-moe": dict(model_type="qwen3_5_moe_text", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=128, shared_expert_intermediate_size=128, **TINY),
}
# The ViT of Qwen3.5 9B and up (27B and 35B-A3B included); out_hidden_size is the text width.
VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, temporal_patch_size=2,
              spatial_merge_size=2, num_position_embeddings=2304, in_channels=3)
VISION_TINY = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16, temporal_patch_size=2,
                   spatial_merge_size=2, num_position_embeddings=256, in_channels=3)


def random_prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids of a prompt for a random model: ids under 448 (plain tokens of the bundled tiny
    tokenizer, which the random models use), the same for the same seed."""
    return torch.randint(0, 448, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def shape_config(shape: str, num_layers: int | None = None) -> dict:
    """The text config dict of ``shape`` (a copy), optionally with fewer layers."""
    raw = json.loads(json.dumps(SHAPES[shape]))
    if num_layers is not None:
        raw["num_hidden_layers"] = num_layers
    return raw


def vision_config(shape: str) -> VisionConfig:
    base = VISION_TINY if shape.startswith("tiny") else VISION
    return VisionConfig(out_hidden_size=SHAPES[shape]["hidden_size"], **base)


def _parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Top-level pieces in order, each decoder layer separately: ``embed_tokens``, ``layers.i``, ``norm``, ``lm_head``."""
    out = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            out += [(f"{name}.{i}", layer) for i, layer in enumerate(child)]
        else:
            out.append((name, child))
    return out


@torch.no_grad()
def _randomize(module: nn.Module, gen: torch.Generator) -> None:
    for name, p in module.named_parameters():
        if name.endswith("A_log"):
            p.uniform_(0.0, 2.7, generator=gen)
        elif name.endswith("dt_bias"):
            p.normal_(-3.0, 0.5, generator=gen)
        elif p.dim() == 1:
            p.normal_(0.0, 0.1, generator=gen)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)


def recipe_plan(model: nn.Module, recipe: str) -> dict[str, str]:
    """The weight -> format plan ``ninfer.load(..., quantize=recipe)`` would apply to ``model``."""
    from ninfer.quant.linear import recipe_plans
    from ninfer.quant.recipe import load_recipe

    return recipe_plans(load_recipe(recipe), model)[0]


@torch.no_grad()
def random_model(shape: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 num_layers: int | None = None, recipe: str | None = None,
                 verbose: bool = False) -> Qwen3_5TextModel:
    """A random model at ``shape``; with ``recipe`` (a name of ``recipes/`` or a path) quantized part by part."""
    from ninfer.quant.linear import quantize_model_

    config = parse_config(shape_config(shape, num_layers))
    with torch.device("meta"):
        model = Qwen3_5TextModel(config)
    plan = recipe_plan(model, recipe) if recipe else {}
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    start = time.perf_counter()
    for prefix, part in _parts(model):
        materialize(part, device, dtype)
        _randomize(part, gen)
        sub = {name: fmt for name, fmt in plan.items() if name == prefix or name.startswith(prefix + ".")}
        if sub:
            quantize_model_(model, sub, dtype=dtype)  # one weight at a time; the bf16 tensor is dropped
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"parameters left unmaterialised: {left[:5]}")
    model.register_buffer("inv_freq", rope_inv_freq(config.rotary_dim, config.rope_theta).to(device),
                          persistent=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    if verbose:
        mem = f", {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated, peak " \
              f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else ""
        print(f"random {shape} model ({recipe or 'bf16'}): {model_bytes(model) / 2**30:.2f} GiB of weights, "
              f"built in {time.perf_counter() - start:.1f} s{mem}", flush=True)
    return model.eval()


def model_bytes(model: nn.Module) -> int:
    """Resident bytes of every parameter and buffer (packed codes and scales of quantized weights included)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def random_llm(shape: str, engine: EngineConfig, *, model: Qwen3_5TextModel | None = None, mtp_head=None,
               full_vocab: bool = False, **kw) -> LLM:
    """An LLM over a random model (``model``, or a new one built with ``kw``), with the bundled tiny
    tokenizer (only its 481 ids are sampled, or with ``full_vocab`` all of the model's: the tokenizer decodes the
    others to nothing); ``mtp_head`` lets the engine speculate."""
    from ninfer.default_model import build_tokenizer, write_generation_config

    model = model if model is not None else random_model(shape, **kw)
    tmp = Path(tempfile.mkdtemp(prefix=f"ninfer-{shape}-"))
    build_tokenizer(tmp)
    write_generation_config(tmp)
    (tmp / "config.json").write_text(json.dumps(SHAPES[shape]))
    tokenizer = Tokenizer(tmp)
    if full_vocab:  # the engine's vocabulary limit (sampling, drafts, draft_vocab) is the smaller of the two
        tokenizer.vocab_size = model.config.vocab_size
    return LLM(model, tokenizer, tmp, LoadReport(), engine, mtp_head=mtp_head)


@torch.no_grad()
def random_vision_tower(shape: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 1):
    """The Qwen3.5 vision encoder of ``shape`` with random weights (LayerNorms near identity)."""
    from ninfer.vision import build_vision_tower

    tower = build_vision_tower(vision_config(shape), device, dtype)
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    for name, p in tower.named_parameters():
        if ".norm" in name:  # LayerNorms (blocks and merger)
            p.normal_(1.0 if name.endswith("weight") else 0.0, 0.05, generator=gen)
        elif p.dim() == 1:
            p.normal_(0.0, 0.02, generator=gen)
        else:
            p.normal_(0.0, p[0].numel() ** -0.5, generator=gen)
    return tower.eval()


__all__ = [
    "SHAPES",
    "VISION",
    "model_bytes",
    "ninfer",
    "random_llm",
    "random_model",
    "random_vision_tower",
    "recipe_plan",
    "shape_config",
    "vision_config",
]
