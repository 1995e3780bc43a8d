"""Build the vision tower and stream its ``model.visual.*`` tensors into it (reference §12.1).

Only the shards that hold vision tensors are opened, and only the vision tensors are read, one at
a time straight to the target device and dtype, so a text-only load never pays for them and a
vision load never holds the weights twice.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ninfer.checkpoint import CheckpointError, canonical_name, checkpoint_files
from ninfer.config import ModelConfig, VisionConfig
from ninfer.models.vision import VisionTransformer, vision_inv_freq


def vision_settings(model_dir: Path) -> dict[str, object]:
    """Vision keys that :class:`ninfer.config.VisionConfig` does not carry: activation and rotary base."""
    raw = json.loads((Path(model_dir) / "config.json").read_text()).get("vision_config") or {}
    rope = raw.get("rope_parameters") or {}
    return {"hidden_act": raw.get("hidden_act", "gelu_pytorch_tanh"),
            "rope_theta": float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))}


def build_vision_tower(config: VisionConfig, device: torch.device | str, dtype: torch.dtype,
                       **settings: object) -> VisionTransformer:
    """An unloaded tower: parameters allocated (uninitialised) on ``device`` in ``dtype``."""
    with torch.device("meta"):
        tower = VisionTransformer(config, **settings)  # type: ignore[arg-type]
    for module in tower.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device),
                                               requires_grad=False))
    # Buffers built on the meta device hold no values: recompute the rotary frequencies for real.
    tower.register_buffer("inv_freq", vision_inv_freq(config, tower.rope_theta).to(device), persistent=False)
    return tower.eval()


def load_vision_tensors(tower: VisionTransformer, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy ``(checkpoint key, tensor)`` pairs into ``tower``; keys outside ``model.visual.`` are ignored.

    Raises :class:`CheckpointError` naming the tensor on an unknown key, a wrong shape, or (at the
    end) the parameters no tensor filled.
    """
    params = dict(tower.named_parameters())
    filled: set[str] = set()
    for key, tensor in tensors:
        component, name = canonical_name(key)
        if component != "vision":
            continue
        if name not in params:
            raise CheckpointError(f"unexpected vision tensor {key} (no parameter {name!r} in the vision tower)")
        target = params[name].data
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"tensor {key} has shape {list(tensor.shape)} but the vision config implies "
                                  f"{list(target.shape)}")
        target.copy_(tensor)
        filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"the checkpoint is missing {len(missing)} vision tensors: {shown}")


def iter_vision_tensors(model_dir: Path, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Stream only the ``model.visual.*`` tensors of a checkpoint, shard by shard."""
    by_file: dict[Path, list[str]] = {}
    for key, path in checkpoint_files(Path(model_dir)).items():
        if canonical_name(key)[0] == "vision":
            by_file.setdefault(path, []).append(key)
    device = torch.device(device)
    load_device = str(device) if device.type in ("cpu", "cuda") else "cpu"
    for path, keys in by_file.items():
        with safe_open(path, framework="pt", device=load_device) as f:
            for key in keys:
                yield key, f.get_tensor(key)


def load_vision_tower(model_dir: str | Path, config: ModelConfig | VisionConfig,
                      device: torch.device | str, dtype: torch.dtype) -> VisionTransformer:
    """Build the tower described by the checkpoint's ``vision_config`` and load its weights."""
    vision = config.vision if isinstance(config, ModelConfig) else config
    if vision is None:
        raise CheckpointError(f"{model_dir} has no vision_config: this checkpoint is text-only, vision is unavailable")
    tower = build_vision_tower(vision, device, dtype, **vision_settings(Path(model_dir)))
    load_vision_tensors(tower, iter_vision_tensors(Path(model_dir), device))
    return tower
