"""Mixture-of-experts routing and expert evaluation (reference §9)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route_topk_reference(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax over experts, top-k, renormalised; weights returned in the logits' dtype."""
    probs = logits.float().softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), ids


def moe_experts_reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``sum_j weights[:, j] * down[e] @ swiglu(gate_up[e] @ x)`` with ``e = ids[:, j]``.

    ``gate_up [E, 2I, H]`` (gate rows first), ``down [E, H, I]``; accumulated in x's dtype, one
    expert at a time, as transformers does.
    """
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        token_idx, pos = torch.where(ids == expert)
        gate, up = F.linear(x[token_idx], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert]) * weights[token_idx, pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def route_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return route_topk_reference(logits, top_k)


def moe_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    return moe_experts_reference(x, gate_up, down, weights, ids)
