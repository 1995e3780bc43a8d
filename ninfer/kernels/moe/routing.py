"""Top-k expert routing: fp32 softmax over experts, the top k, renormalised.

On CUDA a fused router kernel runs one program per token holding all E logits (E <= a few thousand fits
one block) and picks the top k by k rounds of max-and-exclude. On exact ties of the probabilities the
lower expert id wins (torch.topk's order on ties is unspecified).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import use_triton
from ninfer.kernels.pdl import pdl_enter, small_kernel_pdl


def route_topk_reference(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax over experts, top-k, renormalised; weights returned in the logits' dtype."""
    probs = logits.float().softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), ids


@triton.jit
def top_k_of_row(logits_ptr, t, E, stride_l, TOP_K: tl.constexpr, K_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr):
    """Row ``t``'s routing: ``(weights, ids)`` ``[K_BLOCK]`` (slots past TOP_K: 0), the weights renormalised in fp32
    (not yet rounded to the logits' dtype)."""
    experts = tl.arange(0, E_BLOCK)
    logit = tl.load(logits_ptr + t * stride_l + experts, mask=experts < E, other=float("-inf")).to(tl.float32)
    e = tl.exp(logit - tl.max(logit, axis=0))
    probs = e / tl.sum(e, axis=0)  # as the reference: probabilities first, then top-k, then renormalise
    probs = tl.where(experts < E, probs, -1.0)
    slots = tl.arange(0, K_BLOCK)
    top = tl.zeros((K_BLOCK,), dtype=tl.float32)
    top_ids = tl.zeros((K_BLOCK,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        pick = tl.min(tl.where(probs == best, experts, E_BLOCK), axis=0)  # lowest id among ties
        top = tl.where(slots == j, best, top)
        top_ids = tl.where(slots == j, pick, top_ids)
        probs = tl.where(experts == pick, -1.0, probs)  # probabilities are >= 0: never picked again
    return top / tl.sum(top, axis=0), top_ids


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_l, TOP_K: tl.constexpr, K_BLOCK: tl.constexpr,
                  E_BLOCK: tl.constexpr, PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False):
    pdl_enter(PDL_WAIT, PDL_TRIGGER)  # ninfer.kernels.pdl: the expert GEMM after it may launch now
    t = tl.program_id(0).to(tl.int64)
    weights, top_ids = top_k_of_row(logits_ptr, t, E, stride_l, TOP_K, K_BLOCK, E_BLOCK)
    slots = tl.arange(0, K_BLOCK)
    keep = slots < TOP_K
    tl.store(w_ptr + t * TOP_K + slots, weights.to(w_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + t * TOP_K + slots, top_ids.to(ids_ptr.dtype.element_ty), mask=keep)


def route_topk_triton(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused :func:`route_topk_reference` for ``logits [N, E]``: weights ``[N, k]`` in the logits'
    dtype, ids ``[N, k]`` int64 (torch.topk's dtype)."""
    n, e = logits.shape
    if not 0 < top_k <= e:
        raise ValueError(f"route_topk_triton needs 0 < top_k <= E = {e}, got {top_k}")
    weights = torch.empty(n, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    if n == 0:
        return weights, ids
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    e_block = triton.next_power_of_2(e)
    pdl = small_kernel_pdl(logits.device)
    _route_kernel[(n,)](x, weights, ids, e, x.stride(0), TOP_K=top_k, K_BLOCK=triton.next_power_of_2(top_k),
                        E_BLOCK=e_block, **pdl.constexprs(), **pdl.options(),
                        num_warps=max(1, min(8, e_block // 256)))
    return weights, ids


def route_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(logits) and logits.dim() == 2:
        return route_topk_triton(logits, top_k)
    return route_topk_reference(logits, top_k)
