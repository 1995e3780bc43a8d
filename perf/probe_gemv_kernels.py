"""The kernel variants of ``perf/probe_gemv_layout.py`` (diagnostics, not shipped): a streaming-only read of the
packed weights, the shipped tensor-core decode over a tile-contiguous layout, as rank-3 (per-warp) dots, with
parts of its work taken out (ablations). Each launcher follows ``launch_gemv_mma``'s split-K plan
(:func:`split_plan`); CPU checks run them in the interpreter. The register-only variants (``dp4a``, the
register-fragment decode) are in ``probe_gemv_registers.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.quant_gemm.gemv import tile_counters
from ninfer.kernels.quant_gemm.gemv_mma import _codes, _step_scales
from ninfer.kernels.quant_gemm.gemv_steps import gemv_epilogue
from ninfer.kernels.quant_gemm.tune import GemmConfig

GROUP = 128
_ASM = tl.constexpr(not INTERPRET)  # inline PTX on the GPU; the interpreter decodes with bit operations


@triton.jit
def _stream_kernel(q_ptr, out_ptr, N, KW, kw_per_split, TILED: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_KW: tl.constexpr, UNROLL: tl.constexpr):
    """xor of the int32 words of rows ``[pid_n * BLOCK_N, +BLOCK_N)`` over this split's K range."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_KW)
    acc = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.int32)
    k_first = pid_s * kw_per_split
    for kw in range(k_first, k_first + kw_per_split, BLOCK_KW * UNROLL):
        for u in tl.static_range(UNROLL):
            k = kw + u * BLOCK_KW
            if TILED:
                base = (pid_n.to(tl.int64) * (KW // BLOCK_KW) + k // BLOCK_KW) * (BLOCK_N * BLOCK_KW)
                ptrs = q_ptr + base + tl.arange(0, BLOCK_N)[:, None] * BLOCK_KW + cols[None, :]
            else:
                ptrs = q_ptr + rows.to(tl.int64)[:, None] * KW + (k + cols)[None, :]
            acc ^= tl.load(ptrs)
    tl.store(out_ptr + pid_s * N + rows, tl.xor_sum(acc, axis=1))


@triton.jit
def _tile_offsets(rows, kg, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """Byte offsets of ``[rows, kg/2 : kg/2 + GROUP/2)`` in the tile-contiguous layout."""
    tile = (rows // BLOCK_N).to(tl.int64) * (K // BLOCK_K) + kg // BLOCK_K
    inner = (rows % BLOCK_N)[:, None] * (BLOCK_K // 2) + ((kg % BLOCK_K) // 2 + tl.arange(0, GROUP // 2))[None, :]
    return tile[:, None] * (BLOCK_N * BLOCK_K // 2) + inner


@triton.jit
def _group_dot_tiles(acc, q_ptr, rows, kg, K, xe, xo, scales, g: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    packed = tl.load(q_ptr + _tile_offsets(rows, kg, K, BLOCK_N, BLOCK_K, GROUP))
    part = tl.dot(_codes(packed, False, xe.dtype, ASM), xe)
    part = tl.dot(_codes(packed, True, xe.dtype, ASM), xo, part)
    column = tl.arange(0, scales.shape[1])[None, :] == g
    return acc + part * tl.sum(tl.where(column, scales, 0.0), axis=1)[:, None]


@triton.jit(do_not_specialize=["M", "k_per_split"])
def _mma_tiles_kernel(x_ptr, q_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N_OUT, K, k_per_split, stride_xm, stride_sn,
                      stride_om, GROUP: tl.constexpr, SWIGLU: tl.constexpr, SPLIT: tl.constexpr,
                      FUSED_REDUCE: tl.constexpr, TOKENS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """``gemv_mma``'s kernel (no residual) over the tile-contiguous layout."""
    pid_s = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(2) * TOKENS + tl.arange(0, TOKENS)
    rows = offs_n
    xrows = tl.minimum(offs_m, M - 1)
    acc = tl.zeros((BLOCK_N, TOKENS), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, TOKENS), dtype=tl.float32)
    k_first = pid_s * (k_per_split // BLOCK_K) * BLOCK_K
    k_last = tl.minimum(k_first + k_per_split, K)
    x_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + xrows.to(tl.int64)[None, :] * (stride_xm // 2)
    up_rows = rows + N_OUT
    scales = _step_scales(s_ptr, rows, k_first, stride_sn, GROUP, BLOCK_K)
    scales_up = _step_scales(s_ptr, up_rows, k_first, stride_sn, GROUP, BLOCK_K) if SWIGLU else scales
    for k0 in range(k_first, k_last, BLOCK_K):
        k_next = tl.minimum(k0 + BLOCK_K, k_last - BLOCK_K)
        scales_next = _step_scales(s_ptr, rows, k_next, stride_sn, GROUP, BLOCK_K)
        scales_up_next = _step_scales(s_ptr, up_rows, k_next, stride_sn, GROUP, BLOCK_K) if SWIGLU else scales_next
        for g in tl.static_range(BLOCK_K // GROUP):
            kg = k0 + g * GROUP
            pairs = tl.load(x_words + (kg // 2 + tl.arange(0, GROUP // 2))[:, None])
            xe = (pairs & 0xFFFF).to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True)
            xo = (pairs >> 16).to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True)
            acc = _group_dot_tiles(acc, q_ptr, rows, kg, K, xe, xo, scales, g, GROUP, BLOCK_N, BLOCK_K, ASM)
            if SWIGLU:
                acc_up = _group_dot_tiles(acc_up, q_ptr, up_rows, kg, K, xe, xo, scales_up, g, GROUP, BLOCK_N,
                                          BLOCK_K, ASM)
        scales = scales_next
        scales_up = scales_up_next
    mask = (offs_n < N_OUT)[:, None] & (offs_m < M)[None, :]
    gemv_epilogue(acc, acc_up, pid_s, offs_m, offs_n, mask, M, N_OUT, ws_ptr, cnt_ptr, out_ptr, stride_om, out_ptr,
                  stride_om, SPLIT, FUSED_REDUCE, SWIGLU, False, BLOCK_N, TOKENS)


@triton.jit
def _group_dot_3d(acc, q_ptr, rows, kg, K, stride_qn, xe, xo, scales, g: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W: tl.constexpr, TILED: tl.constexpr,
                  ASM: tl.constexpr):
    """:func:`_group_dot_tiles` as a batched dot over ``W`` row slices: Triton keeps rank-3 dots on
    ``mma.sync`` and gives each warp its own slice, so a program can have 4-8 warps without wgmma."""
    if TILED:
        offs = _tile_offsets(rows, kg, K, BLOCK_N, BLOCK_K, GROUP)
    else:
        offs = rows.to(tl.int64)[:, None] * stride_qn + (kg // 2 + tl.arange(0, GROUP // 2))[None, :]
    packed = tl.reshape(tl.load(q_ptr + offs), (W, BLOCK_N // W, GROUP // 2))
    xe3 = tl.broadcast_to(xe[None, :, :], (W, GROUP // 2, xe.shape[1]))
    xo3 = tl.broadcast_to(xo[None, :, :], (W, GROUP // 2, xo.shape[1]))
    part = tl.dot(_codes(packed, False, xe.dtype, ASM), xe3)
    part = tl.dot(_codes(packed, True, xe.dtype, ASM), xo3, part)
    column = tl.arange(0, scales.shape[1])[None, :] == g
    scale = tl.reshape(tl.sum(tl.where(column, scales, 0.0), axis=1), (W, BLOCK_N // W, 1))
    return acc + part * scale


@triton.jit(do_not_specialize=["M", "k_per_split"])
def _mma3d_kernel(x_ptr, q_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N_OUT, K, k_per_split, stride_xm, stride_qn,
                  stride_sn, stride_om, GROUP: tl.constexpr, SWIGLU: tl.constexpr, SPLIT: tl.constexpr,
                  FUSED_REDUCE: tl.constexpr, TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  W: tl.constexpr, TILED: tl.constexpr, ASM: tl.constexpr):
    pid_s = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(2) * TOKENS + tl.arange(0, TOKENS)
    rows = offs_n
    xrows = tl.minimum(offs_m, M - 1)
    acc = tl.zeros((W, BLOCK_N // W, TOKENS), dtype=tl.float32)
    acc_up = tl.zeros((W, BLOCK_N // W, TOKENS), dtype=tl.float32)
    k_first = pid_s * (k_per_split // BLOCK_K) * BLOCK_K
    k_last = tl.minimum(k_first + k_per_split, K)
    x_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + xrows.to(tl.int64)[None, :] * (stride_xm // 2)
    up_rows = rows + N_OUT
    scales = _step_scales(s_ptr, rows, k_first, stride_sn, GROUP, BLOCK_K)
    scales_up = _step_scales(s_ptr, up_rows, k_first, stride_sn, GROUP, BLOCK_K) if SWIGLU else scales
    for k0 in range(k_first, k_last, BLOCK_K):
        k_next = tl.minimum(k0 + BLOCK_K, k_last - BLOCK_K)
        scales_next = _step_scales(s_ptr, rows, k_next, stride_sn, GROUP, BLOCK_K)
        scales_up_next = _step_scales(s_ptr, up_rows, k_next, stride_sn, GROUP, BLOCK_K) if SWIGLU else scales_next
        for g in tl.static_range(BLOCK_K // GROUP):
            kg = k0 + g * GROUP
            pairs = tl.load(x_words + (kg // 2 + tl.arange(0, GROUP // 2))[:, None])
            xe = (pairs & 0xFFFF).to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True)
            xo = (pairs >> 16).to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True)
            acc = _group_dot_3d(acc, q_ptr, rows, kg, K, stride_qn, xe, xo, scales, g, GROUP, BLOCK_N, BLOCK_K, W,
                                TILED, ASM)
            if SWIGLU:
                acc_up = _group_dot_3d(acc_up, q_ptr, up_rows, kg, K, stride_qn, xe, xo, scales_up, g, GROUP,
                                       BLOCK_N, BLOCK_K, W, TILED, ASM)
        scales = scales_next
        scales_up = scales_up_next
    mask = (offs_n < N_OUT)[:, None] & (offs_m < M)[None, :]
    gemv_epilogue(tl.reshape(acc, (BLOCK_N, TOKENS)), tl.reshape(acc_up, (BLOCK_N, TOKENS)), pid_s, offs_m, offs_n,
                  mask, M, N_OUT, ws_ptr, cnt_ptr, out_ptr, stride_om, out_ptr, stride_om, SPLIT, FUSED_REDUCE, SWIGLU,
                  False, BLOCK_N, TOKENS)


def split_plan(x: torch.Tensor, out: torch.Tensor, swiglu: bool, cfg: GemmConfig):
    """``launch_gemv_mma``'s split-K plan: (splits, K per split, fp32 scratch, grid, arrival counters)."""
    m, k = x.shape
    n_out = out.shape[1]
    k_steps = k // cfg.block_k
    per_split = triton.cdiv(k_steps, cfg.split_k)
    splits = triton.cdiv(k_steps, per_split)
    ws = torch.empty(splits, m, n_out * (2 if swiglu else 1), dtype=torch.float32, device=x.device) \
        if splits > 1 else out
    grid = (triton.cdiv(n_out, cfg.block_n), splits, triton.cdiv(m, cfg.block_m))
    counters = tile_counters(x.device, grid[0] * grid[2]) if splits > 1 else None
    return splits, per_split * cfg.block_k, ws, grid, counters


def launch_3d(x, q, scales, out, swiglu: bool, cfg: GemmConfig, tiled: bool) -> None:
    m, k = x.shape
    splits, k_per_split, ws, grid, counters = split_plan(x, out, swiglu, cfg)
    _mma3d_kernel[grid](x, q, scales, out, ws, counters, m, out.shape[1], k, k_per_split, x.stride(0),
                        q.stride(0), scales.stride(0), out.stride(0), GROUP=GROUP, SWIGLU=swiglu, SPLIT=splits > 1,
                        FUSED_REDUCE=counters is not None, TOKENS=cfg.block_m, BLOCK_N=cfg.block_n,
                        BLOCK_K=cfg.block_k, W=cfg.num_warps, TILED=tiled, ASM=not INTERPRET,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@triton.jit
def _group_dot_ablate(acc, q_ptr, rows, kg, stride_qn, xe, xo, scales, g: tl.constexpr, GROUP: tl.constexpr,
                      ABLATE: tl.constexpr):
    """``_group_dot`` of the shipped kernel with one part taken out: 1 = no decode (the packed bytes as bf16
    pairs into one dot of half the K: same bytes, no decode instructions), 2 = no group scale."""
    if ABLATE == 1:
        words = q_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
        packed = tl.load(words + rows[:, None] * (stride_qn // 2) + (kg // 4 + tl.arange(0, GROUP // 4))[None, :])
        half, _ = tl.split(tl.permute(tl.reshape(xe, (GROUP // 4, 2, xe.shape[1])), (0, 2, 1)))
        part = tl.dot(packed.to(xe.dtype, bitcast=True), half)
    else:
        packed = tl.load(q_ptr + rows[:, None] * stride_qn + (kg // 2 + tl.arange(0, GROUP // 2))[None, :])
        part = tl.dot(_codes(packed, False, xe.dtype, _ASM), xe)
        part = tl.dot(_codes(packed, True, xe.dtype, _ASM), xo, part)
    if ABLATE == 2:
        out = acc + part
    else:
        column = tl.arange(0, scales.shape[1])[None, :] == g
        out = acc + part * tl.sum(tl.where(column, scales, 0.0), axis=1)[:, None]
    return out


@triton.jit
def _wide_step(acc, q_ptr, rows, k0, stride_qn, x_words, scales, GROUP: tl.constexpr, XDT: tl.constexpr):
    seg = tl.load(q_ptr + rows[:, None] * stride_qn + (k0 // 2 + tl.arange(0, GROUP))[None, :])
    g0, g1 = tl.split(tl.permute(tl.reshape(seg, (seg.shape[0], 2, GROUP // 2)), (0, 2, 1)))
    for g in tl.static_range(2):
        packed = g0 if g == 0 else g1
        pairs = tl.load(x_words + ((k0 + g * GROUP) // 2 + tl.arange(0, GROUP // 2))[:, None])
        xe = (pairs & 0xFFFF).to(tl.int16).to(XDT, bitcast=True)
        xo = (pairs >> 16).to(tl.int16).to(XDT, bitcast=True)
        part = tl.dot(_codes(packed, False, XDT, _ASM), xe)
        part = tl.dot(_codes(packed, True, XDT, _ASM), xo, part)
        column = tl.arange(0, scales.shape[1])[None, :] == g
        acc = acc + part * tl.sum(tl.where(column, scales, 0.0), axis=1)[:, None]
    return acc


@triton.jit
def _scales_any(s_ptr, rows, k0, stride_sn, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, T: tl.constexpr):
    """``_scales``; with T the scales are stored transposed (``[groups, N]``: contiguous along rows)."""
    cols = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    if T:
        out = tl.load(s_ptr + cols[None, :] * stride_sn + rows[:, None]).to(tl.float32)
    else:
        out = tl.load(s_ptr + rows[:, None] * stride_sn + cols[None, :]).to(tl.float32)
    return out


@triton.jit(do_not_specialize=["M", "k_per_split"])
def _ablate_kernel(x_ptr, q_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N_OUT, K, k_per_split, stride_xm, stride_qn,
                   stride_sn, stride_om, GROUP: tl.constexpr, SWIGLU: tl.constexpr, SPLIT: tl.constexpr,
                   FUSED_REDUCE: tl.constexpr, TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   ABLATE: tl.constexpr):
    """The shipped kernel (row-major, no residual) with ABLATE: see :func:`_group_dot_ablate`; 4 = the
    activation columns loaded once per program instead of per group (wrong values, same weight work)."""
    pid_s = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(2) * TOKENS + tl.arange(0, TOKENS)
    rows = offs_n
    xrows = tl.minimum(offs_m, M - 1)
    acc = tl.zeros((BLOCK_N, TOKENS), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, TOKENS), dtype=tl.float32)
    k_first = pid_s * (k_per_split // BLOCK_K) * BLOCK_K
    k_last = tl.minimum(k_first + k_per_split, K)
    x_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + xrows.to(tl.int64)[None, :] * (stride_xm // 2)
    up_rows = rows + N_OUT
    T: tl.constexpr = ABLATE == 6
    scales = _scales_any(s_ptr, rows, k_first, stride_sn, GROUP, BLOCK_K, T)
    scales_up = _scales_any(s_ptr, up_rows, k_first, stride_sn, GROUP, BLOCK_K, T) if SWIGLU else scales
    pairs0 = tl.load(x_words + (k_first // 2 + tl.arange(0, GROUP // 2))[:, None])
    for k0 in range(k_first, k_last, BLOCK_K):
        k_next = tl.minimum(k0 + BLOCK_K, k_last - BLOCK_K)
        scales_next = _scales_any(s_ptr, rows, k_next, stride_sn, GROUP, BLOCK_K, T)
        scales_up_next = _scales_any(s_ptr, up_rows, k_next, stride_sn, GROUP, BLOCK_K, T) if SWIGLU else scales_next
        if ABLATE == 5:  # BLOCK_K == 2 GROUP: one load of the step's whole row segment, split in registers
            acc = _wide_step(acc, q_ptr, rows, k0, stride_qn, x_words, scales, GROUP, x_ptr.dtype.element_ty)
            if SWIGLU:
                acc_up = _wide_step(acc_up, q_ptr, up_rows, k0, stride_qn, x_words, scales_up, GROUP,
                                    x_ptr.dtype.element_ty)
        for g in tl.static_range(0 if ABLATE == 5 else BLOCK_K // GROUP):
            kg = k0 + g * GROUP
            if ABLATE == 4:
                pairs = pairs0
            else:
                pairs = tl.load(x_words + (kg // 2 + tl.arange(0, GROUP // 2))[:, None])
            xe = (pairs & 0xFFFF).to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True)
            xo = (pairs >> 16).to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True)
            acc = _group_dot_ablate(acc, q_ptr, rows, kg, stride_qn, xe, xo, scales, g, GROUP, ABLATE)
            if SWIGLU:
                acc_up = _group_dot_ablate(acc_up, q_ptr, up_rows, kg, stride_qn, xe, xo, scales_up, g, GROUP, ABLATE)
        scales = scales_next
        scales_up = scales_up_next
    mask = (offs_n < N_OUT)[:, None] & (offs_m < M)[None, :]
    gemv_epilogue(acc, acc_up, pid_s, offs_m, offs_n, mask, M, N_OUT, ws_ptr, cnt_ptr, out_ptr, stride_om, out_ptr,
                  stride_om, SPLIT, FUSED_REDUCE, SWIGLU, False, BLOCK_N, TOKENS)


def launch_ablate(x, q, scales, out, swiglu: bool, cfg: GemmConfig, ablate: int) -> None:
    m, k = x.shape
    splits, k_per_split, ws, grid, counters = split_plan(x, out, swiglu, cfg)
    stride_sn = scales.stride(0)  # ablate 6: scales stored [groups, N], so this is N
    _ablate_kernel[grid](x, q, scales, out, ws, counters, m, out.shape[1], k, k_per_split, x.stride(0),
                         q.stride(0), stride_sn, out.stride(0), GROUP=GROUP, SWIGLU=swiglu, SPLIT=splits > 1,
                         FUSED_REDUCE=counters is not None, TOKENS=cfg.block_m, BLOCK_N=cfg.block_n,
                         BLOCK_K=cfg.block_k, ABLATE=ablate, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def to_tiles(q: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """``[N, K/2]`` packed bytes -> every ``[bn, bk/2]`` tile contiguous, tiles in (row tile, K tile) order."""
    n, kb = q.shape
    return q.view(n // bn, bn, kb // (bk // 2), bk // 2).permute(0, 2, 1, 3).contiguous().view(n, kb)


def launch_tiles(x, q, scales, out, swiglu: bool, cfg: GemmConfig) -> None:
    m, k = x.shape
    splits, k_per_split, ws, grid, counters = split_plan(x, out, swiglu, cfg)
    _mma_tiles_kernel[grid](x, q, scales, out, ws, counters, m, out.shape[1], k, k_per_split, x.stride(0),
                            scales.stride(0), out.stride(0), GROUP=GROUP, SWIGLU=swiglu, SPLIT=splits > 1,
                            FUSED_REDUCE=counters is not None, TOKENS=cfg.block_m, BLOCK_N=cfg.block_n,
                            BLOCK_K=cfg.block_k, ASM=not INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                            **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}))
