"""The Qwen3.5 MoE feed-forward block: top-k routed experts plus a sigmoid-gated shared expert (§9)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.config import ModelConfig
from ninfer.kernels.dispatch import deferred_norm_in_moe
from ninfer.kernels.moe import moe_experts, moe_experts_then_norm, route_topk
from ninfer.kernels.overlap import overlapped
from ninfer.kernels.norms import NormedRows
from ninfer.models.layers import MLP, FusedRows, RMSNorm, linear, reads_deferred_norm

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
    """Top-k routed experts plus the shared expert, scaled by ``sigmoid`` of its gate logit."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, config.num_experts
        # The router (the checkpoint's ``gate``, E rows) and the shared expert's 1-row gate read the
        # same x: as one GEMM they save the 1-output GEMM's two launches per layer at decode (cuBLAS
        # runs it as a dot and a reduce), ~0.2 ms of the 35B-A3B batch-1 step's 4.8 ms.
        self.router = linear(config.hidden_size, config.num_experts + 1)
        self.fused_rows: FusedRows = {"router": (("gate", config.num_experts), ("shared_expert_gate", 1))}
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return moe_experts(x, *self._routed(x))

    def forward_then_norm(self, x: torch.Tensor | NormedRows, norm: RMSNorm, residual: torch.Tensor | None,
                          defer: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm(self(x), residual)``, the norm applied by the combine in its own launch on CUDA (never deferred:
        ``defer`` is the readers' offer, which this block declines). ``x`` may come with its norm deferred: the
        router, the shared expert and the routed experts' gate/up normalize it."""
        if isinstance(x, NormedRows) and not x.is_cuda:  # the CPU reference paths take plain rows
            x = x.materialize()
        return moe_experts_then_norm(x, *self._routed(x), norm.weight, norm.eps, residual)

    @property
    def reads_deferred_norm(self) -> bool:
        """The router (the float GEMV or a quantized GEMM), the shared expert and quantized routed experts (their
        GEMV and register decode) can normalize deferred rows themselves; the block takes them only where
        ``NINFER_DEFERRED_NORM_MOE=1`` asks (:func:`~ninfer.kernels.dispatch.deferred_norm_in_moe`: slower so far)."""
        return (deferred_norm_in_moe() and reads_deferred_norm(self.router) and self.shared_expert.reads_deferred_norm
                and not isinstance(self.experts.gate_up_proj, torch.Tensor))

    def _routed(self, x: torch.Tensor) -> tuple:
        """The experts' arguments after ``x``: stacks, routing weights and ids, the shared expert."""
        # The shared expert does not depend on the routing: in a captured decode step it runs on a second stream,
        # beside the router, the top-k and the routed experts, until the combine waits for it.
        shared_out = overlapped(lambda: self.shared_expert(x), x)
        router_logits, shared_logit = self._router_logits(x)
        gate_up = _stack(self.experts.gate_up_proj)
        weights, ids = route_topk(router_logits, self.top_k, experts=gate_up)  # the stack its pairs read first
        shared = (shared_out, shared_logit)  # routed + sigmoid(logit) * shared, summed by the combine
        return gate_up, _stack(self.experts.down_proj), weights, ids, shared

    def _router_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits ``[T, E]`` and the shared expert's gate logit ``[T, 1]``: on CUDA one GEMM over
        the stacked rows. The CPU reference runs two GEMMs over row views of the same float weight: a CPU
        GEMM rounds the gate column differently with the number of rows, so chunked and one-pass prefills
        differed by 1.5e-5 in fp32."""
        if x.is_cuda or not isinstance(self.router, nn.Linear):
            return self.router(x).split([self.num_experts, 1], dim=-1)
        weight = self.router.weight
        return F.linear(x, weight[:self.num_experts]), F.linear(x, weight[self.num_experts:])
