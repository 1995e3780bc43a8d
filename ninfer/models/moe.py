"""The Qwen3.5 MoE feed-forward block: top-k routed experts plus a sigmoid-gated shared expert (§9)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
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
        self._stacked_key: tuple | None = None  # the weights the stacked router / gate weight was built from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits, shared_logit = self._router_and_shared_gate(x)
        weights, ids = route_topk(router_logits, self.top_k)
        routed = moe_experts(x, _stack(self.experts.gate_up_proj), _stack(self.experts.down_proj), weights, ids)
        return routed + torch.sigmoid(shared_logit) * self.shared_expert(x)

    def _router_and_shared_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits ``[T, E]`` and the shared expert's gate logit ``[T, 1]``.

        Both are small projections of the same ``x``; with plain float weights they run as one GEMM
        over the stacked ``[E + 1, H]`` weight (views of its output), which saves the 1-output GEMM's
        two launches per layer at decode (cuBLAS runs it as a dot and a reduce): ~0.2 ms of the
        35B-A3B batch-1 step's 4.8 ms, which is launch-bound. The stack is rebuilt when either
        weight changes (loading, conversion); quantized weights keep two projections, and so do CPU
        runs (the reference path): a CPU GEMM's rounding of the gate column then depended on the
        number of rows, so chunked and one-pass prefills differed by 1.5e-5 in fp32."""
        if not (x.is_cuda and type(self.gate) is nn.Linear and type(self.shared_expert_gate) is nn.Linear
                and self.gate.weight.dtype == self.shared_expert_gate.weight.dtype):
            return self.gate(x), self.shared_expert_gate(x)
        gate, shared_gate = self.gate.weight, self.shared_expert_gate.weight
        key = (gate.data_ptr(), gate._version, shared_gate.data_ptr(), shared_gate._version, gate.device)
        if self._stacked_key != key:
            with torch.no_grad():
                self._stacked = torch.cat([gate, shared_gate]).detach()
            self._stacked_key = key
        both = F.linear(x, self._stacked)
        experts = gate.shape[0]
        return both[:, :experts], both[:, experts:]
