"""Top-k expert routing: fp32 softmax over experts, the top k, renormalised.

On CUDA a fused router kernel runs one program per token holding all E logits (E <= a few thousand fits
one block) and picks the top k by k rounds of max-and-exclude. On exact ties of the probabilities the
lower expert id wins (torch.topk's order on ties is unspecified).

Given the expert stack the routed pairs read first (the gate/up) and ``NINFER_ROUTE_PREFETCH=1``, a decode-sized
call (at most ``PREFETCH_MAX_TOKENS`` tokens) also asks the L2 for the chosen experts' bytes as it picks them:
more programs per token, each picking the same experts and sending ``prefetch.global.L2`` for its share of
their lines, so the expert GEMM after it finds them in the L2 (its codes' addresses depend on the ids, so it
cannot request them before it waits for this kernel).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import INTERPRET, route_prefetch, use_triton
from ninfer.kernels.pdl import l2_prefetch, pdl_enter, small_kernel_pdl
from ninfer.kernels.quant_gemm.weights import QuantizedTensor

PREFETCH_MAX_TOKENS = 4  # 4 x 8 experts' gate/up (8.4 MB each token for the 35B-A3B) stay well inside a 50 MB L2
PREFETCH_LINES_PER_LANE = 16  # programs per token: enough that each lane sends about this many prefetches


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
def _prefetch_experts(base_ptr, stride_e, nbytes, top_ids, LINES: tl.constexpr, TOP_K: tl.constexpr,
                      K_BLOCK: tl.constexpr):
    """This program's share of the chosen experts' bytes ``[e * stride_e, e * stride_e + nbytes)`` of the stack at
    ``base_ptr``: lane ``l`` of program ``p`` sends a ``prefetch.global.L2`` for lines ``(p * 32 + l) + j * 32 P``."""
    per_expert = (nbytes + 127) // 128
    lane = tl.arange(0, 32)
    slots = tl.arange(0, K_BLOCK)
    for j in tl.static_range(LINES):
        line = (tl.program_id(1) * 32 + lane + j * 32 * tl.num_programs(1)).to(tl.int64)
        slot = tl.minimum(line // per_expert, TOP_K - 1)  # past the last line: the last expert's, again
        expert = tl.sum(tl.where(slots[None, :] == slot[:, None], top_ids[None, :], 0), axis=1).to(tl.int64)
        offset = tl.minimum((line - slot * per_expert) * 128, nbytes - 1)
        l2_prefetch(base_ptr.to(tl.int64) + expert * stride_e + offset)


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_l, a_ptr, a_stride, a_bytes, b_ptr, b_stride, b_bytes,
                  TOP_K: tl.constexpr, K_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, LINES_A: tl.constexpr = 0,
                  LINES_B: tl.constexpr = 0, PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False):
    """Grid ``(tokens, programs per token)``: every program of a token picks its experts; the first stores them,
    each asks the L2 for its share of their bytes in the regions ``a`` and ``b`` (``LINES_*`` lines a lane; 0:
    none)."""
    pdl_enter(PDL_WAIT, PDL_TRIGGER)  # ninfer.kernels.pdl: the expert GEMM after it may launch now
    t = tl.program_id(0).to(tl.int64)
    weights, top_ids = top_k_of_row(logits_ptr, t, E, stride_l, TOP_K, K_BLOCK, E_BLOCK)
    slots = tl.arange(0, K_BLOCK)
    keep = (slots < TOP_K) & (tl.program_id(1) == 0)
    tl.store(w_ptr + t * TOP_K + slots, weights.to(w_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + t * TOP_K + slots, top_ids.to(ids_ptr.dtype.element_ty), mask=keep)
    if LINES_A > 0:
        _prefetch_experts(a_ptr, a_stride, a_bytes, top_ids, LINES_A, TOP_K, K_BLOCK)
    if LINES_B > 0:
        _prefetch_experts(b_ptr, b_stride, b_bytes, top_ids, LINES_B, TOP_K, K_BLOCK)


def _per_expert_regions(experts: torch.Tensor | QuantizedTensor) -> list[tuple[torch.Tensor, int, int]]:
    """``(tensor, bytes between experts, bytes of one expert)`` of each part of an expert stack (a float tensor, or a
    quantized stack's codes, scales, ...) whose experts lie whole and contiguous; at most two, largest first."""
    parts = experts.tensors.values() if isinstance(experts, QuantizedTensor) else [experts]
    regions = [(t, t.stride(0) * t.element_size(), t[0].numel() * t.element_size()) for t in parts
               if t.dim() >= 2 and t[0].is_contiguous() and t.numel() > 0]
    return sorted(regions, key=lambda r: -r[2])[:2]


def _prefetch_args(experts: torch.Tensor | QuantizedTensor | None, n: int, top_k: int, e: int,
                   dummy: torch.Tensor) -> tuple[int, list, dict[str, int]]:
    """(programs per token, the region arguments, their ``LINES_*``) of a routing call that prefetches ``experts``
    (none off CUDA's PTX, past ``PREFETCH_MAX_TOKENS``, without ``NINFER_ROUTE_PREFETCH=1`` or for a stack of
    another expert count)."""
    none = (1, [dummy, 0, 0, dummy, 0, 0], {})
    if experts is None or INTERPRET or n > PREFETCH_MAX_TOKENS or not route_prefetch() or experts.shape[0] != e:
        return none
    regions = _per_expert_regions(experts)
    if not regions:
        return none
    lines = [top_k * triton.cdiv(nbytes, 128) for _, _, nbytes in regions]
    programs = max(1, min(128, triton.cdiv(lines[0], 32 * PREFETCH_LINES_PER_LANE)))
    args, consts = [], {}
    for name, (tensor, stride, nbytes), count in zip("AB", regions + [(dummy, 0, 0)], lines + [0]):
        args += [tensor, stride, nbytes]
        consts[f"LINES_{name}"] = triton.cdiv(count, 32 * programs)
    return programs, args, consts


def route_topk_triton(logits: torch.Tensor, top_k: int,
                      experts: torch.Tensor | QuantizedTensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused :func:`route_topk_reference` for ``logits [N, E]``: weights ``[N, k]`` in the logits'
    dtype, ids ``[N, k]`` int64 (torch.topk's dtype). ``experts``: the stack ``[E, ...]`` the routed pairs read
    first, whose chosen experts a decode-sized call asks of the L2 with ``NINFER_ROUTE_PREFETCH=1``."""
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
    programs, regions, lines = _prefetch_args(experts, n, top_k, e, x)
    _route_kernel[(n, programs)](x, weights, ids, e, x.stride(0), *regions, TOP_K=top_k,
                                 K_BLOCK=triton.next_power_of_2(top_k), E_BLOCK=e_block, **lines, **pdl.constexprs(),
                                 **pdl.options(), num_warps=max(1, min(8, e_block // 256)))
    return weights, ids


def route_topk(logits: torch.Tensor, top_k: int,
               experts: torch.Tensor | QuantizedTensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing ``(weights, ids)`` of ``logits [N, E]`` (:func:`route_topk_reference` defines it). ``experts``:
    the expert stack the routed pairs read first (their gate/up), which the CUDA kernel may ask of the L2 for
    the experts it picks (:func:`route_topk_triton`)."""
    if use_triton(logits) and logits.dim() == 2:
        return route_topk_triton(logits, top_k, experts)
    return route_topk_reference(logits, top_k)
