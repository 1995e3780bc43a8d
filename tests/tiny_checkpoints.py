"""Tiny random Qwen3.5 checkpoints for tests, written with transformers' own classes.

Each ``make_*`` function writes a checkpoint directory (safetensors + config.json +
generation_config.json + the tiny tokenizer of ``ninfer.default_model``) and returns a
``TinyCheckpoint`` whose ``hf_model`` is the fp32 transformers model holding exactly the stored
values, in eval mode: the oracle for parity tests.

Choices:
* Every parameter is randomised with ``ninfer.default_model.randomize_`` (norm offsets, ``A_log``,
  ``dt_bias``, router and shared-expert gate included), so a missing ``1 + w`` or a wrong GDN gate
  shows up as a numeric difference.
* Attention implementation of the oracle: ``"eager"`` (plain matmul + fp32 softmax; the most
  transparent reference, and identical on every CPU). The GDN layers use transformers' torch
  functions even where ``fla`` or ``causal-conv1d`` is installed (``_torch_oracle``).
* Storage dtype is fp32 by default so parity can be exact; pass ``dtype=torch.bfloat16`` to store
  bf16 like a real checkpoint (the oracle then holds the bf16-rounded values, still in fp32).
* transformers 5.24 ``save_pretrained`` writes MoE experts per expert
  (``mlp.experts.{e}.{gate,up,down}_proj.weight``) for both the text-only and the composite
  classes; the fused layout of official checkpoints (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
  gate rows first, ``mlp.experts.down_proj`` ``[E, H, I]``) is produced by rewriting the file.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

from ninfer.default_model import (
    append_tensors,
    build_tokenizer,
    random_mtp_tensors,
    randomize_,
    special_token_ids,
    write_generation_config,
)

ExpertLayout = Literal["per_expert", "fused"]
ATTN_IMPLEMENTATION = "eager"
DEFAULT_LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
IDS = special_token_ids()


@dataclass
class TinyCheckpoint:
    """A checkpoint directory plus its transformers oracle and tokenizer."""

    path: Path
    hf_model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase

    @property
    def config(self) -> dict[str, Any]:
        """The checkpoint's ``config.json`` as a dict."""
        return json.loads((self.path / "config.json").read_text())


