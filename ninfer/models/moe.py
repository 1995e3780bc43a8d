"""The Qwen3.5 MoE feed-forward block: top-k routed experts plus a sigmoid-gated shared expert (§9)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ninfer.config import ModelConfig
from ninfer.kernels.moe import moe_experts, route_topk
from ninfer.models.layers import MLP, linear

if TYPE_CHECKING:
    from ninfer.quant.formats import QuantizedTensor
    from ninfer.quant.linear import QuantWeight


def _stack(w: torch.Tensor | QuantWeight) -> torch.Tensor | QuantizedTensor:
    """Stacked expert weights as the kernels take them: a float tensor, or the packed tensors of a
    quantized stack (read in place by the grouped GEMMs, never dequantized as a whole)."""
    return w if isinstance(w, torch.Tensor) else w.packed()


class Experts(nn.Module):
    """Expert weights stacked ``[E, ...]``: ``gate_up_proj [E, 2I, H]`` (gate rows first), ``down_proj [E, H, I]``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = linear(config.hidden_size, config.num_experts)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = linear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(self.gate(x), self.top_k)
        routed = moe_experts(x, _stack(self.experts.gate_up_proj), _stack(self.experts.down_proj), weights, ids)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared
