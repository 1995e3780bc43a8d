"""The ``tl.dot`` kernel of the quantized GEMM: the skinny decode path (``BLOCK_M = 16``, optional split-K
into an fp32 workspace) and the tiled prefill path (grouped tile order for L2 reuse of x).

Weight rows take the MMA M side; group scales multiply each group's ``[BLOCK_N, BLOCK_M]`` partial product
on the skinny path (exact integer codes go to the MMA) and the dequantized tile on the tiled path. The
K loop (``k_loop``) is shared with the grouped expert GEMM of :mod:`ninfer.kernels.moe.quant_gemm`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ninfer.kernels.quant_gemm.common import FMT_FP8, dot, finish, group_scales, grouped_tile, weight_tile


@triton.jit
def _x_tile(x_ptr, xrows, k0, K, stride_xm, WIDTH: tl.constexpr, EVEN_K: tl.constexpr):
    """Activations as ``x^T [WIDTH, BLOCK_M]`` for columns ``[k0, k0 + WIDTH)`` (rows clamped by the caller)."""
    offs_k = k0 + tl.arange(0, WIDTH)
    ptrs = x_ptr + xrows[None, :] * stride_xm + offs_k[:, None]
    return tl.load(ptrs) if EVEN_K else tl.load(ptrs, mask=offs_k[:, None] < K, other=0.0)


@triton.jit
def _k_step(acc, xt, q_ptr, s_ptr, rows, k0, K, stride_qn, stride_sn,
            FMT: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, ROW_BLOCK: tl.constexpr,
            SCALED: tl.constexpr, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr, EVEN_K: tl.constexpr,
            IEEE: tl.constexpr):
    """``acc += W[rows, k0:k0+WIDTH] @ xt``; unless SCALED the columns form one scale group, applied to
    the ``[BLOCK_N, BLOCK_M]`` product instead of every weight (fewer multiplies when BLOCK_M is small)."""
    w = weight_tile(q_ptr, s_ptr, rows, k0, K, stride_qn, stride_sn, FMT, GROUP, CHUNK, ROW_BLOCK, SCALED,
                     BLOCK_N, WIDTH, EVEN_K, xt.dtype)
    if SCALED or FMT == FMT_FP8:  # fp8 rows: the row scale multiplies the accumulator at the end
        return dot(w, xt, acc, IEEE)
    scale = group_scales(s_ptr, rows, k0, K, stride_sn, FMT, GROUP, ROW_BLOCK, 1, EVEN_K)
    return acc + dot(w, xt, tl.zeros(acc.shape, dtype=tl.float32), IEEE) * scale


@triton.jit
def k_loop(acc, acc_up, x_ptr, xrows, q_ptr, s_ptr, rows, first, last, N_OUT, K, stride_xm, stride_qn, stride_sn,
            FMT: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, ROW_BLOCK: tl.constexpr,
            SCALED: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            SUB: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    """K steps ``[first, last)`` of a ``[BLOCK_N, BLOCK_M]`` tile of ``y^T``, SUB columns per dot; with
    SWIGLU the up rows (N_OUT rows further down) accumulate into ``acc_up`` from the same x tile."""
    for step in range(first, last):
        for sub in tl.static_range(BLOCK_K // SUB):
            k0 = step * BLOCK_K + sub * SUB
            xt = _x_tile(x_ptr, xrows, k0, K, stride_xm, SUB, EVEN_K)
            acc = _k_step(acc, xt, q_ptr, s_ptr, rows, k0, K, stride_qn, stride_sn, FMT, GROUP, CHUNK, ROW_BLOCK,
                          SCALED, BLOCK_N, SUB, EVEN_K, IEEE)
            if SWIGLU:
                acc_up = _k_step(acc_up, xt, q_ptr, s_ptr, rows + N_OUT, k0, K, stride_qn, stride_sn, FMT, GROUP,
                                 CHUNK, ROW_BLOCK, SCALED, BLOCK_N, SUB, EVEN_K, IEEE)
    return acc, acc_up


@triton.jit(do_not_specialize=["M", "steps_per_split"])  # M = 1 and one step per split: no extra compiles
def quant_gemm_kernel(
    x_ptr, q_ptr, s_ptr, rs_ptr, res_ptr, out_ptr, ws_ptr,
    M, N_OUT, K, steps_per_split,
    stride_xm, stride_qn, stride_sn, stride_rm, stride_om,
    FMT: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, ROW_BLOCK: tl.constexpr,
    SCALED: tl.constexpr, ROW_SCALE: tl.constexpr, SWIGLU: tl.constexpr, HAS_RES: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N_OUT, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows load row 0 / N-1 instead of being masked (cheaper); the store drops them.
    xrows = tl.minimum(offs_m, M - 1)
    rows = tl.minimum(offs_n, N_OUT - 1)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    SUB: tl.constexpr = BLOCK_K if SCALED else CHUNK  # columns per dot
    first = tl.program_id(1) * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    acc, acc_up = k_loop(acc, acc_up, x_ptr, xrows, q_ptr, s_ptr, rows, first, last, N_OUT, K, stride_xm, stride_qn,
                          stride_sn, FMT, GROUP, CHUNK, ROW_BLOCK, SCALED, SWIGLU, BLOCK_N, BLOCK_K, SUB, EVEN_K, IEEE)
    n_ok = offs_n < N_OUT
    m_ok = offs_m < M
    if ROW_SCALE:
        acc *= tl.load(rs_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
        if SWIGLU:
            acc_up *= tl.load(rs_ptr + N_OUT + offs_n, mask=n_ok, other=0.0)[:, None]
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        # Workspace [M, N_OUT * (2 if SWIGLU)]: gate columns first, then up.
        ptrs = ws_ptr + offs_m.to(tl.int64)[None, :] * (N_OUT * (1 + SWIGLU)) + offs_n[:, None]
        tl.atomic_add(ptrs, acc, mask=mask)
        if SWIGLU:
            tl.atomic_add(ptrs + N_OUT, acc_up, mask=mask)
    else:
        finish(acc, acc_up, offs_m, offs_n, mask, res_ptr, stride_rm, out_ptr, stride_om, SWIGLU, HAS_RES)