def text_config_kwargs(*, head_dim: int = 16, layer_types: list[str] | None = None,
                       tie_word_embeddings: bool = False, mrope: bool = False) -> dict[str, Any]:
    """Reference §3.3 tiny text geometry (vocab 512, H 64, I 128, 4 layers, 4/2 heads)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    if mrope:  # sections must sum to rotary_dim/2 = head_dim * 0.25 / 2
        rope.update(mrope_section=[2, 1, 1], mrope_interleaved=True)
    layer_types = list(layer_types or DEFAULT_LAYER_TYPES)
    return dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
        layer_types=layer_types, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings, rope_parameters=rope,
        eos_token_id=IDS["<|endoftext|>"],
    )


# Few layers and a small hidden size, but the real head geometry the GPU kernels are built for: attention head
# dim 256 with 6 query heads per KV head, DeltaNet dk = dv = 128 with 3 value heads per key head (27B's ratios).
REAL_HEADS = dict(hidden_size=256, intermediate_size=512, head_dim=256, num_attention_heads=6,
                  num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=6,
                  linear_key_head_dim=128, linear_value_head_dim=128)
MOE_KWARGS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32)
VISION_KWARGS = dict(depth=2, hidden_size=32, num_heads=2, patch_size=16, temporal_patch_size=2,
                     spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=256,
                     intermediate_size=64)


ORACLE_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                    "causal_conv1d_update")


def _torch_oracle() -> None:
    """Point transformers' Qwen3.5 modules back at their own PyTorch Gated DeltaNet and conv functions.
    Where flash-linear-attention is installed (the GPU host, which carries it for the benchmarks),
    transformers binds these names to fla's Triton kernels at import, whatever the tensors' device,
    so the CPU oracle would fail ("cannot be accessed from Triton (cpu tensor?)") or stop being the
    plain reference. The decorators keep the torch function as ``__wrapped__``."""
    for name in ("qwen3_5", "qwen3_5_moe"):
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        for fn_name in ORACLE_FUNCTIONS:
            fn = getattr(module, fn_name, None)
            if callable(fn):
                setattr(module, fn_name, inspect.unwrap(fn))


def _build(model_cls: type[PreTrainedModel], config: Any, seed: int, dtype: torch.dtype) -> PreTrainedModel:
    _torch_oracle()
    config._attn_implementation = ATTN_IMPLEMENTATION
    for sub in ("text_config", "vision_config"):
        if hasattr(config, sub):
            getattr(config, sub)._attn_implementation = ATTN_IMPLEMENTATION
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_(model, seed)
    if dtype != torch.float32:  # the oracle must hold exactly what the file stores
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype).float())
    return model


def _save(model: PreTrainedModel, out: Path, dtype: torch.dtype, shard_size: str | None = None) -> None:
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.to(dtype).save_pretrained(str(out), **kwargs)
    model.float()
    write_generation_config(out)
    build_tokenizer(out)


def _finish(out: Path, model: PreTrainedModel) -> TinyCheckpoint:
    return TinyCheckpoint(path=out, hf_model=model, tokenizer=AutoTokenizer.from_pretrained(str(out)))


def make_dense(dir: Path, *, layer_types: list[str] | None = None, tie_word_embeddings: bool = False,
               shard_size: str | None = None, seed: int = 0,
               dtype: torch.dtype = torch.float32, overrides: dict[str, Any] | None = None) -> TinyCheckpoint:
    """Dense text-only ``Qwen3_5ForCausalLM`` (``model.*`` keys); ``shard_size`` e.g. "50KB".

    ``overrides`` replaces geometry keys (e.g. the real head dims for GPU kernel tests).
    """
    out = Path(dir)
    config = Qwen3_5TextConfig(**{**text_config_kwargs(layer_types=layer_types,
                                                        tie_word_embeddings=tie_word_embeddings),
                                  **(overrides or {})})
    model = _build(Qwen3_5ForCausalLM, config, seed, dtype)
    _save(model, out, dtype, shard_size)
    return _finish(out, model)


def make_moe(dir: Path, *, expert_layout: ExpertLayout = "per_expert",
             layer_types: list[str] | None = None, seed: int = 0,
             dtype: torch.dtype = torch.float32, overrides: dict[str, Any] | None = None) -> TinyCheckpoint:
    """MoE text-only ``Qwen3_5MoeForCausalLM`` (8 experts, top-2) in the chosen expert layout."""
    out = Path(dir)
    config = Qwen3_5MoeTextConfig(**{**text_config_kwargs(layer_types=layer_types), **MOE_KWARGS,
                                     **(overrides or {})})
    model = _build(Qwen3_5MoeForCausalLM, config, seed, dtype)
    _save(model, out, dtype)
    rewrite_expert_layout(out, expert_layout)
    return _finish(out, model)


def make_composite(dir: Path, *, moe: bool = False, seed: int = 0,
                   expert_layout: ExpertLayout = "fused", with_mtp: bool = True,
                   dtype: torch.dtype = torch.float32, overrides: dict | None = None) -> TinyCheckpoint:
    """Composite ``Qwen3_5(Moe)ForConditionalGeneration`` in the official layout.

    Keys are ``model.language_model.*``, ``model.visual.*``, ``lm_head.weight`` and (unless
    ``with_mtp=False``) random ``mtp.*`` tensors that transformers ignores. MoE main layers are
    fused by default, like official checkpoints; the MTP layer's experts stay per-expert.
    """
    out = Path(dir)
    text = text_config_kwargs(head_dim=32, mrope=True)
    if moe:
        text.update(MOE_KWARGS)
    text.update(overrides or {})
    config_cls = Qwen3_5MoeConfig if moe else Qwen3_5Config
    config = config_cls(
        text_config=text, vision_config=dict(VISION_KWARGS),
        image_token_id=IDS["<|image_pad|>"], video_token_id=IDS["<|video_pad|>"],
        vision_start_token_id=IDS["<|vision_start|>"], vision_end_token_id=IDS["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model_cls = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    model = _build(model_cls, config, seed, dtype)
    _save(model, out, dtype)
    if moe:
        rewrite_expert_layout(out, expert_layout)
    if with_mtp:
        append_tensors(out / "model.safetensors",
                       random_mtp_tensors(config.text_config, seed=seed + 1, dtype=dtype))
    return _finish(out, model)


def planned_weight(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, slice]:
    """The quantized module holding weight ``name`` (checkpoint naming) of a loaded model, and the rows of it that
    the weight fills (all of them, or its part of a fused projection)."""
    from ninfer.checkpoint import fused_parts

    where = fused_parts(model).get(name)
    if where is None:
        return model.get_submodule(name), slice(None)
    return model.get_submodule(where.module), slice(where.start, where.stop)


# ---------------------------------------------------------------- expert layout conversion

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def convert_expert_layout(tensors: dict[str, torch.Tensor], layout: ExpertLayout,
                          skip_prefix: str = "mtp.") -> dict[str, torch.Tensor]:
    """Return ``tensors`` with routed-expert weights in ``layout`` (keys under ``skip_prefix`` kept).

    per-expert: ``experts.{e}.gate_proj/up_proj.weight [I, H]``, ``experts.{e}.down_proj.weight [H, I]``;
    fused: ``experts.gate_up_proj [E, 2I, H]`` (gate rows first), ``experts.down_proj [E, H, I]``.
    """
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[Any, torch.Tensor]] = {}
    for key, t in tensors.items():
        m_per, m_fused = _PER_EXPERT.match(key), _FUSED.match(key)
        if key.startswith(skip_prefix) or not (m_per or m_fused):
            out[key] = t
        elif m_per:
            groups.setdefault(m_per.group(1), {})[(int(m_per.group(2)), m_per.group(3))] = t
        else:
            groups.setdefault(m_fused.group(1), {})[m_fused.group(2)] = t
    for prefix, g in groups.items():
        if "gate_up_proj" in g:  # currently fused
            gate_up, down = g["gate_up_proj"], g["down_proj"]
            if layout == "fused":
                out[f"{prefix}.gate_up_proj"], out[f"{prefix}.down_proj"] = gate_up, down
                continue
            inter = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :inter].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, inter:].contiguous()
                out[f"{prefix}.{e}.down_proj.weight"] = down[e].contiguous()
        else:  # currently per-expert
            n = 1 + max(e for e, _ in g)
            if layout == "per_expert":
                out.update({f"{prefix}.{e}.{w}.weight": t for (e, w), t in g.items()})
                continue
            out[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat([g[(e, "gate_proj")], g[(e, "up_proj")]], dim=0) for e in range(n)])
            out[f"{prefix}.down_proj"] = torch.stack([g[(e, "down_proj")] for e in range(n)])
    return out


def rewrite_expert_layout(ckpt_dir: Path, layout: ExpertLayout) -> None:
    """Rewrite a single-file checkpoint's routed experts into ``layout`` (no-op if already so)."""
    path = Path(ckpt_dir) / "model.safetensors"
    if not path.exists():
        raise ValueError("expert layout rewriting supports single-file checkpoints only")
    tensors = load_file(str(path))
    converted = convert_expert_layout(tensors, layout)
    if converted.keys() != tensors.keys():
        save_file(converted, str(path), metadata={"format": "pt"})


def expert_layout_of(ckpt_dir: Path) -> set[str]:
    """Which routed-expert layouts a single-file checkpoint uses (MTP keys ignored)."""
    from safetensors import safe_open

    layouts = set()
    with safe_open(str(Path(ckpt_dir) / "model.safetensors"), "pt") as f:
        for key in f.keys():
            if key.startswith("mtp."):
                continue
            if _PER_EXPERT.match(key):
                layouts.add("per_expert")
            elif _FUSED.match(key):
                layouts.add("fused")
    return layouts
