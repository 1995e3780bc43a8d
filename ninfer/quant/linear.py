"""Modules holding quantized weights, and the model surgery that installs them.

A :class:`QuantWeight` stores one weight ``[*, N, K]`` as the tensors of its format (``qweight``,
``scales``, ``global_scale``: see :mod:`ninfer.quant.formats`), registered as frozen parameters
under those names, so a checkpoint key ``<module>.qweight`` loads by plain name match.
:class:`QuantLinear` adds the GEMM (Triton on CUDA, dequantize + matmul elsewhere),
:class:`QuantEmbedding` a row lookup; a bare ``QuantWeight`` replaces stacked expert parameters.

Contract with the loader (``keep_dtype``): every parameter of these modules keeps the dtype its
format declares (uint8 codes, fp8, fp16 or fp32 scales) whatever the model dtype; ``materialize``
must allocate ``param.dtype`` for names in ``module.keep_dtype`` instead of the model dtype.

A plan maps weight names to formats. Names are those of :func:`weight_shapes`: a module path for
``nn.Linear`` / ``nn.Embedding`` weights (``layers.0.mlp.down_proj``), a parameter path otherwise
(``layers.0.mlp.experts.gate_up_proj``), and for a fused projection the checkpoint names of its parts
(``layers.0.mlp.gate_proj`` and ``layers.0.mlp.up_proj``, not ``layers.0.mlp.gate_up_proj``), so that
recipes read like checkpoints. The parts of one fused module must get one format (:func:`module_plan`);
each part is quantized on its own rows, so its bytes are those of the separate projection (nvfp4 keeps
each part's global scale, stored per row). ``bf16`` entries leave the module as it is.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ninfer.checkpoint import RowSlice, fused_parts
from ninfer.kernels.dispatch import env_switch
from ninfer.kernels.embedding import can_take, embedding_rows_triton
from ninfer.kernels.norms import NormedRows
from ninfer.kernels.quant_gemm import quant_matmul, quant_matmul_then_norm
from ninfer.kernels.quant_gemm.fragments import FRAGMENTS, fragments_fit, to_fragments
from ninfer.kernels.quant_gemm.fragments_fp4 import fp4_scales_fit
from ninfer.kernels.quant_gemm.weights import ROWS
from ninfer.quant.formats import (
    FormatError,
    QuantizedTensor,
    WeightFormat,
    get_format,
    stack_rows,
)
from ninfer.quant.recipe import Recipe, resolve_plan, split_plan


class QuantWeight(nn.Module):
    """Packed storage of one weight ``[*, N, K]`` in a quantized format."""

    keep_dtype: ClassVar[frozenset[str]] = frozenset({"qweight", "scales", "global_scale"})

    def __init__(self, shape: tuple[int, ...], fmt: str | WeightFormat, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.format = get_format(fmt)
        if self.format.name == "bf16":
            raise FormatError("bf16 weights stay in their float module; QuantWeight holds quantized formats only")
        self.shape = tuple(shape)
        self.format.check_shape(self.shape)
        self.dtype = dtype  # what dequantized values are produced in (embeddings, experts)
        self.layout = ROWS  # of the stored tensors: the format's own until a kernel's is installed
        for name, spec in self.format.specs(self.shape).items():
            self.register_parameter(name, nn.Parameter(torch.empty(spec.shape, dtype=spec.dtype, device=device),
                                                       requires_grad=False))

    def packed(self) -> QuantizedTensor:
        return QuantizedTensor(self.format, self.shape, dict(self.named_parameters(recurse=False)), self.layout)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.packed().dequantize(dtype or self.dtype)

    def select(self, index: int) -> QuantizedTensor:
        """Slice ``index`` of the leading dim (one expert) as a 2-D weight, a view for ``quant_matmul``."""
        return self.packed().select(index)

    def rows_view(self, name: str, start: int, stop: int, index: int | None = None) -> torch.Tensor:
        """The part of stored tensor ``name`` that holds weight rows ``[start, stop)`` (of slice ``index``
        of a leading expert dim): what a loader fills from a per-expert or per-projection tensor."""
        spec = self.format.specs(self.shape)[name]
        if self.layout != ROWS:
            raise FormatError(f"format {self.format.name}: the tensors were re-laid for a kernel ({self.layout}); "
                              "weights load before that")
        if start % spec.row_block or (stop % spec.row_block and stop != self.shape[-2]):
            raise FormatError(f"format {self.format.name}: {name} stores {spec.row_block} rows per entry; "
                              f"rows [{start}, {stop}) do not align")
        tensor = getattr(self, name).data if index is None else getattr(self, name).data[index]
        first, last = start // spec.row_block, -(-stop // spec.row_block)
        return tensor.narrow(spec.row_dim % tensor.dim(), first, last - first)

    @torch.no_grad()
    def load_float_(self, weight: torch.Tensor, *, index: int | None = None,
                    rows: tuple[int, int] | None = None) -> None:
        """Quantize a float ``weight`` into this storage: all of it, or slice ``index`` of the leading dim,
        or rows ``rows = (start, stop)`` of that (each part gets its own scales: formats are row-separable)."""
        device = next(iter(self.parameters())).device
        start, stop = rows if rows is not None else (0, self.shape[-2])
        packed = self.format.quantize(weight.to(device))
        for name, tensor in packed.items():
            whole = rows is None and index is None
            target = getattr(self, name).data if whole else self.rows_view(name, start, stop, index)
            if tuple(target.shape) != tuple(tensor.shape):
                raise FormatError(f"{name}: quantized shape {list(tensor.shape)} does not fit {list(target.shape)}")
            target.copy_(tensor)

    @classmethod
    def from_float(cls, weight: torch.Tensor, fmt: str | WeightFormat) -> QuantWeight:
        module = cls(tuple(weight.shape), fmt, device=weight.device, dtype=weight.dtype)
        module.load_float_(weight)
        return module

    def extra_repr(self) -> str:
        return f"shape={list(self.shape)}, format={self.format.name}"


class QuantLinear(QuantWeight):
    """``y = x @ W^T`` with W quantized; optional fused ``+ residual`` and SwiGLU (stacked gate/up W)."""

    shares_storage = False  # True for a view of another module's tensors (:meth:`QuantEmbedding.as_linear`)

    def __init__(self, in_features: int, out_features: int, fmt: str | WeightFormat,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__((out_features, in_features), fmt, device, dtype)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor | NormedRows, residual: torch.Tensor | None = None,
                swiglu: bool = False) -> torch.Tensor:
        return quant_matmul(x, self.packed(), residual, swiglu)

    def forward_then_norm(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                          defer: bool = False) -> tuple[torch.Tensor | NormedRows, torch.Tensor]:
        """``rms_norm(self(x), norm_weight, eps, residual)`` as ``(normed, new residual stream)``, the norm applied
        by the GEMM's own launch where it can (:func:`~ninfer.kernels.quant_gemm.quant_matmul_then_norm`); ``defer``:
        the caller's readers take the normed rows deferred (:class:`~ninfer.kernels.norms.NormedRows`)."""
        return quant_matmul_then_norm(x, self.packed(), norm_weight, eps, residual, defer=defer)

    @torch.no_grad()
    def use_fragment_layout_(self) -> bool:
        """Re-lay int4 / int8 / nvfp4 codes and scales in place into the register decode's fragment layout
        (:mod:`ninfer.kernels.quant_gemm.fragments`): same shapes and bytes, another order, which every path of
        ``quant_matmul`` (and ``dequantize``) reads. False where the weight cannot take it (not int4-g64 / -g128,
        int8-g64 or nvfp4 with nonnegative block scales, N not a multiple of 16, K of 128) or shares its storage (a tied
        LM head: the embedding reads rows)."""
        if self.layout == FRAGMENTS:
            return True
        if self.shares_storage or not fragments_fit(self.format.name, self.shape):
            return False
        if self.format.name == "nvfp4" and not fp4_scales_fit(self.scales.data):
            return False
        q, s = to_fragments(self.qweight.data, self.scales.data)
        self.qweight.data.copy_(q)
        self.scales.data.copy_(s)
        self.layout = FRAGMENTS
        return True

    @classmethod
    def from_float(cls, weight: torch.Tensor, fmt: str | WeightFormat) -> QuantLinear:
        module = cls(weight.shape[1], weight.shape[0], fmt, device=weight.device, dtype=weight.dtype)
        module.load_float_(weight)
        return module

    @classmethod
    def stacked(cls, parts: list[QuantLinear]) -> QuantLinear:
        """One layer whose rows are those of ``parts`` in order (e.g. gate then up, for the SwiGLU epilogue)."""
        packed = stack_rows([p.packed() for p in parts])
        module = cls(packed.shape[1], packed.shape[0], packed.format, device="meta", dtype=parts[0].dtype)
        for name, tensor in packed.tensors.items():
            setattr(module, name, nn.Parameter(tensor.detach(), requires_grad=False))
        return module


