"""Building blocks of the decode GEMVs (no ``tl.dot``): loading and decoding a slab of packed weight rows,
its group scales, the activation row, the per-group dot, and the split-K epilogue (partials, the
deterministic sum of the splits, the reduce kernel). Used by the dense GEMV (:mod:`.gemv`), the
tensor-core decode (:mod:`.gemv_mma`) and the expert GEMV (:mod:`ninfer.kernels.moe.quant_gemv`);
the arithmetic is described in :mod:`.gemv`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.norms import NormedRows
from ninfer.kernels.quant_gemm.common import (
    FMT_FP8,
    FMT_INT4,
    FMT_INT8,
    FMT_NVFP4,
    finish,
    finish_at,
    group_scales,
)
from ninfer.kernels.quant_gemm.deferred_norm import first_shares, reader_args, rows_rstd, rstd_of_shares
from ninfer.kernels.quant_gemm.e2m1 import e2m1_values


TWO_63 = tl.constexpr(9.223372036854775808e18)  # 2^63


@triton.jit
def gemv_raw(q_ptr, rows, k0, K, stride_qn, FMT: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The packed bytes of weight rows ``rows`` at columns ``[k0, k0 + BLOCK_K)`` (loaded, not decoded)."""
    # One return after a static if/else: compiled Triton checks the types of every return statement.
    if FMT == FMT_INT4 or FMT == FMT_NVFP4:
        offs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        limit = K // 2
    else:
        offs = k0 + tl.arange(0, BLOCK_K)
        limit = K
    ptrs = q_ptr + rows[:, None] * stride_qn + offs[None, :]
    if EVEN_K:
        raw = tl.load(ptrs)
    else:
        raw = tl.load(ptrs, mask=offs[None, :] < limit, other=0)
    return raw


