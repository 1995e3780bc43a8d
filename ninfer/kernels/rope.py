"""Partial NeoX rotary embedding with interleaved M-RoPE (reference §7).

Positions arrive as ``[3, N]`` (temporal, height, width); for text all three rows are equal and
the result is plain 1-D RoPE on the first ``rotary_dim`` channels of each head.
"""
from __future__ import annotations

import torch


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """The ``rotary_dim / 2`` inverse frequencies, fp32, exactly as transformers builds them."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def mrope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, mrope_section: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[N, rotary_dim]`` for 3-axis positions ``[3, N]``.

    Frequency index ``j`` belongs to the H axis when ``j % 3 == 1`` (for the first ``3 * sec_h``
    indices), to W when ``j % 3 == 2`` (first ``3 * sec_w``), otherwise to T. The tables are cast to
    the activation dtype before use, as transformers does.
    """
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [3, N, R/2]
    cos, sin = freqs.cos(), freqs.sin()

    def interleave(f: torch.Tensor) -> torch.Tensor:
        out = f[0].clone()
        for axis, offset in ((1, 1), (2, 2)):
            idx = slice(offset, mrope_section[axis] * 3, 3)
            out[..., idx] = f[axis, ..., idx]
        return torch.cat((out, out), dim=-1)

    return interleave(cos).to(dtype), interleave(sin).to(dtype)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``cos.shape[-1]`` channels of ``x [N, heads, head_dim]``."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return apply_rope_reference(x, cos, sin)
