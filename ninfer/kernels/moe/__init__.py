"""Mixture-of-experts ops: top-k routing (:mod:`.routing`) and the routed experts (:mod:`.dispatch`).

Modules, bottom up: ``align`` (routed pairs grouped by expert), the grouped expert GEMMs ``gemm`` (float
stacks; it hands quantized stacks to ``quant_gemm``), ``quant_gemm`` (``tl.dot``) and ``quant_gemv``
(decode GEMV, reusing :mod:`ninfer.kernels.quant_gemm`'s pieces), ``routing`` and ``dispatch``.
"""
from ninfer.kernels.moe.dispatch import moe_experts, moe_experts_reference, moe_experts_then_norm
from ninfer.kernels.moe.gemm import Weight, moe_experts_triton
from ninfer.kernels.moe.routing import route_topk, route_topk_reference, route_topk_triton

__all__ = ["Weight", "moe_experts", "moe_experts_reference", "moe_experts_then_norm", "moe_experts_triton",
           "route_topk",
           "route_topk_reference", "route_topk_triton"]
