"""The Qwen3.5 MoE feed-forward block: top-k routed experts plus a sigmoid-gated shared expert (§9)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ninfer.config import ModelConfig
from ninfer.kernels.moe import moe_experts, route_topk
from ninfer.models.fused import FusedRows, fuse_into, fused_of
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
        router_logits, shared_logit = self._router_and_shared_gate(x)
        weights, ids = route_topk(router_logits, self.top_k)
        routed = moe_experts(x, _stack(self.experts.gate_up_proj), _stack(self.experts.down_proj), weights, ids)
        return routed + torch.sigmoid(shared_logit) * self.shared_expert(x)

    def _router_and_shared_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits ``[T, E]`` and the shared expert's gate logit ``[T, 1]``.

        Both are small projections of the same ``x``; after :meth:`fuse_` they run on CUDA as one GEMM
        over their stacked ``[E + 1, H]`` rows (views of its output), which saves the 1-output GEMM's
        two launches per layer at decode (cuBLAS runs it as a dot and a reduce): ~0.2 ms of the
        35B-A3B batch-1 step's 4.8 ms, which is launch-bound. CPU runs (the reference path) keep two
        projections: a CPU GEMM's rounding of the gate column then depended on the number of rows, so
        chunked and one-pass prefills differed by 1.5e-5 in fp32."""
        fused = self.router_and_shared_gate if x.is_cuda else None
        if fused is None:
            return self.gate(x), self.shared_expert_gate(x)
        return fused(x).split(fused.sizes, dim=-1)

    @property
    def router_and_shared_gate(self) -> FusedRows | None:
        """``gate`` and ``shared_expert_gate`` as one projection (:mod:`ninfer.models.fused`), or None."""
        return fused_of(self, "_router")

    def fuse_(self) -> bool:
        """Fuse the router with the shared expert's gate (:func:`ninfer.models.fused.fuse_into`)."""
        return fuse_into(self, "_router", [self.gate, self.shared_expert_gate])