class QuantEmbedding(QuantWeight):
    """Token embedding with quantized rows; a lookup dequantizes only the rows it reads."""

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: str | WeightFormat,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__((num_embeddings, embedding_dim), fmt, device, dtype)

    @classmethod
    def from_float(cls, weight: torch.Tensor, fmt: str | WeightFormat) -> QuantEmbedding:
        module = cls(weight.shape[0], weight.shape[1], fmt, device=weight.device, dtype=weight.dtype)
        module.load_float_(weight)
        return module

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat, dim = ids.reshape(-1).contiguous(), self.shape[-1]
        if self.layout == ROWS and can_take(self.qweight, self.scales, dim):
            rows = embedding_rows_triton(self.qweight, self.scales, flat, dim, self.dtype)  # one launch
        else:
            rows = self.format.dequantize_rows(dict(self.named_parameters(recurse=False)), flat, self.dtype)
        return rows.reshape(*ids.shape, dim)

    def as_linear(self) -> QuantLinear:
        """A :class:`QuantLinear` sharing this storage (tied LM head)."""
        module = QuantLinear(self.shape[1], self.shape[0], self.format, device="meta", dtype=self.dtype)
        for name, param in self.named_parameters(recurse=False):
            setattr(module, name, param)
        module.shares_storage = True
        return module


