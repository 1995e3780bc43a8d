"""Several linear layers of one input computed by one GEMM over their stacked rows.

At decode every projection is a launch (and a gap before the next one), so projections that read the
same ``x`` are cheaper as one: the MLP's gate and up (one GEMM, SwiGLU in the quantized epilogue),
gated attention's q, k and v, Gated DeltaNet's ``a`` and ``b`` (two 48-row bf16 GEMMs, each a
cuBLAS split-K pair of launches), and the MoE router with the shared expert's 1-row gate.
:func:`fuse_rows` stacks the layers' weights into one storage and turns each layer's parameters into
row views of it, so names, shapes, state dicts, loading (``copy_`` into the views) and memory stay as
they were; only the owner's forward changes. A layer whose parameter is replaced afterwards (``.to()``,
a loader assigning new tensors) no longer shares the storage: :meth:`FusedRows.valid` turns false and
the owner falls back to separate projections.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedRows:
    """The stacked weight of ``layers`` (a float ``[sum N, K]`` tensor or a ``QuantLinear``) and each
    layer's row count, in order."""

    def __init__(self, layers: list[nn.Module], weight: torch.Tensor | nn.Module) -> None:
        self.layers, self.weight = layers, weight
        self.sizes = [_rows(layer) for layer in layers]
        self._key = _storage_key(layers)

    def valid(self) -> bool:
        """Whether every layer still holds its views of the stacked storage."""
        return self._key == _storage_key(self.layers)

    def __call__(self, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """``x @ W^T`` over all rows (``[..., sum N]``); ``swiglu``: quantized weights only, ``silu`` of the
        first half times the second in the GEMM's epilogue (``[..., N / 2]``)."""
        if isinstance(self.weight, torch.Tensor):
            if swiglu:
                raise ValueError("the SwiGLU epilogue needs quantized weights; apply swiglu() to the output")
            return F.linear(x, self.weight)
        return self.weight(x, swiglu=swiglu)


@torch.no_grad()
def fuse_rows(layers: list[nn.Module]) -> FusedRows | None:
    """Stack ``layers`` (all ``nn.Linear`` of one dtype and device without bias, or all ``QuantLinear`` of one
    format) into one storage, their parameters becoming row views of it; None (nothing changed) otherwise."""
    from ninfer.quant.formats import FormatError
    from ninfer.quant.linear import QuantLinear

    if all(type(layer) is nn.Linear and layer.bias is None for layer in layers):
        weights = [layer.weight for layer in layers]
        if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
            return None
        stacked = torch.cat(weights)
        for layer, rows in zip(layers, stacked.split([w.shape[0] for w in weights])):
            layer.weight = nn.Parameter(rows, requires_grad=layer.weight.requires_grad)
        return FusedRows(layers, stacked)
    if not all(isinstance(layer, QuantLinear) for layer in layers) or len({layer.format for layer in layers}) != 1:
        return None
    try:
        stacked = QuantLinear.stacked(layers)
    except FormatError:  # e.g. 128-row scale blocks that a part's row count does not fill
        return None
    specs = layers[0].format.specs(layers[0].shape)
    for name, tensor in stacked.named_parameters(recurse=False):
        dim = specs[name].row_dim % tensor.dim()
        views = tensor.split([getattr(layer, name).shape[dim] for layer in layers], dim=dim)
        for layer, view in zip(layers, views):
            setattr(layer, name, nn.Parameter(view, requires_grad=False))
    return FusedRows(layers, stacked)


def fused_of(owner: nn.Module, name: str) -> FusedRows | None:
    """The fusion ``owner`` keeps under ``name`` if it is still valid, else None. Kept in ``__dict__``, not as
    a registered submodule: its storage is the projections' own parameters."""
    fused = owner.__dict__.get(name)
    return fused if fused is not None and fused.valid() else None


def fuse_into(owner: nn.Module, name: str, layers: list[nn.Module]) -> bool:
    """Fuse ``layers`` for ``owner`` under ``name`` (once; idempotent); False where they cannot share a storage."""
    if fused_of(owner, name) is None:
        owner.__dict__[name] = fuse_rows(layers)
    return owner.__dict__[name] is not None


def fuse_projections(model: nn.Module | None) -> int:
    """Call ``fuse_()`` on every module of ``model`` that defines it (MLP gate/up, attention q/k/v, DeltaNet
    a/b, the MoE router with the shared expert's gate); the number of modules fused."""
    if model is None:
        return 0
    return sum(m.fuse_() for m in model.modules() if callable(getattr(type(m), "fuse_", None)))


def fused_weights(module: nn.Module) -> list[torch.Tensor | nn.Module]:
    """The stacked weights of the fusions ``module`` holds (still valid ones), e.g. for the memory plan:
    they are no registered parameters or submodules."""
    return [f.weight for f in module.__dict__.values() if isinstance(f, FusedRows) and f.valid()]


def _rows(layer: nn.Module) -> int:
    return layer.weight.shape[0] if type(layer) is nn.Linear else layer.shape[0]


def _storage_key(layers: list[nn.Module]) -> tuple[int, ...]:
    return tuple(p.data_ptr() for layer in layers for p in layer.parameters(recurse=False))
