"""Top-k expert routing: fp32 softmax over experts, the top k, renormalised.

On CUDA a fused router kernel runs one program per token holding all E logits (E <= a few thousand fits
one block) and picks the top k by k rounds of max-and-exclude. On exact ties of the probabilities the
lower expert id wins (torch.topk's order on ties is unspecified).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer.kernels.counters import arrival_counters
from ninfer.kernels.dispatch import use_triton
from ninfer.kernels.quant_gemm.common import dot

# The fused router (GEMV + top-k in one launch) at decode sizes: up to 8 tokens, always routed as 8 (one compiled
# variant, which the first decode graph's capture compiles, so that no batch meets a new one after start-up),
# programs of 16 rows x a split of H, about 64 of them (for 257 x 2048: 17 row blocks x 4 splits).
ROUTER_MAX_TOKENS = 8
ROUTER_BLOCK_R, ROUTER_BLOCK_H, ROUTER_PROGRAMS = 16, 128, 64
_IEEE_OR_MMA = (torch.float32, torch.float16, torch.bfloat16)


def route_topk_reference(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax over experts, top-k, renormalised; weights returned in the logits' dtype."""
    probs = logits.float().softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), ids


@triton.jit
def _top_k_rows(logit, experts, E, BLOCK_T: tl.constexpr, TOP_K: tl.constexpr, K_BLOCK: tl.constexpr,
                E_BLOCK: tl.constexpr):
    """Routing of ``BLOCK_T`` tokens at once: ``logit [BLOCK_T, E_BLOCK]`` fp32 (-inf past ``E``) -> the top-k
    renormalised probabilities and their expert ids, ``[BLOCK_T, K_BLOCK]`` (slots past ``TOP_K`` unused)."""
    e = tl.exp(logit - tl.max(logit, axis=1)[:, None])
    probs = e / tl.sum(e, axis=1)[:, None]  # as the reference: probabilities first, then top-k, then renormalise
    probs = tl.where(experts[None, :] < E, probs, -1.0)
    slots = tl.arange(0, K_BLOCK)[None, :]
    top = tl.zeros((BLOCK_T, K_BLOCK), dtype=tl.float32)
    top_ids = tl.zeros((BLOCK_T, K_BLOCK), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)[:, None]
        pick = tl.min(tl.where(probs == best, experts[None, :], E_BLOCK), axis=1)[:, None]  # lowest id among ties
        top = tl.where(slots == j, best, top)
        top_ids = tl.where(slots == j, pick, top_ids)
        probs = tl.where(experts[None, :] == pick, -1.0, probs)  # probabilities are >= 0: never picked again
    return top / tl.sum(top, axis=1)[:, None], top_ids