def use_kernel_layouts_(*modules: nn.Module | None) -> int:
    """Re-lay the int4, int8 and nvfp4 linear weights of ``modules`` (on CUDA) for the register decode
    (:meth:`QuantLinear.use_fragment_layout_`), unless ``NINFER_FRAGMENTS=0`` (read now): the row-major
    kernels then serve them. Returns how many weights are in the fragment layout."""
    if not env_switch("NINFER_FRAGMENTS", True):
        return 0
    count = 0
    for module in modules:
        for sub in module.modules() if module is not None else ():
            if isinstance(sub, QuantLinear) and sub.qweight.is_cuda:
                count += sub.use_fragment_layout_()
    return count


def weight_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every parameter as ``name -> shape``, named as plans and recipes name them (``.weight`` dropped; a
    float fused projection as its parts, each with its own rows)."""
    groups = _groups(fused_parts(model))
    shapes: dict[str, tuple[int, ...]] = {}
    for name, p in model.named_parameters():
        base = name.removesuffix(".weight")
        if base in groups and name.endswith(".weight"):
            shapes.update({part: (where.stop - where.start, *p.shape[1:]) for part, where in groups[base]})
        else:
            shapes[base] = tuple(p.shape)
    return shapes


def recipe_plans(recipe: Recipe, model: nn.Module, head: nn.Module | None = None) -> tuple[dict[str, str],
                                                                                            dict[str, str]]:
    """``(model plan, head plan)``: what ``recipe`` quantizes in ``model`` and in its MTP ``head`` (its
    ``mtp.`` rules; names without the prefix). Both may be on the meta device and must still be float."""
    shapes = weight_shapes(model)
    if head is not None:
        shapes |= {f"mtp.{name}": shape for name, shape in weight_shapes(head).items()}
    return split_plan(resolve_plan(recipe, shapes))


def module_plan(plan: dict[str, str], parts: dict[str, RowSlice]) -> dict[str, str]:
    """``plan`` (weight names of :func:`weight_shapes`) with the parts of each fused projection replaced by
    the fused module's name. Raises :class:`FormatError` where the parts' formats differ (a missing entry
    counts as bf16), or where a format sharing scales across rows (fp8-b128) would have a block straddle
    two parts."""
    out = {name: fmt for name, fmt in plan.items() if name not in parts}
    for module, members in _groups(parts).items():
        formats = {part: get_format(plan.get(part, "bf16")).name for part, _ in members}
        if len(set(formats.values())) > 1:
            listed = ", ".join(f"{part}: {fmt}" for part, fmt in formats.items())
            raise FormatError(f"{listed}: these are one fused projection ({module}) and need one format")
        fmt = get_format(next(iter(formats.values())))
        if fmt.name == "bf16":
            if any(part in plan for part, _ in members):
                out[module] = "bf16"
            continue
        block = max(spec.row_block for spec in fmt.specs((128, 128)).values())
        for part, where in members[:-1]:
            if where.stop % block:
                raise FormatError(f"{part} ({where.stop - where.start} rows) ends inside a {block}-row scale block "
                                  f"of format {fmt.name}, which the fused {module} would share with the next "
                                  f"part; choose a per-row format for {', '.join(formats)}")
        out[module] = fmt.name
    return out


def _groups(parts: dict[str, RowSlice]) -> dict[str, list[tuple[str, RowSlice]]]:
    """Fused module name -> its parts in row order."""
    groups: dict[str, list[tuple[str, RowSlice]]] = {}
    for part, where in sorted(parts.items(), key=lambda item: (item[1].module, item[1].start)):
        groups.setdefault(where.module, []).append((part, where))
    return groups


def _replacement(target: nn.Module | nn.Parameter, name: str, fmt: WeightFormat, device: torch.device,
                 dtype: torch.dtype) -> QuantWeight:
    if isinstance(target, nn.Linear):
        if target.bias is not None:
            raise FormatError(f"{name}: linear layers with a bias are not supported by QuantLinear")
        return QuantLinear(target.in_features, target.out_features, fmt, device, dtype)
    if isinstance(target, nn.Embedding):
        return QuantEmbedding(target.num_embeddings, target.embedding_dim, fmt, device, dtype)
    if isinstance(target, nn.Parameter) and target.dim() >= 2:
        return QuantWeight(tuple(target.shape), fmt, device, dtype)
    raise FormatError(f"{name}: a {type(target).__name__} of shape {list(getattr(target, 'shape', []))} cannot hold "
                      f"format {fmt.name} (only nn.Linear, nn.Embedding and >= 2-D weights can)")


def _install(model: nn.Module, plan: dict[str, str], dtype: torch.dtype | None, fill: bool) -> None:
    parts = fused_parts(model)
    groups = _groups(parts)
    for name, fmt_name in module_plan(plan, parts).items():
        fmt = get_format(fmt_name)
        if fmt.name == "bf16":
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        target = getattr(parent, attr, None)
        if target is None:
            raise FormatError(f"plan names {name!r}, which is not a module or parameter of the model")
        weight = target if isinstance(target, nn.Parameter) else getattr(target, "weight", None)
        if weight is None:
            raise FormatError(f"{name}: a {type(target).__name__} has no weight to quantize")
        new = _replacement(target, name, fmt, weight.device, dtype or weight.dtype)
        if fill and name in groups:  # each part on its own rows: the bytes of the separate projection
            for _, where in groups[name]:
                new.load_float_(weight.data[where.start:where.stop], rows=(where.start, where.stop))
        elif fill:
            new.load_float_(weight.data)
        if isinstance(target, nn.Parameter):
            delattr(parent, attr)  # a module cannot take a parameter's slot directly
        setattr(parent, attr, new)


def prepare_model_(model: nn.Module, plan: dict[str, str], *, dtype: torch.dtype | None = None) -> None:
    """Replace the planned weights by empty quantized modules of the right shapes (on the weights' device,
    typically ``meta``), ready to be materialised and filled from a quantized checkpoint.
    ``dtype``: what embeddings / experts dequantize to (default: the replaced weight's dtype)."""
    _install(model, plan, dtype, fill=False)


@torch.no_grad()
def quantize_model_(model: nn.Module, plan: dict[str, str], *, dtype: torch.dtype | None = None) -> None:
    """Quantize a loaded model's planned weights in place (on their device), one weight at a time."""
    _install(model, plan, dtype, fill=True)
