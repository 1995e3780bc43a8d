"""RMSNorm variants of the Qwen3.5 text model.

Two kinds exist and must never be mixed up (reference §5): the zero-centred norm scales by
``1 + w`` and is used everywhere except the Gated DeltaNet output, whose gated norm scales by a
plain ``w`` and then multiplies by ``silu(z)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-centred RMSNorm over the last dim with an optional residual add first.

    Returns ``(normed, new_residual)`` where ``new_residual = x + residual`` (or ``x``), kept in the
    input dtype as the model's residual stream is.
    """
    if residual is not None:
        x = x + residual
    h = x.float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return out.to(x.dtype), x


def gated_rms_norm_reference(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm of the DeltaNet output: ``w * norm(x)`` (cast to x's dtype first) times ``silu(z)``."""
    dtype = x.dtype
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    out = weight * h
    return (out * F.silu(z.float())).to(dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_reference(x, weight, eps, residual)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return gated_rms_norm_reference(x, z, weight, eps)
