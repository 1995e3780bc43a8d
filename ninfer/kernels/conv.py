"""Causal depthwise conv1d + SiLU over a ragged batch, with per-sequence state slots.

A state slot holds the last ``K - 1`` pre-conv inputs of its sequence (oldest first), so a chunk
continues exactly where the previous one stopped; decode is the ``T = 1`` case of the same op.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """``silu(conv(x))`` for ``x [N, C]`` packed by ``cu_seqlens [B + 1]``; weight ``[C, K]``.

    ``conv_state [S, C, K - 1]`` is read at ``slot_ids [B]`` as the inputs before each sequence's
    first token and overwritten with the inputs after its last one. ``max_seqlen`` (host int,
    optional) lets kernels choose the decode path without a device sync. The product runs in the
    weight's dtype, as transformers computes it.
    """
    taps = weight.shape[1]
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(slot_ids.tolist()):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            continue
        window = torch.cat([conv_state[slot].to(weight.dtype), x[start:end].t().to(weight.dtype)], dim=-1)
        y = F.conv1d(window[None], weight[:, None, :], groups=weight.shape[0])[0]  # [C, T]
        out[start:end] = F.silu(y).t().to(x.dtype)
        conv_state[slot] = window[:, -(taps - 1):].to(conv_state.dtype)
    return out


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    return causal_conv1d_reference(x, weight, conv_state, cu_seqlens, slot_ids, max_seqlen)