@triton.jit
def w32_raw(q_ptr, rows, k0, K, stride_qn, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """int4 codes of rows ``rows``, columns ``[k0, k0 + BLOCK_K)`` as ``[BLOCK_N, BLOCK_K / 8]`` int32 words
    (``q_ptr`` is the packed tensor viewed as int32, ``stride_qn`` in words)."""
    offs = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    ptrs = q_ptr + rows[:, None] * stride_qn + offs[None, :]
    if EVEN_K:
        raw = tl.load(ptrs)
    else:
        raw = tl.load(ptrs, mask=offs[None, :] < K // 8, other=0)
    return raw


@triton.jit
def _eighths(xt, W: tl.constexpr):
    """``[8 W]`` -> the 8 strided ``[W]`` vectors ``xt[j::8]``, j = 0..7, by three rounds of even/odd splits."""
    even, odd = tl.split(tl.reshape(xt, (W, 4, 2)))  # j = 0, 2, 4, 6 | 1, 3, 5, 7
    e0, e2 = tl.split(tl.reshape(even, (W, 2, 2)))  # j = 0, 4 | 2, 6
    o1, o3 = tl.split(tl.reshape(odd, (W, 2, 2)))  # j = 1, 5 | 3, 7
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e2)
    x1, x5 = tl.split(o1)
    x3, x7 = tl.split(o3)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def w32_values(raw):
    """The 8 nibbles of each int32 word as fp32 ``1 + nibble / 16``: the nibble shifted into mantissa bits
    19..22 of 1.0, one shift and one AND-OR each."""
    v0 = ((raw << 19) & 0x780000) | 0x3F800000
    v1 = ((raw << 15) & 0x780000) | 0x3F800000
    v2 = ((raw << 11) & 0x780000) | 0x3F800000
    v3 = ((raw << 7) & 0x780000) | 0x3F800000
    v4 = ((raw << 3) & 0x780000) | 0x3F800000
    v5 = ((raw >> 1) & 0x780000) | 0x3F800000
    v6 = ((raw >> 5) & 0x780000) | 0x3F800000
    v7 = ((raw >> 9) & 0x780000) | 0x3F800000
    return (v0.to(tl.float32, bitcast=True), v1.to(tl.float32, bitcast=True), v2.to(tl.float32, bitcast=True),
            v3.to(tl.float32, bitcast=True), v4.to(tl.float32, bitcast=True), v5.to(tl.float32, bitcast=True),
            v6.to(tl.float32, bitcast=True), v7.to(tl.float32, bitcast=True))


@triton.jit
def w32_scales(s_ptr, rows, k0, K, stride_sn, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """fp16 int4 group scales of a K step as fp32 ``[BLOCK_N, BLOCK_K / GROUP]``."""
    return group_scales(s_ptr, rows, k0, K, stride_sn, FMT_INT4, GROUP, 1, BLOCK_K // GROUP, EVEN_K)


@triton.jit
def w32_dot(vs, scale, xt, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``W . x`` ``[BLOCK_N]`` (fp32) of one K step for one activation row ``xt [BLOCK_K]``, from the words'
    decoded values ``vs`` (:func:`w32_values`) and the group scales (:func:`w32_scales`)."""
    W: tl.constexpr = BLOCK_K // 8
    NG: tl.constexpr = BLOCK_K // GROUP
    xs = _eighths(xt, W)  # xs[j][w] = x[k0 + 8 w + j]: one contiguous load, split in registers
    part = tl.zeros((BLOCK_N, W), dtype=tl.float32)
    x_sum = tl.zeros((W,), dtype=tl.float32)
    for j in tl.static_range(8):
        part += vs[j] * xs[j][None, :]
        x_sum += xs[j]
    g = tl.sum(tl.reshape(part, (BLOCK_N, NG, GROUP // 8)), axis=2)
    sx = tl.sum(tl.reshape(x_sum, (NG, GROUP // 8)), axis=1)
    return tl.sum((g * 16.0 - 24.0 * sx[None, :]) * scale, axis=1)  # sum((nibble - 8) x) per group, scaled


@triton.jit
def gemv_decode(raw, FMT: tl.constexpr):
    """fp32 weights of a packed tile, before scales.

    4-bit formats: ``(even, odd)`` columns ``[BLOCK_N, BLOCK_K / 2]`` (low and high nibbles of each
    byte): int4 as ``1 + nibble / 16``, e2m1 as ``value * 2^-126``. 8-bit: ``(w, w)`` ``[BLOCK_N, BLOCK_K]``.
    """
    if FMT == FMT_INT4 or FMT == FMT_NVFP4:
        p = raw.to(tl.int32)
        if FMT == FMT_INT4:  # nibble into the top mantissa bits of 1.0
            lo = (((p << 19) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
            hi = (((p << 15) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
        else:
            lo, hi = e2m1_values(p & 0xF), e2m1_values(p >> 4)
    else:
        if FMT == FMT_INT8:
            lo = (raw.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0  # exact, no cvt
        else:
            lo = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # fp8 travels as uint8
        hi = lo
    return lo, hi


@triton.jit
def gemv_scales(s_ptr, rows, k0, K, stride_sn, FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 group scales ``[BLOCK_N, BLOCK_K / GROUP]`` of a K step (nvfp4's times 2^63, see the module
    docstring); fp8 rows have none (their row scale multiplies the accumulator): a placeholder."""
    if FMT == FMT_FP8:
        scale = tl.zeros((1, 1), dtype=tl.float32)  # never read: gemv_dot skips the scale for fp8
    else:
        scale = group_scales(s_ptr, rows, k0, K, stride_sn, FMT, GROUP, ROW_BLOCK, BLOCK_K // GROUP, EVEN_K)
        if FMT == FMT_NVFP4:
            scale = scale * TWO_63
    return scale


@triton.jit
def gemv_x(x_ptr, xrow, k0, K, stride_xm, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Columns ``[k0, k0 + BLOCK_K)`` of activation row ``xrow`` in fp32."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    xp = x_ptr + xrow.to(tl.int64) * stride_xm + offs_k
    x = tl.load(xp) if EVEN_K else tl.load(xp, mask=offs_k < K, other=0.0)
    return x.to(tl.float32)


@triton.jit
def gemv_dot(a, b, scale, xt, FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """``W . x`` ``[BLOCK_N]`` (fp32) of one K step for one activation row ``xt [BLOCK_K]``, from the
    decoded weights ``(a, b)`` (:func:`gemv_decode`) and the group scales (:func:`gemv_scales`)."""
    NG: tl.constexpr = BLOCK_K // GROUP
    if FMT == FMT_INT4 or FMT == FMT_NVFP4:
        if FMT == FMT_NVFP4:
            xt = xt * TWO_63
        xe, xo = tl.split(tl.reshape(xt, (BLOCK_K // 2, 2)))
        prod = a * xe[None, :] + b * xo[None, :]
        part = tl.sum(tl.reshape(prod, (BLOCK_N, NG, GROUP // 2)), axis=2)
        if FMT == FMT_INT4:
            sx = tl.sum(tl.reshape(xe + xo, (NG, GROUP // 2)), axis=1)
            part = part * 16.0 - 24.0 * sx[None, :]
    else:
        part = tl.sum(tl.reshape(a * xt[None, :], (BLOCK_N, NG, GROUP)), axis=2)
    if FMT != FMT_FP8:
        part = part * scale
    return tl.sum(part, axis=1)


@triton.jit
def gemv_epilogue(acc, acc_up, pid_s, offs_m, offs_n, mask, M, N_OUT, ws_ptr, cnt_ptr, res_ptr, stride_rm, out_ptr,
                   stride_om, SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr, SWIGLU: tl.constexpr,
                   HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, stats_ptr=None, n_parts=0,
                   K=1, eps=0.0, ROW_NORM: tl.constexpr = False, PARTS_BLOCK: tl.constexpr = 1):
    """A ``[BLOCK_N, BLOCK_M]`` fp32 tile of ``y^T`` to its destination: without split-K the epilogue
    (:func:`ninfer.kernels.quant_gemm.finish`); with it the partials to the scratch and, with
    FUSED_REDUCE, the sum of all splits by the last one of this output tile to arrive (in split order:
    deterministic) and the epilogue, instead of a second launch; release/acquire through the tile's
    counter, which that program resets, so the next launch (or graph replay) starts from zero. ROW_NORM: the
    tokens' rows were deferred norms (:mod:`.deferred_norm`, ``stats [n_parts, M]``, rows of width ``K``): their
    factors are linear in the sums, so the split that sums applies them, else every program (before SwiGLU)."""
    m_idx, n_idx = offs_m[None, :], offs_n[:, None]
    LATE_NORM: tl.constexpr = ROW_NORM and SPLIT and FUSED_REDUCE
    if ROW_NORM and not LATE_NORM:
        factor = rows_rstd(stats_ptr, n_parts, offs_m, M, K, eps, PARTS_BLOCK)[None, :]
        acc, acc_up = acc * factor, acc_up * factor
    if SPLIT:
        store_partials_at(ws_ptr, acc, acc_up, pid_s, M, m_idx, n_idx, mask, N_OUT, SWIGLU)
        if FUSED_REDUCE:
            if last_split_arrived(cnt_ptr):
                if LATE_NORM:  # requested beside the partials
                    shares = first_shares(stats_ptr, n_parts, offs_m, M, PARTS_BLOCK)
                acc, acc_up = sum_splits_at(ws_ptr, m_idx, n_idx, mask, M, N_OUT, tl.num_programs(1), SWIGLU)
                if LATE_NORM:
                    factor = rstd_of_shares(shares, stats_ptr, n_parts, offs_m, M, K, eps, PARTS_BLOCK)[None, :]
                    acc, acc_up = acc * factor, acc_up * factor
                finish_at(acc, acc_up, m_idx, n_idx, mask, res_ptr, stride_rm, out_ptr, stride_om, SWIGLU, HAS_RES)
                reset_counter(cnt_ptr)
    else:
        finish_at(acc, acc_up, m_idx, n_idx, mask, res_ptr, stride_rm, out_ptr, stride_om, SWIGLU, HAS_RES)


@triton.jit
def last_split_arrived(cnt_ptr):
    """Counts this program's split in at its output tile's counter (grid axes: 0 and 2 the tile, 1 the split),
    after its partials are stored (release); true in the last split to arrive, which then sees all partials
    (acquire)."""
    tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    last = arrived == tl.num_programs(1) - 1
    if last:
        tl.debug_barrier()
    return last


@triton.jit
def reset_counter(cnt_ptr):
    """The last split's reset of its tile's counter, so the next launch (or graph replay) starts from zero."""
    tl.store(cnt_ptr + tl.program_id(2) * tl.num_programs(0) + tl.program_id(0), 0)


@triton.jit
def store_partials(ws_ptr, acc, acc_up, pid_s, rows_total, offs_m, offs_n, mask, N_OUT, SWIGLU: tl.constexpr):
    """Split ``pid_s``'s fp32 partials into the scratch ``[splits, rows_total, N_OUT * (2 if SWIGLU)]``
    (gate columns first, then up), which :func:`gemv_reduce_kernel` sums in split order."""
    store_partials_at(ws_ptr, acc, acc_up, pid_s, rows_total, offs_m[None, :], offs_n[:, None], mask, N_OUT, SWIGLU)


@triton.jit
def store_partials_at(ws_ptr, acc, acc_up, pid_s, rows_total, m_idx, n_idx, mask, N_OUT, SWIGLU: tl.constexpr):
    """:func:`store_partials` for values at any positions (index tensors that broadcast to ``acc``'s shape)."""
    n_cols = N_OUT * (1 + SWIGLU)
    ptrs = ws_ptr + (pid_s * rows_total + m_idx).to(tl.int64) * n_cols + n_idx
    tl.store(ptrs, acc, mask=mask)
    if SWIGLU:
        tl.store(ptrs + N_OUT, acc_up, mask=mask)


@triton.jit
def sum_splits_at(ws_ptr, m_idx, n_idx, mask, M, N_OUT, splits, SWIGLU: tl.constexpr):
    """The split-K partials of outputs ``(m_idx, n_idx)`` summed in split order (deterministic). Loads bypass
    L1 (``.cg``): in the fused reduction other SMs wrote them during this launch."""
    sums = sum_splits_of(ws_ptr, (m_idx,), (n_idx,), (mask,), M, N_OUT, splits, SWIGLU)
    return sums[0], sums[1]


@triton.jit
def sum_splits_of(ws_ptr, m_idxs, n_idxs, masks, M, N_OUT, splits, SWIGLU: tl.constexpr):
    """:func:`sum_splits_at` for several accumulators at once (tuples of their index tensors and masks), split
    after split: each split's loads of every accumulator are in flight together. One accumulator's splits after
    another's waited for a round of L2 loads per four splits (ptxas unrolls the loop by four) and accumulator, in
    the last split of a fused reduction. Returns ``(y, y_up)`` of accumulator ``i`` at ``2 i`` and ``2 i + 1``."""
    n_cols = N_OUT * (1 + SWIGLU)
    plane = M.to(tl.int64) * n_cols
    ptrs = ()
    sums = ()
    for i in tl.static_range(len(masks)):
        ptr = ws_ptr + m_idxs[i].to(tl.int64) * n_cols + n_idxs[i]
        ptrs = ptrs + (ptr,)
        y = tl.load(ptr, mask=masks[i], other=0.0, cache_modifier=".cg")
        y_up = y
        if SWIGLU:
            y_up = tl.load(ptr + N_OUT, mask=masks[i], other=0.0, cache_modifier=".cg")
        sums = sums + (y, y_up)
    for s in range(1, splits):
        added = ()
        for i in tl.static_range(len(masks)):
            y = sums[2 * i] + tl.load(ptrs[i] + s * plane, mask=masks[i], other=0.0, cache_modifier=".cg")
            y_up = sums[2 * i + 1]
            if SWIGLU:
                y_up += tl.load(ptrs[i] + s * plane + N_OUT, mask=masks[i], other=0.0, cache_modifier=".cg")
            added = added + (y, y_up)
        sums = added
    return sums


@triton.jit
def sum_splits_tile(ws_ptr, m_idx, n_idx, mask, M, N_OUT, splits, SWIGLU: tl.constexpr, S_BLOCK: tl.constexpr):
    """:func:`sum_splits_at` for a whole 2-D tile at once (``m_idx [T, 1]``, ``n_idx [1, R]``, ``mask [T, R]``): the
    partials of ``S_BLOCK`` splits are loaded together, one round trip to L2 per ``S_BLOCK`` splits, and summed in a
    fixed tree order (deterministic, though not the split order of :func:`sum_splits_at`)."""
    n_cols = N_OUT * (1 + SWIGLU)
    plane = M.to(tl.int64) * n_cols
    ss = tl.arange(0, S_BLOCK)[:, None, None]
    base = ws_ptr + (m_idx.to(tl.int64) * n_cols + n_idx)[None, :, :]
    y = tl.zeros(mask.shape, dtype=tl.float32)
    y_up = tl.zeros(mask.shape, dtype=tl.float32)
    for s0 in range(0, splits, S_BLOCK):
        ptrs = base + (s0 + ss) * plane
        in_split = mask[None, :, :] & (s0 + ss < splits)
        y += tl.sum(tl.load(ptrs, mask=in_split, other=0.0, cache_modifier=".cg"), axis=0)
        if SWIGLU:
            y_up += tl.sum(tl.load(ptrs + N_OUT, mask=in_split, other=0.0, cache_modifier=".cg"), axis=0)
    if not SWIGLU:
        y_up = y
    return y, y_up


@triton.jit(do_not_specialize=["M", "splits", "M_NORM"])
def gemv_reduce_kernel(ws_ptr, res_ptr, out_ptr, stats_ptr, M, N_OUT, splits, stride_rm, stride_om, M_NORM, K, n_parts,
                       eps, row_div, SWIGLU: tl.constexpr, HAS_RES: tl.constexpr, ROW_NORM: tl.constexpr,
                       PARTS_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sums the split-K partials in split order (deterministic), then the epilogue. ROW_NORM: each row ``m``'s sums
    times the factor of deferred row ``m // row_div`` (``stats [n_parts, M_NORM]``, rows of width ``K``), before
    SwiGLU."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (offs_n < N_OUT)[:, None] & (offs_m < M)[None, :]
    acc, acc_up = sum_splits_at(ws_ptr, offs_m[None, :], offs_n[:, None], mask, M, N_OUT, splits, SWIGLU)
    if ROW_NORM:
        factor = rows_rstd(stats_ptr, n_parts, tl.where(offs_m < M, offs_m // row_div, 0), M_NORM, K, eps,
                           PARTS_BLOCK)[None, :]
        acc *= factor
        acc_up *= factor
    finish(acc, acc_up, offs_m, offs_n, mask, res_ptr, stride_rm, out_ptr, stride_om, SWIGLU, HAS_RES)


def reduce_splits(ws: torch.Tensor, res: torch.Tensor, out: torch.Tensor, m: int, splits: int, swiglu: bool,
                  has_res: bool, block_m: int = 8, row_norm: NormedRows | None = None, row_div: int = 1) -> None:
    """Launch :func:`gemv_reduce_kernel`: the split-K partials ``ws [splits, m, N_OUT (x 2 with SwiGLU)]`` summed in
    split order into rows ``0..m`` of ``out [*, N_OUT]``, with the epilogue (``res``: the residual where
    ``has_res``, else any tensor of ``out``'s row stride). ``row_norm``: the partials are sums over its scaled rows,
    row ``i`` of them over row ``i // row_div``: the sum is normalized here, once, rather than in every split."""
    n_out = out.shape[1]
    reads = reader_args(row_norm, block_m, ws)
    gemv_reduce_kernel[(triton.cdiv(n_out, 128), triton.cdiv(m, block_m))](
        ws_ptr=ws, res_ptr=res, out_ptr=out, stats_ptr=reads.stats, M=m, N_OUT=n_out, splits=splits,
        stride_rm=res.stride(0), stride_om=out.stride(0),
        M_NORM=row_norm.stats.shape[1] if row_norm is not None else 1,
        K=row_norm.scaled.shape[-1] if row_norm is not None else 1, n_parts=reads.parts, eps=reads.eps,
        row_div=row_div, SWIGLU=swiglu, HAS_RES=has_res, ROW_NORM=row_norm is not None, PARTS_BLOCK=reads.parts_block,
        BLOCK_M=block_m, BLOCK_N=128, num_warps=4,
    )
