"""Mixture-of-experts expert evaluation (reference §9; the routing is :mod:`.routing`).

``moe_experts`` runs the grouped expert GEMMs of
:mod:`ninfer.kernels.moe.gemm` on float expert stacks and those of
:mod:`ninfer.kernels.moe.quant_gemm` on quantized ones (packed bytes read in the K loop; at decode
the ``tl.dot``-free GEMV of :mod:`ninfer.kernels.moe.quant_gemv` where it measured faster). Both fall
back to the references off CUDA; the expert reference dequantizes only the experts it uses.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.kernels.dispatch import norm_in_moe_combine, use_triton
from ninfer.kernels.moe.gemm import SharedExpert, Weight, moe_experts_triton
from ninfer.kernels.moe.quant_gemm import QUANT_FORMATS
from ninfer.kernels.norms import NextNorm, NormedRows, as_rows, rms_norm
from ninfer.kernels.overlap import wait_for
from ninfer.kernels.quant_gemm.weights import QuantizedTensor

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # expert stacks the Triton GEMMs read directly


def _expert(w: Weight, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """One expert's float weight; a quantized stack dequantizes that expert only, in x's dtype."""
    return w.select(expert).dequantize(dtype) if isinstance(w, QuantizedTensor) else w[expert]


def moe_experts_reference(
    x: torch.Tensor, gate_up: Weight, down: Weight, weights: torch.Tensor, ids: torch.Tensor,
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """``sum_j weights[:, j] * down[e] @ swiglu(gate_up[e] @ x)`` with ``e = ids[:, j]``.

    ``gate_up [E, 2I, H]`` (gate rows first), ``down [E, H, I]``, float or quantized; accumulated
    in x's dtype, one expert at a time, as transformers does. ``shared``: a gated shared expert's
    ``(output, gate logit)``; the result is then ``routed + sigmoid(logit) * output`` (in x's dtype, op by op).
    """
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        token_idx, pos = torch.where(ids == expert)
        gate, up = F.linear(x[token_idx], _expert(gate_up, expert, x.dtype)).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, _expert(down, expert, x.dtype)) * weights[token_idx, pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    if shared is not None:
        out = out + torch.sigmoid(shared[1]) * wait_for(shared[0])
    return out


def _triton_reads(w: Weight) -> bool:
    if isinstance(w, QuantizedTensor):
        return w.format.name in QUANT_FORMATS or w.format.name == "bf16"
    return w.dtype in _FLOATS


def moe_experts(
    x: torch.Tensor | NormedRows, gate_up: Weight, down: Weight, weights: torch.Tensor, ids: torch.Tensor,
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """Routed experts; ``gate_up`` and ``down`` are float stacks or quantized ones (any mix). ``shared``: a gated
    shared expert's ``(output, gate logit)``, added in the combine's launch on CUDA; its output may still be
    computing on another stream (:class:`~ninfer.kernels.overlap.Overlapped`): the combine waits for it. ``x``
    may come with its norm deferred (:class:`~ninfer.kernels.norms.NormedRows`)."""
    if _triton_applies(x, gate_up, down):
        return moe_experts_triton(x, gate_up, down, weights, ids, shared=shared)
    return moe_experts_reference(as_rows(x), gate_up, down, weights, ids, shared)


def _triton_applies(x: torch.Tensor | NormedRows, gate_up: Weight, down: Weight) -> bool:
    rows = x.scaled if isinstance(x, NormedRows) else x
    return use_triton(rows) and rows.dim() == 2 and _triton_reads(gate_up) and _triton_reads(down)


def moe_experts_then_norm(
    x: torch.Tensor | NormedRows, gate_up: Weight, down: Weight, weights: torch.Tensor, ids: torch.Tensor,
    shared: SharedExpert | None, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(moe_experts(...), norm_weight, eps, residual)``: the block's output through the norm that follows
    it, ``(normed, new_residual)``. On CUDA the combine applies the norm in its own launch (unless
    ``NINFER_MOE_NORM=0``)
    (one launch fewer per MoE layer: the next layer's input norm, or the model's final norm)."""
    fused = (norm_in_moe_combine() and _triton_applies(x, gate_up, down)
             and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape
                                       and residual.is_contiguous())))
    if not fused:
        return rms_norm(moe_experts(x, gate_up, down, weights, ids, shared), norm_weight, eps, residual)
    norm = NextNorm(norm_weight.contiguous(), eps, residual, torch.empty(x.shape, dtype=x.dtype, device=x.device))
    return moe_experts_triton(x, gate_up, down, weights, ids, shared=shared, norm=norm), norm.new_residual
