"""Decode over routed (token, expert) pairs on tensor cores from registers, for int4 expert stacks.

The expert counterpart of the dense register decode (:mod:`ninfer.kernels.quant_gemm.fragment_mma`): no shared
memory, one warp per 16-row tile of an expert, ``mma.sync.m16n8k16`` with the tile's rows as M and up to eight
pairs of that expert as N. The stacks keep their row-major layout (the prefill's grouped GEMMs read it), so a
lane loads 8 bytes of each of its two rows per 64 columns and its activations are paired to match
(:func:`ninfer.kernels.quant_gemm.fragment_ptx.row_major_decode_asm`); the decode per weight is the dense one's.

* Grid ``(tile groups, K splits, pairs)``: the program of pair ``p`` runs if ``p`` opens a block of eight of its
  expert's pairs (rank 0, 8, ...; at decode one token's eight pairs have eight experts, so every program of a
  batch-1 step runs) and serves that block: lane ``(g, t)`` feeds the MMAs the activation row of the block's
  pair ``g``, and its accumulators are pairs ``2t`` and ``2t + 1``. No other expert's bytes are read.
* Past the alignment-free decode rows (a speculative verification of several lanes: 4 tokens x 8 lanes x 8
  slots), the rows come aligned to blocks of 16 pairs of one expert (:func:`~ninfer.kernels.moe.align.align_pairs`)
  and grid axis 2 is (row block, half): each program serves eight pairs of a block, and exits where its block or
  half is padding. The ``tl.dot`` grouped GEMM otherwise pads every expert's one or two pairs to a 16-row MMA.
* Gate/up (SwiGLU: the gate tile and the up tile of the same outputs in one warp, sharing the activation loads),
  or down times the routing weight ``rw[pair]``. Each scale group's products accumulate from zero in fp32 and are
  scaled once. Split-K stores fp32 partials (the routing weight already applied: it is linear) and the last
  split to arrive sums them in split order (:mod:`ninfer.kernels.quant_gemm.gemv_steps`): deterministic.
* ``UNROLL`` chunks per loop trip, all their code loads issued first; with ``PREFETCH`` the next trip's too.

The interpreter cannot run PTX: with ``ASM`` off (CPU tests, fp32 activations) each lane computes the same
products with Triton gathers of the same bytes, so the CPU tests check the indexing, splits and epilogues.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import INTERPRET, pdl_enabled, split_sum_across
from ninfer.kernels.moe.align import ExpertRows, pair_group, pair_rows
from ninfer.kernels.moe.mma_configs import (
    EXPERT_KINDS,
    EXPERT_KSPLIT_KIND,
    FORMATS,
    expert_mma_fits,
)
from ninfer.kernels.norms import NormedRows
from ninfer.kernels.pdl import Pdl, early_pdl, pdl_enter
from ninfer.kernels.quant_gemm.common import finish_at
from ninfer.kernels.quant_gemm.deferred_norm import MAX_ROWS as MAX_NORMED_TOKENS
from ninfer.kernels.quant_gemm.deferred_norm import (
    first_shares,
    reader_args,
    rstd_of_shares,
)
from ninfer.kernels.quant_gemm.fragment_configs import fragment_splits
from ninfer.kernels.quant_gemm.fragment_epilogue import warp_share, warp_sums
from ninfer.kernels.quant_gemm.fragment_ptx import (
    mma_asm,
    paired_x_load_asm,
    row_major_decode_asm,
    row_major_load_asm,
)
from ninfer.kernels.quant_gemm.fragment_steps import (
    add_scaled,
    decode_codes,
    mma_block,
    x_words,
)
from ninfer.kernels.quant_gemm.gemv import tile_counters
from ninfer.kernels.quant_gemm.gemv_steps import (
    last_split_arrived,
    reduce_splits,
    reset_counter,
    store_partials_at,
    sum_splits_at,
    sum_splits_of,
)
from ninfer.kernels.quant_gemm.tune import GemmConfig

ALIGNED_BLOCK = 16  # pairs per aligned row block it takes (two programs of eight)
ALIGNED_MAX_PAIRS = 256  # aligned calls up to which it is a candidate: 32 tokens of top-8 (8 lanes x 4 verified)
# a chunk's loads at its constant offset from the loop trip's address (one inline-PTX string per chunk of a trip)
_L0, _L1, _L2, _L3 = (tl.constexpr(row_major_load_asm(u)) for u in range(4))
_X0, _X1, _X2, _X3 = (tl.constexpr(paired_x_load_asm(u)) for u in range(4))


@triton.jit
def _load_rows(addr_g, addr_h, U: tl.constexpr):
    """A lane's codes of chunk ``U`` of a loop trip: rows g and g + 8 (4 words)."""
    cons: tl.constexpr = "=r,=r,=r,=r,l,l"
    if U == 0:
        w = tl.inline_asm_elementwise(_L0, cons, [addr_g, addr_h], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    elif U == 1:
        w = tl.inline_asm_elementwise(_L1, cons, [addr_g, addr_h], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    elif U == 2:
        w = tl.inline_asm_elementwise(_L2, cons, [addr_g, addr_h], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    else:
        w = tl.inline_asm_elementwise(_L3, cons, [addr_g, addr_h], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    return w


@triton.jit
def _load_x(addr, U: tl.constexpr):
    """A lane's 16 activations of chunk ``U``, packed as the row-major decode's B registers (8 words)."""
    return x_words(addr, U, _X0, _X1, _X2, _X3, True)


@triton.jit
def _trip_codes(row_g, row_h, c, UNROLL: tl.constexpr, ASM: tl.constexpr):
    """A lane's codes of the ``UNROLL`` chunks from chunk ``c`` (``row_g`` / ``row_h``: its addresses of chunk 0)."""
    codes = ()
    if ASM:
        for u in tl.static_range(UNROLL):
            codes = codes + (_load_rows(row_g + c * 32, row_h + c * 32, u),)
    return codes


@triton.jit
def _portable_chunk(d, q_row, x_ptr, x_row0, x_row1, c, stride_qn):
    """What the PTX of one chunk adds to ``d`` (rows g / g + 8 x the lane's pairs 2t / 2t + 1), from gathers of
    the row-major codes (``q_row``: the lane's row g; interpreter, fp32 activations). ``c``: the chunk, one for the
    program or (warps splitting K) one per lane."""
    cols = (c + tl.zeros_like(x_row0))[:, None] * 64 + tl.arange(0, 64)[None, :]
    byte_g = tl.load(q_row[:, None] + cols // 2).to(tl.int32)
    byte_h = tl.load(q_row[:, None] + 8 * stride_qn + cols // 2).to(tl.int32)
    lo = (((byte_g >> (4 * (cols % 2))) & 0xF) - 8).to(tl.float32)
    hi = (((byte_h >> (4 * (cols % 2))) & 0xF) - 8).to(tl.float32)
    x0 = tl.load(x_ptr + x_row0[:, None] + cols).to(tl.float32)
    x1 = tl.load(x_ptr + x_row1[:, None] + cols).to(tl.float32)
    return (d[0] + tl.sum(lo * x0, axis=1), d[1] + tl.sum(lo * x1, axis=1),
            d[2] + tl.sum(hi * x0, axis=1), d[3] + tl.sum(hi * x1, axis=1))


@triton.jit
def _trip(acc, acc_up, codes, codes_up, q_row, q_row_up, s_row, s_row_up, x_lane, x_row0, x_row1, x_ptr, c,
          k_off, stride_qn, stride_sn, CPG: tl.constexpr, UNROLL: tl.constexpr, SWIGLU: tl.constexpr,
          DECODE_ASM: tl.constexpr, DECODE_OPERANDS: tl.constexpr, MMA_ASM: tl.constexpr, ASM: tl.constexpr):
    """``UNROLL`` chunks from chunk ``c`` into ``acc`` (and the up tile's into ``acc_up``): per scale group the
    unscaled products from zero, then scaled once (``s_row``: the lane's row g scales; row g + 8's are 8 rows
    on). Warps splitting K: the addresses start at the warp's first chunk ``k_off``, which the gathers add to ``c``."""
    for grp in tl.static_range(UNROLL // CPG):
        gi = c // CPG + grp
        d = (tl.zeros_like(acc[0]), tl.zeros_like(acc[0]), tl.zeros_like(acc[0]), tl.zeros_like(acc[0]))
        d_up = d
        for u in tl.static_range(grp * CPG, grp * CPG + CPG):
            if ASM:
                xw = _load_x(x_lane + c * 128, u)
                a = decode_codes(codes[u], DECODE_ASM, DECODE_OPERANDS, 4)
                d = mma_block(a, xw, d[0], d[1], d[2], d[3], MMA_ASM)
                if SWIGLU:
                    a_up = decode_codes(codes_up[u], DECODE_ASM, DECODE_OPERANDS, 4)
                    d_up = mma_block(a_up, xw, d_up[0], d_up[1], d_up[2], d_up[3], MMA_ASM)
            else:
                d = _portable_chunk(d, q_row, x_ptr, x_row0, x_row1, c + u + k_off, stride_qn)
                if SWIGLU:
                    d_up = _portable_chunk(d_up, q_row_up, x_ptr, x_row0, x_row1, c + u + k_off, stride_qn)
        acc = add_scaled(acc, d, tl.load(s_row + gi).to(tl.float32), tl.load(s_row + 8 * stride_sn + gi).to(tl.float32),
                      1)
        if SWIGLU:
            acc_up = add_scaled(acc_up, d_up, tl.load(s_row_up + gi).to(tl.float32),
                             tl.load(s_row_up + 8 * stride_sn + gi).to(tl.float32), 1)
    return acc, acc_up


@triton.jit
def _slot_pair(slot, block_pairs):
    """The pair in slot ``slot`` (per lane) of the program's block of eight (``block_pairs``, NK where empty)."""
    return tl.sum(tl.where(slot[:, None] == tl.arange(0, 8)[None, :], block_pairs[None, :], 0), axis=1)


@triton.jit
def _pair_factors(shares, stats_ptr, n_parts, M_TOK, K, eps, tok_0, tok_1, TOKENS: tl.constexpr,
                  PARTS_BLOCK: tl.constexpr):
    """The norm factors of the token rows ``tok_0`` / ``tok_1`` (a lane's two pairs) from the rows' shares
    (``shares``: their :func:`~ninfer.kernels.quant_gemm.deferred_norm.first_shares`)."""
    r = rstd_of_shares(shares, stats_ptr, n_parts, tl.arange(0, TOKENS), M_TOK, K, eps, PARTS_BLOCK)
    toks = tl.arange(0, TOKENS)[None, :]
    f0 = tl.sum(tl.where(toks == tok_0[:, None], r[None, :], 0.0), axis=1)
    f1 = tl.sum(tl.where(toks == tok_1[:, None], r[None, :], 0.0), axis=1)
    return f0, f1


@triton.jit
def _times_pair_factor(y, y_up, f0, f1, i: tl.constexpr):
    """Accumulator ``i``'s two sums times its pair's factor (even ``i``: the lane's first pair)."""
    f = f0 if i % 2 == 0 else f1
    return y * f, y_up * f


@triton.jit(do_not_specialize=["NK", "chunks_per_split"])
def _expert_mma_kernel(
    x_ptr, q_ptr, s_ptr, rw_ptr, out_ptr, ws_ptr, cnt_ptr, ids_ptr, sorted_ptr, block_experts_ptr, stats_ptr,
    NK, N_OUT, a_div, chunks_per_split, KC, stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_om,
    M_TOK, n_parts, eps, ROW_NORM: tl.constexpr, TOKENS: tl.constexpr, PARTS_BLOCK: tl.constexpr, CPG: tl.constexpr,
    SWIGLU: tl.constexpr, SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr, SUM_ACROSS: tl.constexpr,
    WARPS: tl.constexpr, UNROLL: tl.constexpr, PREFETCH: tl.constexpr, KSPLIT: tl.constexpr, PAIRS_BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr, DECODE_ASM: tl.constexpr, DECODE_OPERANDS: tl.constexpr, MMA_ASM: tl.constexpr,
    ASM: tl.constexpr, PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    """:func:`launch_expert_mma`'s kernel. ``PDL_TRIGGER``: the next kernel may launch at once (a down projection
    launched early requests its weights meanwhile); ``PDL_WAIT`` (launched early: the down projection, whose ids
    were written before the kernel before it started): it reads the ids and its first trip's codes, then waits for
    that kernel (:mod:`ninfer.kernels.pdl`)."""
    pdl_enter(False, PDL_TRIGGER)
    if ALIGNED:  # half (program_id(2) % 2) of a block of 16 aligned pairs (sentinel NK in its padding)
        block = tl.program_id(2) // 2
        expert = tl.load(block_experts_ptr + block).to(tl.int64)
        if expert < 0:  # past the last block
            return
        block_pairs = tl.load(sorted_ptr + block * 16 + (tl.program_id(2) % 2) * 8 + tl.arange(0, 8))
        if tl.min(block_pairs, axis=0) >= NK:  # the half is padding
            return
    else:
        _, match, rank, count, earlier = pair_group(ids_ptr, tl.program_id(2), NK, PAIRS_BLOCK)
        if earlier % 8 != 0:  # not the first pair of a block of eight of its expert: that block's program serves it
            return
        expert = tl.load(ids_ptr + tl.program_id(2)).to(tl.int64)
        block_pairs = pair_rows(match, rank, count, earlier, NK, 8, PAIRS_BLOCK)
    e = tl.arange(0, 32 * WARPS)  # one element per thread: element i is thread i (lane i % 32 of warp i // 32)
    lane = e % 32
    g = lane // 4
    t = lane % 4
    slots = N_OUT // 16
    tile_out = tl.program_id(0) * WARPS + e // 32
    tile = tl.minimum(tile_out, slots - 1)  # a clamped tile loads valid memory; its stores are masked
    k_off = 0  # the warp's first chunk after its split's
    if KSPLIT:  # every warp on the program's one tile, over its share of the split's chunks; warp 0 stores the sums
        tile, tile_out, k_off = warp_share(tl.program_id(0), e, slots, chunks_per_split, WARPS)
    pair_b = _slot_pair(g, block_pairs)  # the B operand's pair (N index g)
    x_row_b = tl.where(pair_b < NK, pair_b // a_div, 0).to(tl.int64) * stride_xm
    row = tile.to(tl.int64) * 16 + g
    q_row = q_ptr + expert * stride_qe + row * stride_qn
    q_row_up = q_row + N_OUT.to(tl.int64) * stride_qn
    s_row = s_ptr + expert * stride_se + row * stride_sn + k_off // CPG
    s_row_up = s_row + N_OUT.to(tl.int64) * stride_sn
    # the D fragment's pairs (N index 2t, 2t + 1): the portable body's activation rows, then the stores
    pair0 = _slot_pair(2 * t, block_pairs)
    pair1 = _slot_pair(2 * t + 1, block_pairs)
    tok_0 = tl.where(pair0 < NK, pair0 // a_div, 0)
    tok_1 = tl.where(pair1 < NK, pair1 // a_div, 0)
    x_row0 = tok_0.to(tl.int64) * stride_xm
    x_row1 = tok_1.to(tl.int64) * stride_xm
    row_g, row_h, row_g_up, row_h_up, x_lane = q_row, q_row, q_row, q_row, x_row_b
    if ASM:
        row_g = q_row.to(tl.int64) + k_off * 32 + t * 8
        row_h = row_g + 8 * stride_qn
        row_g_up = q_row_up.to(tl.int64) + k_off * 32 + t * 8
        row_h_up = row_g_up + 8 * stride_qn
        x_lane = x_ptr.to(tl.int64) + (x_row_b + k_off * 64 + t * 16) * 2
    zero = tl.zeros((32 * WARPS,), dtype=tl.float32)
    acc = (zero, zero, zero, zero)
    acc_up = acc
    # ROW_NORM (quant_gemm.deferred_norm): with the fused split-K sum only the split that sums applies the token
    # rows' factors (they are linear in the sums); otherwise every program does, its shares requested before the loop
    LATE_NORM: tl.constexpr = ROW_NORM and SPLIT and FUSED_REDUCE
    shares = tl.zeros((PARTS_BLOCK, TOKENS), dtype=tl.float32)
    if ROW_NORM and not LATE_NORM:
        shares = first_shares(stats_ptr, n_parts, tl.arange(0, TOKENS), M_TOK, PARTS_BLOCK)
    c_first = tl.program_id(1) * chunks_per_split
    c_last = tl.minimum(c_first + chunks_per_split, KC)
    if KSPLIT:  # the warps' loop over their shares (the launcher splits K into whole, equal shares)
        c_last = c_first + chunks_per_split // WARPS
    codes = _trip_codes(row_g, row_h, c_first, UNROLL, ASM)
    codes_up = _trip_codes(row_g_up, row_h_up, c_first, UNROLL, ASM and SWIGLU)
    pdl_enter(PDL_WAIT, False)
    for c in range(c_first, c_last, UNROLL):
        if PREFETCH:  # the last trip requests its own codes again (cached), not past the split
            c_next = tl.minimum(c + UNROLL, c_last - UNROLL)
            codes_next = _trip_codes(row_g, row_h, c_next, UNROLL, ASM)
            codes_up_next = _trip_codes(row_g_up, row_h_up, c_next, UNROLL, ASM and SWIGLU)
        elif c > c_first:
            codes = _trip_codes(row_g, row_h, c, UNROLL, ASM)
            codes_up = _trip_codes(row_g_up, row_h_up, c, UNROLL, ASM and SWIGLU)
        acc, acc_up = _trip(acc, acc_up, codes, codes_up, q_row, q_row_up, s_row, s_row_up, x_lane, x_row0, x_row1,
                            x_ptr, c, k_off, stride_qn, stride_sn, CPG, UNROLL, SWIGLU, DECODE_ASM, DECODE_OPERANDS,
                            MMA_ASM, ASM)
        if PREFETCH:
            codes = codes_next
            codes_up = codes_up_next
    if KSPLIT:  # the warps' shares summed (through shared memory), every warp holding the tile's sums
        acc = warp_sums(acc, 4, WARPS)
        acc_up = warp_sums(acc_up, 4, WARPS) if SWIGLU else acc
    # accumulator i: row tile * 16 + g + 8 (i // 2), pair slot 2t + i % 2
    if ROW_NORM and not LATE_NORM:  # each pair's sums times its token row's factor, before SwiGLU
        f0, f1 = _pair_factors(shares, stats_ptr, n_parts, M_TOK, KC * 64, eps, tok_0, tok_1, TOKENS, PARTS_BLOCK)
        acc = (acc[0] * f0, acc[1] * f1, acc[2] * f0, acc[3] * f1)
        acc_up = (acc_up[0] * f0, acc_up[1] * f1, acc_up[2] * f0, acc_up[3] * f1)
    pid_s = tl.program_id(1)
    for i in tl.static_range(4):
        pair = pair0 if i % 2 == 0 else pair1
        n_idx = tile_out * 16 + g + 8 * (i // 2)
        mask = (tile_out < slots) & (pair < NK)
        y = acc[i]
        if not SWIGLU:  # the routing weight, before the split-K sum (it is linear)
            y = y * tl.load(rw_ptr + pair, mask=mask, other=0.0).to(tl.float32)
        if SPLIT:
            store_partials_at(ws_ptr, y, acc_up[i], pid_s, NK, pair, n_idx, mask, N_OUT, SWIGLU)
        else:
            finish_at(y, acc_up[i], pair, n_idx, mask, out_ptr, 0, out_ptr, stride_om, SWIGLU, False)
    if FUSED_REDUCE:
        if last_split_arrived(cnt_ptr):
            if LATE_NORM:  # the factors after the sum, before SwiGLU; the shares requested beside the partials
                shares = first_shares(stats_ptr, n_parts, tl.arange(0, TOKENS), M_TOK, PARTS_BLOCK)
            pairs = ()
            n_idxs = ()
            masks = ()
            for i in tl.static_range(4):
                pair = pair0 if i % 2 == 0 else pair1
                pairs, n_idxs = pairs + (pair,), n_idxs + (tile_out * 16 + g + 8 * (i // 2),)
                masks = masks + ((tile_out < slots) & (pair < NK),)
            if SUM_ACROSS:  # split after split for all four accumulators (dispatch.split_sum_across)
                sums = sum_splits_of(ws_ptr, pairs, n_idxs, masks, NK, N_OUT, tl.num_programs(1), SWIGLU)
                if LATE_NORM:
                    f0, f1 = _pair_factors(shares, stats_ptr, n_parts, M_TOK, KC * 64, eps, tok_0, tok_1, TOKENS,
                                           PARTS_BLOCK)
                for i in tl.static_range(4):
                    y, y_up = sums[2 * i], sums[2 * i + 1]
                    if LATE_NORM:
                        y, y_up = _times_pair_factor(y, y_up, f0, f1, i)
                    finish_at(y, y_up, pairs[i], n_idxs[i], masks[i], out_ptr, 0, out_ptr, stride_om, SWIGLU, False)
            else:
                if LATE_NORM:
                    f0, f1 = _pair_factors(shares, stats_ptr, n_parts, M_TOK, KC * 64, eps, tok_0, tok_1, TOKENS,
                                           PARTS_BLOCK)
                for i in tl.static_range(4):
                    y, y_up = sum_splits_at(ws_ptr, pairs[i], n_idxs[i], masks[i], NK, N_OUT, tl.num_programs(1),
                                            SWIGLU)
                    if LATE_NORM:
                        y, y_up = _times_pair_factor(y, y_up, f0, f1, i)
                    finish_at(y, y_up, pairs[i], n_idxs[i], masks[i], out_ptr, 0, out_ptr, stride_om, SWIGLU, False)
            reset_counter(cnt_ptr)


def takes_rows(rows: ExpertRows) -> bool:
    """Whether this kernel serves a call's rows: alignment-free decode rows, or rows aligned to blocks of 16."""
    return rows.direct or rows.block_m == ALIGNED_BLOCK


def launch_expert_mma(rows: ExpertRows, a: torch.Tensor, w, dst: torch.Tensor, rw: torch.Tensor, *, a_div: int,
                      swiglu: bool, cfg: GemmConfig, row_norm: NormedRows | None = None, early: bool = False) -> None:
    """``dst[pair] = f(a[pair // a_div] @ dequantize(w)[expert]^T)`` (``launch_quant_experts``'s contract) for an
    int4 stack ``w`` (a ``QuantizedTensor [E, N, K]``, row-major) through this kernel: ``cfg.num_warps`` 16-row
    tiles per program (``EXPERT_KSPLIT_KIND``: one tile, K split between the warps in whole, equal shares),
    ``cfg.block_k / 64`` chunks per loop trip, ``cfg.split_k``, ``num_stages > 1``: prefetch. Takes the
    alignment-free rows of decode (``rows.direct``) or rows aligned to blocks of 16. ``row_norm``: ``a`` is its scaled
    rows (at most ``MAX_NORMED_TOKENS``), normalized in the kernel. ``early``: ``rows``' ids were written
    before the kernel before this one started (:func:`ninfer.kernels.pdl.early_pdl`); otherwise the kernel only lets
    the next one launch early."""
    name = w.format.name
    n_out, k = dst.shape[1], a.shape[1]
    unroll = cfg.block_k // 64
    if not takes_rows(rows):
        raise ValueError(f"the expert register decode needs alignment-free rows or blocks of {ALIGNED_BLOCK}, got "
                         f"blocks of {rows.block_m}")
    ksplit = cfg.kind == EXPERT_KSPLIT_KIND
    if (cfg.kind not in EXPERT_KINDS or unroll not in (1, 2, 4) or cfg.block_k % 64
            or not expert_mma_fits(name, n_out, k, unroll) or cfg.block_k % FORMATS[name]):
        raise ValueError(f"expert register decode config {cfg} does not fit {name} N = {n_out}, K = {k}")
    q, scales = w.tensors["qweight"], w.tensors["scales"]
    asm = not INTERPRET and a.dtype in (torch.bfloat16, torch.float16)
    if asm and (a.data_ptr() % 16 or a.stride(0) % 8):  # 16-byte activation loads
        a = torch.empty_like(a, memory_format=torch.contiguous_format).copy_(a)
    kc = k // 64
    per, splits = fragment_splits(kc, unroll, cfg.split_k)
    if ksplit and (kc % per or per % (cfg.num_warps * unroll)):
        raise ValueError(f"expert config {cfg} does not split K = {k} into whole, equal shares of its warps")
    nk = rows.pairs
    ws = torch.empty(splits, nk, n_out * (2 if swiglu else 1), dtype=torch.float32, device=a.device) \
        if splits > 1 else dst
    tile_groups = n_out // 16 if ksplit else triton.cdiv(n_out // 16, cfg.num_warps)
    grid = (tile_groups, splits, nk if rows.direct else 2 * rows.blocks)
    counters = tile_counters(a.device, grid[0] * grid[2]) if splits > 1 else None
    ty = "f16" if a.dtype == torch.float16 else "bf16"
    ids, sorted_pairs, block_experts = (rows.flat_ids, None, None) if rows.direct else \
        (None, rows.sorted_pairs, rows.block_experts)
    if early and row_norm is not None:
        raise ValueError("an early launch reads its activations' norm statistics after its wait: pass plain rows")
    if row_norm is not None and a.shape[0] > MAX_NORMED_TOKENS:
        raise ValueError(f"the expert register decode normalizes at most {MAX_NORMED_TOKENS} token rows")
    tokens = triton.next_power_of_2(a.shape[0]) if row_norm is not None else 1  # its programs read every token's
    reads = reader_args(row_norm, tokens, rw)
    pdl = early_pdl(a.device) if early else Pdl(trigger=pdl_enabled(a.device))
    _expert_mma_kernel[grid](
        a, q, scales, rw, dst, ws, counters, ids, sorted_pairs, block_experts, reads.stats, nk, n_out, a_div, per, kc,
        a.stride(0), q.stride(0), q.stride(1), scales.stride(0), scales.stride(1), dst.stride(0), a.shape[0],
        reads.parts, reads.eps, ROW_NORM=row_norm is not None, TOKENS=tokens, PARTS_BLOCK=reads.parts_block,
        CPG=FORMATS[name] // 64, SWIGLU=swiglu,
        SPLIT=splits > 1, FUSED_REDUCE=counters is not None, SUM_ACROSS=counters is not None and split_sum_across(),
        WARPS=cfg.num_warps, UNROLL=unroll,
        PREFETCH=cfg.num_stages > 1, KSPLIT=ksplit, PAIRS_BLOCK=rows.pairs_block, ALIGNED=not rows.direct,
        DECODE_ASM=row_major_decode_asm(ty),
        DECODE_OPERANDS="=r," * 16 + "r,r,r,r", MMA_ASM=mma_asm(ty), ASM=asm, **pdl.constexprs(), **pdl.options(),
        num_warps=cfg.num_warps, num_stages=1,
    )
    if splits > 1 and counters is None:
        reduce_splits(ws, dst, dst, nk, splits, swiglu, False, min(triton.next_power_of_2(nk), 8))
