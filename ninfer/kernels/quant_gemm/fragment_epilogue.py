"""The epilogue pieces of the register decode (:mod:`.fragment_mma`): where a lane's accumulators sit in the output
(the ``mma.sync`` D fragment), nvfp4's per-row global scales, and one output's (or a pair's two) finishing: SwiGLU,
residual, the rounding before a norm, or the deferred norm's scaled rows."""
from __future__ import annotations

import triton
import triton.language as tl

from ninfer.kernels.quant_gemm.deferred_norm import finish_deferred
from ninfer.kernels.quant_gemm.fragments_fp4 import FP4_OUT_SCALE
from ninfer.kernels.quant_gemm.gemv_steps import finish_at


@triton.jit
def row_scaled(acc, acc_up, rs_ptr, tile_out, slots, g, t, tok0, M, n_stream, NB: tl.constexpr, TWO: tl.constexpr):
    """nvfp4: the sums times each output row's global scale (and the ``2^8`` the decode left out); the second
    stream's rows (SwiGLU's up rows, a pair's second half) are ``n_stream`` further on."""
    out = ()
    out_up = ()
    for i in tl.static_range(4 * NB):
        _, n_idx, _ = lane_position(i, tile_out, slots, g, t, tok0, M)
        row = tl.minimum(n_idx, n_stream - 1)
        out = out + (acc[i] * (tl.load(rs_ptr + row) * FP4_OUT_SCALE),)
        if TWO:
            out_up = out_up + (acc_up[i] * (tl.load(rs_ptr + n_stream + row) * FP4_OUT_SCALE),)
    if not TWO:
        out_up = out
    return out, out_up


@triton.jit
def lane_position(i: tl.constexpr, tile_out, slots, g, t, tok0, M):
    """(token, row, valid) of a lane's accumulator ``i``: in 8-token block ``i // 4``, rows ``g`` / ``g + 8`` for
    ``i % 4`` in 0..1 / 2..3, tokens ``2t`` / ``2t + 1`` for even / odd ``i`` (the MMA's D fragment)."""
    n_idx = tile_out * 16 + g + 8 * ((i % 4) // 2)
    m_idx = tok0 + 8 * (i // 4) + 2 * t + i % 2
    return m_idx, n_idx, (tile_out < slots) & (m_idx < M)


@triton.jit
def finish_outputs(y, y_up, m_idx, n_idx, mask, n_stream, res_ptr, stride_rm, out_ptr, stride_om, nw_ptr, scaled_ptr,
            stride_sm, SWIGLU: tl.constexpr, PAIR: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr,
            DEFER: tl.constexpr):
    """The epilogue of one output (SwiGLU combines the two streams) or, for a pair of tiles, of two. Before a norm
    (NORM) the product is rounded to the output dtype before the residual is added, as the unfused layer's GEMM
    output and norm round it: the new residual stream is bit-equal to theirs. DEFER (the norm left to the readers,
    :mod:`.deferred_norm`) also writes the scaled rows; returns the squares of the new residual stream (0 unless
    DEFER)."""
    sq = tl.zeros(y.shape, dtype=tl.float32)
    if DEFER:
        sq = finish_deferred(y, m_idx, n_idx, mask, res_ptr, stride_rm, out_ptr, stride_om, nw_ptr, scaled_ptr,
                             stride_sm, HAS_RES)
        if PAIR:
            sq += finish_deferred(y_up, m_idx, n_idx + n_stream, mask, res_ptr, stride_rm, out_ptr, stride_om, nw_ptr,
                                  scaled_ptr, stride_sm, HAS_RES)
    else:
        if NORM:
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
            y_up = y_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        finish_at(y, y_up, m_idx, n_idx, mask, res_ptr, stride_rm, out_ptr, stride_om, SWIGLU, HAS_RES)
        if PAIR:
            finish_at(y_up, y_up, m_idx, n_idx + n_stream, mask, res_ptr, stride_rm, out_ptr, stride_om, False,
                      HAS_RES)
    return sq


@triton.jit
def warp_share(prog_tile, e, slots, chunks_per_split, WARPS: tl.constexpr):
    """Warps splitting K on the program's one tile ``prog_tile`` (of ``slots``): each lane's ``(tile, tile_out,
    k_off)``: the tile every warp loads (clamped), the tile only warp 0 stores (past the last for the others, whose
    stores are masked), and the warp's first chunk after its split's (equal shares)."""
    tile = tl.minimum(prog_tile + 0 * e, slots - 1)
    tile_out = prog_tile + tl.where(e // 32 == 0, 0, slots)
    return tile, tile_out, (e // 32) * (chunks_per_split // WARPS)


@triton.jit
def _warp_sum(x, WARPS: tl.constexpr):
    """``x [32 * WARPS, 2, 2]`` summed over the warps lane by lane, the sums held by every warp again."""
    parts = tl.reshape(x, (WARPS, 32, 2, 2))
    return tl.reshape(tl.broadcast_to(tl.sum(parts, axis=0)[None, :, :, :], (WARPS, 32, 2, 2)), (32 * WARPS, 2, 2))


@triton.jit
def warp_sums(acc, N: tl.constexpr, WARPS: tl.constexpr):
    """Each of the ``N`` accumulators ``[32 * WARPS]`` summed over the warps, lane by lane (warps that each ran a
    share of K on the same tile), the sums held by every warp. Four at a time in one exchange through shared
    memory (one pass and two barriers instead of four of each)."""
    out = ()
    for q in tl.static_range(N // 4):
        quad = tl.join(tl.join(acc[4 * q], acc[4 * q + 1]), tl.join(acc[4 * q + 2], acc[4 * q + 3]))
        first, second = tl.split(_warp_sum(quad, WARPS))
        a0, a1 = tl.split(first)
        a2, a3 = tl.split(second)
        out = out + (a0, a1, a2, a3)
    return out
