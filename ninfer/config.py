"""Model configuration read from a Hugging Face ``config.json`` (reference §2).

Both checkpoint forms are accepted: composite (``qwen3_5`` / ``qwen3_5_moe`` with ``text_config``
and ``vision_config``) and text-only (``qwen3_5_text`` / ``qwen3_5_moe_text``). Absent keys take
the defaults of transformers' config classes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COMPOSITE_TYPES = {"qwen3_5": False, "qwen3_5_moe": True}
TEXT_TYPES = {"qwen3_5_text": False, "qwen3_5_moe_text": True}
SUPPORTED_MODEL_TYPES = sorted([*COMPOSITE_TYPES, *TEXT_TYPES])

# transformers' class defaults (Qwen3_5TextConfig describes 9B, Qwen3_5MoeTextConfig 35B-A3B).
_DENSE_DEFAULTS: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768,
)
_MOE_DEFAULTS: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=2048, intermediate_size=None, num_hidden_layers=40,
    num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
)
_LEGACY_LAYER_TYPES = {"linear": "linear_attention", "attention": "full_attention", "full": "full_attention"}


class ConfigError(ValueError):
    """A config.json that ninfer cannot run, with the reason in the message."""


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    in_channels: int = 3


@dataclass(frozen=True)
class ModelConfig:
    """Geometry and hyper-parameters of one Qwen3.5 text model (plus optional vision tower)."""

    model_type: str
    is_moe: bool
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int]
    max_position_embeddings: int
    tie_word_embeddings: bool
    intermediate_size: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    mtp_num_hidden_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    vision: VisionConfig | None = None
    multimodal_token_ids: dict[str, int] = field(default_factory=dict)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def deltanet_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]


def _layer_types(text: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))
    types = tuple(_LEGACY_LAYER_TYPES.get(t, t) for t in types)
    unknown = sorted(set(types) - {"full_attention", "linear_attention"})
    if unknown:
        raise ConfigError(f"layer_types contains {unknown}; expected 'linear_attention' or 'full_attention'")
    if len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries but num_hidden_layers is {num_layers}")
    return types


def _rope(text: dict[str, Any]) -> tuple[float, float, tuple[int, int, int]]:
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope_parameters.rope_type {rope_type!r} is not supported (only 'default')")
    theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    section = tuple(rope.get("mrope_section", (11, 11, 10)))
    if len(section) != 3:
        raise ConfigError(f"rope_parameters.mrope_section must have 3 entries, got {list(section)}")
    return theta, factor, section  # type: ignore[return-value]


def _vision(raw: dict[str, Any] | None) -> VisionConfig | None:
    if not raw:
        return None
    return VisionConfig(
        depth=raw.get("depth", 27), hidden_size=raw.get("hidden_size", 1152),
        intermediate_size=raw.get("intermediate_size", 4304), num_heads=raw.get("num_heads", 16),
        out_hidden_size=raw.get("out_hidden_size", 3584), patch_size=raw.get("patch_size", 16),
        temporal_patch_size=raw.get("temporal_patch_size", 2), spatial_merge_size=raw.get("spatial_merge_size", 2),
        num_position_embeddings=raw.get("num_position_embeddings", 2304), in_channels=raw.get("in_channels", 3),
    )


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from the parsed JSON of a config.json."""
    model_type = raw.get("model_type")
    if model_type in COMPOSITE_TYPES:
        is_moe, text = COMPOSITE_TYPES[model_type], dict(raw.get("text_config") or {})
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        vision = _vision(raw.get("vision_config"))
        mm_ids = {k: raw[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                      "vision_end_token_id") if k in raw}
    elif model_type in TEXT_TYPES:
        is_moe, text, vision, mm_ids = TEXT_TYPES[model_type], raw, None, {}
        tie = text.get("tie_word_embeddings", False)
    else:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; ninfer runs the Qwen3.5 family: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    values = {**(_MOE_DEFAULTS if is_moe else _DENSE_DEFAULTS), **text}
    num_layers = int(values["num_hidden_layers"])
    theta, factor, section = _rope(text)
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    cfg = ModelConfig(
        model_type=model_type, is_moe=is_moe,
        vocab_size=int(values["vocab_size"]), hidden_size=int(values["hidden_size"]),
        num_hidden_layers=num_layers, layer_types=_layer_types(text, num_layers),
        num_attention_heads=int(values["num_attention_heads"]), num_key_value_heads=int(values["num_key_value_heads"]),
        head_dim=int(values.get("head_dim", 256)),
        linear_num_key_heads=int(values.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(values.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(values.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(values.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(values.get("linear_conv_kernel_dim", 4)),
        rms_norm_eps=float(values.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, partial_rotary_factor=factor, mrope_section=section,
        max_position_embeddings=int(values["max_position_embeddings"]), tie_word_embeddings=bool(tie),
        intermediate_size=values.get("intermediate_size"),
        num_experts=int(values.get("num_experts", 0)) if is_moe else 0,
        num_experts_per_tok=int(values.get("num_experts_per_tok", 0)) if is_moe else 0,
        moe_intermediate_size=int(values.get("moe_intermediate_size", 0)) if is_moe else 0,
        shared_expert_intermediate_size=int(values.get("shared_expert_intermediate_size", 0)) if is_moe else 0,
        mtp_num_hidden_layers=int(values.get("mtp_num_hidden_layers", 0)),
        eos_token_ids=eos_ids, vision=vision, multimodal_token_ids=mm_ids,
    )
    _validate(cfg)
    return cfg


def _validate(cfg: ModelConfig) -> None:
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if not cfg.is_moe and not cfg.intermediate_size:
        raise ConfigError("intermediate_size is required for a dense model")


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: a Qwen3.5 checkpoint directory holds config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from err
    return parse_config(raw)