@triton.jit
def _store_routes(w_ptr, ids_ptr, toks, n, top, top_ids, TOP_K: tl.constexpr, K_BLOCK: tl.constexpr):
    slots = tl.arange(0, K_BLOCK)[None, :]
    keep = (toks[:, None] < n) & (slots < TOP_K)
    tl.store(w_ptr + toks[:, None] * TOP_K + slots, top.to(w_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + toks[:, None] * TOP_K + slots, top_ids.to(ids_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, N, E, stride_l, TOP_K: tl.constexpr, K_BLOCK: tl.constexpr,
                  E_BLOCK: tl.constexpr):
    toks = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # one token per program
    experts = tl.arange(0, E_BLOCK)
    logit = tl.load(logits_ptr + toks[:, None] * stride_l + experts[None, :], mask=experts[None, :] < E,
                    other=float("-inf")).to(tl.float32)
    top, top_ids = _top_k_rows(logit, experts, E, 1, TOP_K, K_BLOCK, E_BLOCK)
    _store_routes(w_ptr, ids_ptr, toks, N, top, top_ids, TOP_K, K_BLOCK)


@triton.jit
def _final_logits(part_ptr, logits_ptr, toks, cols, n_cols, N, R, plane, splits):
    """Logits ``(toks, cols < n_cols)`` (rows of ``R``) from the splits' fp32 partials, summed in split order
    (deterministic; ``.cg``: other SMs wrote them during this launch), rounded to the logits' dtype as the router
    GEMM's output, stored."""
    at = toks[:, None] * R + cols[None, :]
    inside = cols[None, :] < n_cols
    logit = tl.load(part_ptr + at, mask=inside, other=0.0, cache_modifier=".cg")
    for s in range(1, splits):
        logit += tl.load(part_ptr + s * plane + at, mask=inside, other=0.0, cache_modifier=".cg")
    logit = logit.to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + at, logit, mask=(toks[:, None] < N) & inside)
    return logit.to(tl.float32)


@triton.jit
def _router_kernel(x_ptr, w_ptr, part_ptr, logits_ptr, rw_ptr, ids_ptr, cnt_ptr, N, R, E, H, stride_x, stride_w,
                   IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                   TOP_K: tl.constexpr, K_BLOCK: tl.constexpr, T_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
                   X_BLOCK: tl.constexpr):
    """Program (row block, split of H): fp32 partial logits of every token for its rows (``BLOCK_T`` >= 16 for
    the MMA); the last program to arrive finishes the logits of the ``N <= T_BLOCK`` tokens, routes them over the
    ``E`` experts' columns, and finishes the ``R - E <= X_BLOCK`` columns after them."""
    pid_r, pid_s = tl.program_id(0), tl.program_id(1)
    toks = tl.arange(0, BLOCK_T)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    span = tl.cdiv(tl.cdiv(H, tl.num_programs(1)), BLOCK_H) * BLOCK_H
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for h0 in range(pid_s * span, tl.minimum(H, (pid_s + 1) * span), BLOCK_H):
        c = h0 + cols
        xs = tl.load(x_ptr + toks[:, None] * stride_x + c[None, :], mask=(toks[:, None] < N) & (c[None, :] < H),
                     other=0.0)
        ws = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + c[None, :],
                     mask=(rows[:, None] < R) & (c[None, :] < H), other=0.0).to(xs.dtype)
        acc = dot(xs, tl.trans(ws), acc, IEEE)
    plane = T_BLOCK * R  # partials of the first T_BLOCK tokens only: the others are padding
    tl.store(part_ptr + pid_s * plane + toks[:, None] * R + rows[None, :], acc,
             mask=(toks[:, None] < T_BLOCK) & (rows[None, :] < R))
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.debug_barrier()
        splits = tl.num_programs(1)
        routed = tl.arange(0, T_BLOCK)  # the tokens routed (a new name: a branch may not reshape ``toks``)
        experts = tl.arange(0, E_BLOCK)
        logit = _final_logits(part_ptr, logits_ptr, routed, experts, E, N, R, plane, splits)
        logit = tl.where(experts[None, :] < E, logit, float("-inf"))
        top, top_ids = _top_k_rows(logit, experts, E, T_BLOCK, TOP_K, K_BLOCK, E_BLOCK)
        _store_routes(rw_ptr, ids_ptr, routed, N, top, top_ids, TOP_K, K_BLOCK)
        if R > E:  # the rows read beside the experts' (the shared expert's gate)
            _final_logits(part_ptr + E, logits_ptr + E, routed, tl.arange(0, X_BLOCK), R - E, N, R, plane, splits)
        tl.store(cnt_ptr, 0)  # the next launch (or graph replay) counts from zero


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
    _route_kernel[(n,)](x, weights, ids, n, e, x.stride(0), TOP_K=top_k, K_BLOCK=triton.next_power_of_2(top_k),
                        E_BLOCK=e_block, num_warps=max(1, min(8, e_block // 256)))
    return weights, ids


def router_topk_reference(x: torch.Tensor, weight: torch.Tensor, top_k: int, num_experts: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router GEMM ``logits = x @ weight^T`` (in x's dtype; ``weight [R, H]``, R >= ``num_experts``: the
    experts' rows first, then any rows read beside them, such as a shared expert's gate), then
    :func:`route_topk_reference` over the experts' columns. Returns (weights, ids, logits ``[N, R]``)."""
    logits = F.linear(x, weight.to(x.dtype))
    weights, ids = route_topk_reference(logits[:, :num_experts], top_k)
    return weights, ids, logits


def router_topk_applies(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether :func:`router_topk_triton` takes ``x`` and ``weight``: CUDA, at most ``ROUTER_MAX_TOKENS`` rows (decode
    steps, speculative verification), a float weight, arrival counters at hand (not a first use inside a capture),
    ``NINFER_FUSED_ROUTER`` not ``0`` (read per call: the router GEMM, then the top-k kernel)."""
    return (os.environ.get("NINFER_FUSED_ROUTER", "1") != "0" and weight is not None and use_triton(x) and x.dim() == 2 and x.shape[0] <= ROUTER_MAX_TOKENS
            and x.dtype in _IEEE_OR_MMA and weight.dtype in _IEEE_OR_MMA and weight.dim() == 2
            and arrival_counters(x.device) is not None)


def router_topk_triton(x: torch.Tensor, weight: torch.Tensor, top_k: int, num_experts: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`router_topk_reference` in one launch: the GEMV's programs each take a block of rows and a split of
    H; the last to arrive sums the splits, rounds the logits to x's dtype and routes every token (weights in x's
    dtype, ids int64). Rows past the experts' (the shared expert's gate) come back in the logits only."""
    n, h = x.shape
    r = weight.shape[0]
    if weight.shape[1] != h or not 0 < top_k <= num_experts <= r:
        raise ValueError(f"router weight {list(weight.shape)} does not fit x {list(x.shape)}, "
                         f"top_k {top_k} and {num_experts} experts")
    if n > ROUTER_MAX_TOKENS:
        raise ValueError(f"router_topk_triton takes at most {ROUTER_MAX_TOKENS} tokens, got {n}")
    weights = torch.empty(n, top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=x.device)
    logits = torch.empty(n, r, dtype=x.dtype, device=x.device)
    if n == 0:
        return weights, ids, logits
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    t_block = ROUTER_MAX_TOKENS
    row_blocks = triton.cdiv(r, ROUTER_BLOCK_R)
    splits = max(1, min(triton.cdiv(h, ROUTER_BLOCK_H), ROUTER_PROGRAMS // row_blocks))
    partials = torch.empty(splits, t_block, r, dtype=torch.float32, device=x.device)
    _router_kernel[(row_blocks, splits)](
        x, weight, partials, logits, weights, ids, arrival_counters(x.device), n, r, num_experts, h, x.stride(0),
        weight.stride(0), IEEE=x.dtype == torch.float32, BLOCK_T=max(16, t_block),  # tl.dot takes 16 rows at least
        BLOCK_R=ROUTER_BLOCK_R, BLOCK_H=ROUTER_BLOCK_H, TOP_K=top_k, K_BLOCK=triton.next_power_of_2(top_k),
        T_BLOCK=t_block, E_BLOCK=triton.next_power_of_2(num_experts),
        X_BLOCK=triton.next_power_of_2(max(1, r - num_experts)), num_warps=4)
    return weights, ids, logits


def router_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(routing weights, expert ids, logits): :func:`router_topk_triton` where it applies, else the reference."""
    if router_topk_applies(x, weight):
        return router_topk_triton(x, weight, top_k, num_experts)
    return router_topk_reference(x, weight, top_k, num_experts)


def route_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(logits) and logits.dim() == 2:
        return route_topk_triton(logits, top_k)
    return route_topk_reference(logits, top_k)
