"""The attention prologue in one launch: per-head q/k RMSNorm and partial RoPE, with k and v stored straight
into the paged cache (reference §6-§7).

Unfused it is two launches per attention layer: :func:`~ninfer.kernels.rope.qk_norm_rope` (q and k) and
:func:`~ninfer.kernels.attention.write_kv` (k and v into their slots). Here the programs of one grid take, in
order, rows ``(token, head)`` of q (normalised and rotated into a new tensor), of k (normalised and rotated
into the cache at the token's slot) and of v (copied into the cache). The arithmetic is the rope kernel's
(:func:`~ninfer.kernels.rope.norm_rope_tile`), so q and the cached k equal the unfused path's bit for bit.

Quantised caches (fp8 / int8 codes with per-group scales) keep the two launches: their scales are a reduction
over each token's heads, which the row tiles here do not hold.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.attention.dispatch import write_kv
from ninfer.kernels.attention.paged import PagedKV
from ninfer.kernels.dispatch import fused_prologue, use_triton
from ninfer.kernels.rope import norm_rope_rows, norm_rope_tile, qk_norm_rope
from ninfer.kernels.rowwise import row_block_config


@triton.jit
def _slot_rows(rows, row_mask, heads, slot_ptr, s_page, s_slot, s_head, PAGE_SIZE: tl.constexpr):
    """``[BLOCK_R, 1]`` cache offsets of rows ``(token, head)``: the token's slot, then the head."""
    tok = (rows // heads).to(tl.int64)
    slot = tl.load(slot_ptr + tok, mask=row_mask, other=0).to(tl.int64)
    return ((slot // PAGE_SIZE) * s_page + (slot % PAGE_SIZE) * s_slot + (rows % heads).to(tl.int64) * s_head)[:, None]


@triton.jit
def _prologue_kernel(
    q_ptr, qw_ptr, q_out_ptr, k_ptr, kw_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, cos_ptr, sin_ptr,
    q_rows, q_heads, q_programs, kv_rows, kv_heads, kv_programs, D, ROT, eps,
    sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, s_cos, s_sin, s_page, s_slot, s_head,
    PAGE_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < q_programs:
        norm_rope_rows(q_ptr, qw_ptr, cos_ptr, sin_ptr, q_out_ptr, pid, q_rows, q_heads, D, ROT, eps, sq_n, sq_h,
                       s_cos, s_sin, True, BLOCK_R, BLOCK_D, BLOCK_H)
    elif pid < q_programs + kv_programs:
        rows = (pid - q_programs) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = rows < kv_rows
        tok = (rows // kv_heads).to(tl.int64)
        x_row = (tok * sk_n + (rows % kv_heads).to(tl.int64) * sk_h)[:, None]
        out_row = _slot_rows(rows, mask, kv_heads, slot_ptr, s_page, s_slot, s_head, PAGE_SIZE)
        norm_rope_tile(k_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, x_row, out_row, tok, mask, D, ROT, eps, s_cos, s_sin,
                       True, BLOCK_D, BLOCK_H)
    else:
        rows = (pid - q_programs - kv_programs) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = rows < kv_rows
        tok = (rows // kv_heads).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)[None, :]
        in_row = mask[:, None] & (cols < D)
        x = tl.load(v_ptr + (tok * sv_n + (rows % kv_heads).to(tl.int64) * sv_h)[:, None] + cols, mask=in_row)
        out_row = _slot_rows(rows, mask, kv_heads, slot_ptr, s_page, s_slot, s_head, PAGE_SIZE)
        tl.store(vc_ptr + out_row + cols, x.to(vc_ptr.dtype.element_ty), mask=in_row)


def fits(q: torch.Tensor, cos: torch.Tensor, kv: PagedKV) -> bool:
    """Whether the one-launch prologue can write ``kv``: an unquantised cache in the dtype the unfused path
    rounds q and k to."""
    return kv.quant is None and kv.k.dtype == torch.promote_types(q.dtype, cos.dtype)


def qk_norm_rope_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, eps: float, kv: PagedKV, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """``q [N, hq, dh]`` normalised and rotated (returned, new tensor); ``k`` the same and ``v`` as is, both
    ``[N, hk, dh]``, stored at flat token slots ``slot_mapping [N]`` of ``kv``. One launch on Triton tensors where
    :func:`fits` holds and :func:`~ninfer.kernels.dispatch.fused_prologue` is on, else
    :func:`~ninfer.kernels.rope.qk_norm_rope` then :func:`~ninfer.kernels.attention.write_kv`."""
    if use_triton(q) and fused_prologue() and fits(q, cos, kv):
        return qk_norm_rope_write_kv_triton(q, k, v, q_weight, k_weight, cos, sin, eps, kv, slot_mapping)
    q, k = qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps)
    write_kv(k, v, kv, slot_mapping)
    return q


def qk_norm_rope_write_kv_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, eps: float, kv: PagedKV, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """The one launch of :func:`qk_norm_rope_write_kv` (``kv`` must satisfy :func:`fits`)."""
    if not fits(q, cos, kv):
        raise ValueError(f"the fused prologue writes unquantised caches in the q/k dtype, not {kv.k.dtype}")
    n, q_heads, d = q.shape
    kv_heads = k.shape[1]
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv.k.is_contiguous() and kv.v.is_contiguous()
    q, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, cos, sin))
    q_out = torch.empty(q.shape, dtype=torch.promote_types(q.dtype, cos.dtype), device=q.device)
    if n == 0:
        return q_out
    rot = cos.shape[-1]
    block_r, block_d, _, num_warps = row_block_config(d, n * q_heads, max(2048, triton.next_power_of_2(d)))
    q_programs, kv_programs = triton.cdiv(n * q_heads, block_r), triton.cdiv(n * kv_heads, block_r)
    _prologue_kernel[(q_programs + 2 * kv_programs,)](
        q, q_weight.contiguous(), q_out, k, k_weight.contiguous(), v, kv.k, kv.v, slot_mapping, cos, sin,
        n * q_heads, q_heads, q_programs, n * kv_heads, kv_heads, kv_programs, d, rot, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        kv.k.stride(0), kv.k.stride(1), kv.k.stride(2),
        PAGE_SIZE=kv.page_size, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_H=triton.next_power_of_2(max(rot // 2, 1)),
        num_warps=num_warps,
    )
    return q_out
