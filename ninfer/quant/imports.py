"""Pre-quantized checkpoints in public layouts, mapped onto ninfer formats without requantizing.

Detected per weight from the tensor names and dtypes (headers only, no data read):

=========================  ===========================================================  ===========
layout                     tensors of ``<w>``                                           format
=========================  ===========================================================  ===========
ModelOpt NVFP4             ``weight`` uint8 [N, K/2], ``weight_scale`` e4m3 [N, K/16],   ``nvfp4``
                           ``weight_scale_2`` fp32 (multiplier), ``input_scale``
compressed-tensors NVFP4   ``weight_packed`` uint8, ``weight_scale`` e4m3,               ``nvfp4``
                           ``weight_global_scale`` fp32 (divisor), ``input_global_scale``
FP8, 128x128 blocks        ``weight`` e4m3 [N, K], ``weight_scale_inv`` (or              ``fp8-b128``
                           ``weight_scale``) fp32 [⌈N/128⌉, ⌈K/128⌉] (a multiplier)
FP8, per tensor / channel  ``weight`` e4m3, ``weight_scale`` fp32 [] / [1] / [N] / [N, 1]  ``fp8``
=========================  ===========================================================  ===========

Both NVFP4 layouts pack element 2j in the low nibble and keep scales ``[N, K/16]`` row-major, as
ninfer's nvfp4 does, so codes and block scales are used byte for byte; the per-tensor global
scale becomes ninfer's per-row ``global_scale`` (the compressed-tensors divisor is inverted).
Block FP8 keeps its block scales (``fp8-b128`` has kernel support), so nothing is requantized.
Activation scales (``input_scale``, ``input_global_scale``) and KV scales are dropped: ninfer runs
these weights with bf16 activations.

Projections the model fuses (``q_proj`` / ``k_proj`` / ``v_proj`` into ``qkv_proj``, ``gate_proj`` /
``up_proj`` into ``gate_up_proj``, ...) are planned under their parts' names and must share one format;
the loader writes each part's translated tensors into its rows of the fused module. Their per-tensor
scales differ, and each stays exact because it is stored per row (fp8 ``scales [N]``, nvfp4
``global_scale [N]``); 128-block FP8 needs every part to end on a 128-row block boundary.

MoE experts stored per expert (``mlp.experts.{e}.{gate,up,down}_proj``) are planned under their
stacked name; the loader writes each expert's translated tensors into its rows of the packed
``[E, 2I, H]`` / ``[E, H, I]`` stack (per-row global scales let gate and up keep their own), which
the grouped expert GEMMs read as they are. 128-block FP8 experts need ``I`` divisible by 128, so
that gate and up never share a scale block.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ninfer.checkpoint import canonical_name

_SUFFIXES = ("weight_packed", "weight_global_scale", "weight_scale_inv", "weight_scale_2", "weight_scale",
             "weight_zero_point", "input_global_scale", "input_scale", "k_scale", "v_scale", "weight")
_DROPPED = {"input_scale", "input_global_scale", "weight_zero_point", "k_scale", "v_scale"}
_FIELDS = {  # (layout, checkpoint suffix) -> ninfer field
    ("modelopt-nvfp4", "weight"): "qweight", ("modelopt-nvfp4", "weight_scale"): "scales",
    ("modelopt-nvfp4", "weight_scale_2"): "global_scale",
    ("ct-nvfp4", "weight_packed"): "qweight", ("ct-nvfp4", "weight_scale"): "scales",
    ("ct-nvfp4", "weight_global_scale"): "global_scale",
    ("fp8-block", "weight"): "qweight", ("fp8-block", "weight_scale_inv"): "scales",
    ("fp8-block", "weight_scale"): "scales",
    ("fp8-row", "weight"): "qweight", ("fp8-row", "weight_scale"): "scales",
}
FORMAT_OF = {"modelopt-nvfp4": "nvfp4", "ct-nvfp4": "nvfp4", "fp8-block": "fp8-b128", "fp8-row": "fp8"}


class QuantImportError(ValueError):
    """A quantized tensor group that matches no supported layout."""


@dataclass
class QuantizedWeight:
    """One pre-quantized weight of the source: its layout and logical ``[N, K]`` shape."""

    base: str  # checkpoint key without the suffix, e.g. model.layers.0.mlp.gate_proj
    layout: str
    shape: tuple[int, int]

    @property
    def format(self) -> str:
        return FORMAT_OF[self.layout]


@dataclass
class ImportPlan:
    """The pre-quantized weights of a checkpoint and how their tensors map onto ninfer's."""

    weights: dict[str, QuantizedWeight] = field(default_factory=dict)  # by checkpoint base key

    def __bool__(self) -> bool:
        return bool(self.weights)

    def plan(self, component: str = "text") -> dict[str, str]:
        """Weight name -> format for :func:`ninfer.quant.linear.prepare_model_`. Per-expert weights are
        reported under their stacked name (``layers.0.mlp.experts.gate_up_proj``)."""
        out = {}
        for base, w in self.weights.items():
            comp, name = canonical_name(base)
            if comp != component:
                continue
            head, sep, rest = name.partition(".mlp.experts.")
            if sep and rest.split(".", 1)[0].isdigit():
                name = f"{head}.mlp.experts.{'down' if rest.endswith('down_proj') else 'gate_up'}_proj"
            if out.setdefault(name, w.format) != w.format:
                raise QuantImportError(f"{name}: experts stored in different formats ({out[name]}, {w.format})")
        return out

    def translate(self, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A checkpoint tensor as ``(ninfer key, tensor)`` pairs: renamed packed tensors, the global scale
        as a per-row multiplier, nothing for activation scales; other tensors unchanged."""
        base, suffix = split_key(key)
        weight = self.weights.get(base)
        if weight is None:
            return [(key, tensor)]
        if suffix in _DROPPED:
            return []
        field_name = _FIELDS.get((weight.layout, suffix))
        if field_name is None:
            raise QuantImportError(f"{key}: unexpected tensor for a {weight.layout} weight")
        n = weight.shape[0]
        if field_name == "global_scale":
            value = tensor.float().reshape(-1)
            if value.numel() != 1:
                raise QuantImportError(f"{key}: expected one global scale per tensor, got shape {list(tensor.shape)}")
            tensor = (1.0 / value if weight.layout == "ct-nvfp4" else value).expand(n).contiguous()
        elif field_name == "scales" and weight.layout == "fp8-row":
            tensor = tensor.float().reshape(-1)
            tensor = tensor.expand(n).contiguous() if tensor.numel() == 1 else tensor.reshape(n)
        elif field_name == "scales" and weight.layout == "fp8-block":
            tensor = tensor.float()
        return [(f"{base}.{field_name}", tensor)]


def split_key(key: str) -> tuple[str, str]:
    for suffix in _SUFFIXES:
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], suffix
    return key, ""


def scan_checkpoint(files: dict[str, Path]) -> ImportPlan:
    """Find the pre-quantized weights of a checkpoint from its tensor headers."""
    groups: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if files.get(key) != path:
                    continue
                base, suffix = split_key(key)
                if suffix:
                    sl = f.get_slice(key)
                    groups.setdefault(base, {})[suffix] = (tuple(sl.get_shape()), sl.get_dtype())
    result = ImportPlan()
    for base, tensors in groups.items():
        layout = _layout(base, tensors)
        if layout is not None:
            shape = tensors["weight_packed" if layout == "ct-nvfp4" else "weight"][0]
            packed = layout in ("modelopt-nvfp4", "ct-nvfp4")
            result.weights[base] = QuantizedWeight(base, layout, (shape[0], shape[1] * (2 if packed else 1)))
    return result


def _layout(base: str, tensors: dict[str, tuple[tuple[int, ...], str]]) -> str | None:
    if "weight_packed" in tensors:
        if tensors.get("weight_scale", ((), ""))[1] != "F8_E4M3" or "weight_global_scale" not in tensors:
            raise QuantImportError(f"{base}: compressed-tensors packed weight without fp8 weight_scale and "
                               f"weight_global_scale (only NVFP4 is supported)")
        return "ct-nvfp4"
    if "weight" not in tensors:
        return None
    shape, dtype = tensors["weight"]
    if dtype == "U8":
        if tensors.get("weight_scale", ((), ""))[1] != "F8_E4M3" or "weight_scale_2" not in tensors:
            raise QuantImportError(f"{base}: uint8 weight without the fp8 weight_scale and weight_scale_2 of NVFP4")
        return "modelopt-nvfp4"
    if dtype != "F8_E4M3":
        return None
    scale = tensors.get("weight_scale_inv") or tensors.get("weight_scale")
    if scale is None:
        raise QuantImportError(f"{base}: fp8 weight without weight_scale / weight_scale_inv")
    n, k = shape
    grid = (-(-n // 128), -(-k // 128))
    if scale[0] == grid and (grid != (1, 1) or "weight_scale_inv" in tensors):
        return "fp8-block"
    if int(torch.tensor(scale[0]).prod()) in (1, n):
        return "fp8-row"
    raise QuantImportError(f"{base}: fp8 scale of shape {list(scale[0])} fits neither per-tensor, per-row nor "
                       f"128x128 blocks for weight {list(shape)}")
