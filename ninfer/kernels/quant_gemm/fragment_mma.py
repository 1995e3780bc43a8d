"""int4 / int8 / nvfp4 decode GEMM from registers: ``y = x @ W^T`` for a few tokens, W in the fragment layout
(:mod:`.fragments`, :mod:`.fragments_fp4`).

The ``tl.dot`` decode (:mod:`.gemv_mma`) stages the packed weights through shared memory and reads at most about
half of the copy bandwidth whatever its tiles (``docs/performance.md``: the memory system gives a kernel that only
streams the bytes 80-92%). Here the weights go from global memory straight into the registers ``mma.sync`` takes:

* One warp per 16-row tile, one lane per thread (the program's tensors are 1-D, ``32 * WARPS`` long: element
  ``i`` is thread ``i``, which is what the inline PTX assumes). Per 64 columns a lane issues one 16-byte load of
  int4 codes or two of int8 (``ld.global.nc``, no L1 allocation: each byte is read once) and two 16-byte loads of
  each 8-token block of activations (L1 hits after the first warp), decodes its 16 A registers with bit tricks
  (:mod:`.fragment_ptx`: no conversion instructions) and runs four ``m16n8k16`` MMAs per 8-token block, reusing
  the decoded registers across the blocks.
* ``UNROLL`` chunks (64 columns each) per loop trip, all their loads issued before the first MMA: that many
  (int8: twice that many) 16-byte loads in flight per lane and weight stream (SwiGLU has two: the gate and the up
  tile of the same outputs). Each scale group's products accumulate in fp32 from zero and are scaled once (fp32), as the
  reference does per group. nvfp4's block scales (16 columns: one per lane and chunk) multiply the decoded A
  registers instead, so its MMAs accumulate every chunk in place; its per-row global scale multiplies the sums.
* A warp may hold two weight streams that share each activation load: SwiGLU's gate and up tiles of the same
  outputs, or (``kind="frag-pair"``) a tile in each half of the output. At 32 tokens a warp reads as many
  activation bytes from L1 as code bytes from memory; pairs gained 5-9% there on some shapes, nothing at 1-8
  tokens (run 2026-12-04.18).
* Fewer instructions did not make it faster: a decode without the ``fma`` (the codes' offset subtracted per
  group through MMAs of ones: 1.66 instead of 1.96 SASS instructions per int4 weight) ran 7-12% slower on the H200
  (run 2026-12-03.1, ``docs/performance.md``).
* Programmatic dependent launch (compute capability 9.0+; ``NINFER_PDL=0`` turns it off): the kernel may start
  while the previous one finishes; it requests its first codes (static weights), lets the next kernel launch
  (``griddepcontrol.launch_dependents``), then waits (``griddepcontrol.wait``) before anything reads the
  activations or writes.
* ``num_stages=2`` requests each next loop trip's codes before this trip's arithmetic. ``num_stages >= 3`` loads
  them with plain loads in a ``tl.range`` loop of that many stages instead, which the compiler's software pipeline
  turns into ``cp.async`` copies into shared memory ``num_stages - 1`` trips ahead (:func:`.load_trip_async`): the
  codes in flight per SM are then bounded by shared memory, not registers (Nsight Compute found the register decode
  waiting on its loads with a quarter to a half of the SM's warp slots filled: ``docs/performance.md``).
* ``kind="frag-ksplit"``: a program's warps share one tile, each over an equal share of its split's chunks, and sum
  their accumulators through shared memory after the loop (four at a time, :func:`.warp_sums`); warp 0 stores. An
  unsplit GEMM then writes its outputs without the partial sums' round trip through global memory below.
* Split-K over grid axis 1 with the deterministic epilogue of :mod:`.gemv_steps` (partials in an fp32 scratch,
  the last split to arrive sums them in split order: split after split for all of its accumulators at once (the
  default), with ``NINFER_SPLIT_SUM=each`` accumulator after accumulator, or with ``=tile`` the whole tile's partials
  of up to 16 splits in one round trip (``dispatch.split_sum_mode``); SwiGLU
  and residual after the sum), tiles over axis 0 and
  token blocks over axis 2, or the other way round when there are several token blocks (prefill sizes, e.g. the
  LM head of a scored prompt, too large for the dequantization path): the blocks of one tile then run side by
  side and all but the first read its codes from L2.
  The tuner chooses warps, trip length, tokens per program and splits per shape (:func:`fragment_candidates`).

The loop trip's pieces live in :mod:`.fragment_steps`. The interpreter cannot run PTX: with ``ASM`` off (CPU
tests, and fp32 activations on a GPU) each lane computes the same four products per 8-token block with Triton
gathers from the same layout and plain sums, so the CPU tests check the indexing, splits and epilogues, and the
GPU tests the PTX.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import INTERPRET, pdl_enabled, split_sum_mode
from ninfer.kernels.norms import NextNorm, NormedRows
from ninfer.kernels.quant_gemm.configs import KSPLIT_KIND, PAIR_KIND, GemmConfig
from ninfer.kernels.quant_gemm.deferred_norm import (
    add_lane_squares,
    first_shares,
    lane_factors,
    reader_args,
    rstd_of_shares,
    scaled_by_rows,
    store_row_stats,
)
from ninfer.kernels.quant_gemm.fragment_configs import ASYNC_MIN_STAGES, fragment_splits
from ninfer.kernels.quant_gemm.fragment_epilogue import (
    finish_outputs,
    lane_position,
    row_scaled,
    warp_share,
    warp_sums,
)
from ninfer.kernels.quant_gemm.fragment_ptx import asm_constants
from ninfer.kernels.quant_gemm.fragment_steps import (
    l2_prefetch_first_trips,
    load_trip,
    load_trip_async,
    trip_step,
    trip_step_fp4,
)
from ninfer.kernels.quant_gemm.fragments import CHUNK_COLS, TILE_ROWS, code_bits, words
from ninfer.kernels.quant_gemm.gemv import tile_counters
from ninfer.kernels.quant_gemm.gemv_steps import (
    last_split_arrived,
    reduce_splits,
    reset_counter,
    store_partials_at,
    sum_splits_at,
    sum_splits_of,
    sum_splits_tile,
)
from ninfer.kernels.quant_gemm.norm_epilogue import NORM_COLS, norm_when_all_arrived


@triton.jit(do_not_specialize=["M", "chunks_per_split"])
def _fragment_mma_kernel(
    x_ptr, q_ptr, s_ptr, rs_ptr, res_ptr, out_ptr, ws_ptr, cnt_ptr, nw_ptr, normed_ptr, stats_in_ptr, stats_out_ptr,
    M, N_OUT, KC, NG, chunks_per_split, stride_xm, stride_rm, stride_om, stride_nm, eps, parts_in, eps_in,
    CPG: tl.constexpr, NORM: tl.constexpr, NORM_CHUNKS: tl.constexpr, DEFER: tl.constexpr, ROW_NORM: tl.constexpr,
    PARTS_BLOCK: tl.constexpr, SWIGLU: tl.constexpr, PAIR: tl.constexpr,
    HAS_RES: tl.constexpr,
    SPLIT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr, SUM_ACROSS: tl.constexpr, SUM_TILE: tl.constexpr, S_BLOCK: tl.constexpr,
    NB: tl.constexpr, WARPS: tl.constexpr, UNROLL: tl.constexpr,
    PREFETCH: tl.constexpr, STAGES: tl.constexpr, KSPLIT: tl.constexpr,
    TOKENS_FIRST: tl.constexpr, PDL: tl.constexpr, BITS: tl.constexpr, FP4: tl.constexpr, LOAD0: tl.constexpr,
    LOAD1: tl.constexpr, LOAD2: tl.constexpr, LOAD3: tl.constexpr, DECODE_ASM: tl.constexpr,
    DECODE_OPERANDS: tl.constexpr, MMA_ASM: tl.constexpr, SCALE_ASM: tl.constexpr, ASM: tl.constexpr,
):
    TWO: tl.constexpr = SWIGLU or PAIR
    ASYNC: tl.constexpr = STAGES >= 3
    e = tl.arange(0, 32 * WARPS)  # one element per thread: element i is thread i (lane i % 32 of warp i // 32)
    lane = e % 32
    g = lane // 4
    t = lane % 4
    # A warp's first stream is tile tile_out of `slots`; its second (TWO) the tile `slots` further on: the up
    # rows of the same outputs (SwiGLU: the weight has 2 N_OUT rows), or (PAIR) the second half's tile.
    slots = N_OUT // (32 if PAIR else 16)
    if TOKENS_FIRST:  # several token blocks: those of one tile run side by side and share its codes through L2
        tile_out = tl.program_id(2) * WARPS + e // 32
        tok0 = tl.program_id(0) * 8 * NB
    else:
        tile_out = tl.program_id(0) * WARPS + e // 32
        tok0 = tl.program_id(2) * 8 * NB
    tile = tl.minimum(tile_out, slots - 1)  # a clamped tile loads valid memory; its stores are masked
    k_off = 0  # the warp's first chunk after its split's
    if KSPLIT:  # every warp on the program's one tile, over its share of the split's chunks; warp 0 stores the sums
        prog_tile = tl.program_id(2) if TOKENS_FIRST else tl.program_id(0)
        tile, tile_out, k_off = warp_share(prog_tile, e, slots, chunks_per_split, WARPS)
    # lane (g, t)'s codes of chunk 0, its activations of token block b (row tok0 + 8b + g, clamped; columns
    # 64 c + 16 t .. + 15 of chunk c) and its scale pair of group 0
    x_lane = ()
    code_lane = tile  # placeholders: the interpreter's body gathers from q_ptr itself
    code_lane_up = tile
    if ASM:
        code_lane = q_ptr.to(tl.int64) + (tile.to(tl.int64) * KC + k_off) * (128 * BITS) + lane * 16
        code_lane_up = code_lane + slots.to(tl.int64) * KC * (128 * BITS)
        if ASYNC:  # q_ptr: the codes as int32 words
            code_words = q_ptr + (tile.to(tl.int64) * KC + k_off) * (32 * BITS) + lane * 4
            code_words_up = code_words + slots.to(tl.int64) * KC * (32 * BITS)
        for b in tl.static_range(NB):
            row = tl.minimum(tok0 + 8 * b + g, M - 1).to(tl.int64)
            x_lane = x_lane + (x_ptr.to(tl.int64) + (row * stride_xm + k_off * 64 + t * 16) * 2,)
    if FP4:  # the lane's scale word of chunks 0 and 1 (a tile's scales: KC * 16 words)
        s_lane = s_ptr + tile.to(tl.int64) * KC * 16 + (k_off // 2) * 32 + lane
        s_lane_up = s_lane + slots.to(tl.int64) * KC * 16
    else:
        s_lane = s_ptr + tile.to(tl.int64) * NG * 8 + (k_off // CPG) * 8 + g
        s_lane_up = s_lane + slots.to(tl.int64) * NG * 8
    acc = ()
    for i in tl.static_range(4 * NB):
        acc = acc + (tl.zeros((32 * WARPS,), dtype=tl.float32),)
    acc_up = acc
    c_first = tl.program_id(1) * chunks_per_split
    c_last = tl.minimum(c_first + chunks_per_split, KC)
    if KSPLIT:  # the warps' loop over their shares (the launcher splits K into whole, equal shares)
        c_last = c_first + chunks_per_split // WARPS
    # The weights do not depend on the previous kernel: the first trip's codes are requested before waiting
    # for it (programmatic dependent launch), and with PREFETCH each trip requests the next one's. With STAGES the
    # loop's software pipeline copies codes STAGES - 1 trips ahead into shared memory; before the wait, the L2 is
    # asked for the lines of those first trips.
    if ASYNC:
        if PDL:
            LINES: tl.constexpr = ((STAGES - 1) * UNROLL * BITS + 31) // 32
            l2_prefetch_first_trips(code_lane - lane * 16, lane, c_first, c_last, LINES, BITS)
            if TWO:
                l2_prefetch_first_trips(code_lane_up - lane * 16, lane, c_first, c_last, LINES, BITS)
    else:
        codes = load_trip(code_lane, s_lane, c_first, UNROLL, ASM, BITS, FP4, LOAD0, LOAD1, LOAD2, LOAD3)
        codes_up = load_trip(code_lane_up, s_lane_up, c_first, UNROLL, ASM and TWO, BITS, FP4, LOAD0, LOAD1, LOAD2,
                             LOAD3)
    if PDL:
        # The next kernel may launch once every program of this one has got here, so its programs fill the SMs
        # this one's last programs leave, and request their own codes meanwhile; it waits for this one to
        # finish before it reads what this one writes.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # ROW_NORM (x holds h * (1 + w): .deferred_norm): the rows' factors are linear in the sums, so with the fused
    # split-K sum only the split that sums applies them (after the sum, before SwiGLU); otherwise every program
    # does, its shares requested before the loop and summed after it.
    LATE_NORM: tl.constexpr = ROW_NORM and SPLIT and FUSED_REDUCE
    rows_t = tok0 + tl.arange(0, 8 * NB)
    shares = tl.zeros((PARTS_BLOCK, 8 * NB), dtype=tl.float32)
    if ROW_NORM and not LATE_NORM:
        shares = first_shares(stats_in_ptr, parts_in, rows_t, M, PARTS_BLOCK)
    for c in tl.range(c_first, c_last, UNROLL, num_stages=STAGES):
        if ASYNC:
            if ASM:
                codes = load_trip_async(code_words, s_lane, c, UNROLL, BITS, FP4)
                codes_up = codes
                if TWO:
                    codes_up = load_trip_async(code_words_up, s_lane_up, c, UNROLL, BITS, FP4)
            else:  # the interpreter's body gathers its own
                codes, codes_up = c, c
        elif PREFETCH:  # the last trip requests its own codes again (cached), not past the split
            c_next = tl.minimum(c + UNROLL, c_last - UNROLL)
            codes_next = load_trip(code_lane, s_lane, c_next, UNROLL, ASM, BITS, FP4, LOAD0, LOAD1, LOAD2, LOAD3)
            codes_up_next = load_trip(code_lane_up, s_lane_up, c_next, UNROLL, ASM and TWO, BITS, FP4, LOAD0, LOAD1,
                                      LOAD2, LOAD3)
        elif c > c_first:
            codes = load_trip(code_lane, s_lane, c, UNROLL, ASM, BITS, FP4, LOAD0, LOAD1, LOAD2, LOAD3)
            codes_up = load_trip(code_lane_up, s_lane_up, c, UNROLL, ASM and TWO, BITS, FP4, LOAD0, LOAD1, LOAD2,
                                 LOAD3)
        if FP4:
            acc, acc_up = trip_step_fp4(acc, acc_up, codes, codes_up, q_ptr, s_ptr, x_ptr, x_lane, tile, tile + slots,
                                        c, k_off, g, t, tok0, M, KC, stride_xm, UNROLL, NB, TWO, DECODE_ASM,
                                        DECODE_OPERANDS, MMA_ASM, SCALE_ASM, ASM)
        else:
            acc, acc_up = trip_step(acc, acc_up, codes, codes_up, q_ptr, s_lane, s_lane_up, x_ptr, x_lane, tile,
                                    tile + slots, c, k_off, g, t, tok0, M, KC, stride_xm, CPG, UNROLL, NB, BITS, TWO,
                                    DECODE_ASM, DECODE_OPERANDS, MMA_ASM, ASM)
        if PREFETCH:
            codes = codes_next
            codes_up = codes_up_next
    if KSPLIT:  # the warps' shares summed (through shared memory), every warp holding the tile's sums
        acc = warp_sums(acc, 4 * NB, WARPS)
        acc_up = warp_sums(acc_up, 4 * NB, WARPS) if TWO else acc
    if ROW_NORM and not LATE_NORM:
        r = rstd_of_shares(shares, stats_in_ptr, parts_in, rows_t, M, KC * 64, eps_in, PARTS_BLOCK)
        acc, acc_up = scaled_by_rows(acc, r, t, NB), scaled_by_rows(acc_up, r, t, NB)
    pid_s = tl.program_id(1)
    prog = tl.program_id(2) if TOKENS_FIRST else tl.program_id(0)  # the program's tile group
    n_stream = slots * 16  # output columns per stream; a pair's second stream writes the second half
    sq_rows = tl.zeros((32 * WARPS, 8 * NB), dtype=tl.float32)  # DEFER: each lane's squares by row of the block
    if FP4:
        acc, acc_up = row_scaled(acc, acc_up, rs_ptr, tile_out, slots, g, t, tok0, M, n_stream, NB, TWO)
    if SPLIT:  # partials [split, M, 2 * n_stream] for two streams: the second stream's at + n_stream
        for i in tl.static_range(4 * NB):
            m_idx, n_idx, mask = lane_position(i, tile_out, slots, g, t, tok0, M)
            store_partials_at(ws_ptr, acc[i], acc_up[i], pid_s, M, m_idx, n_idx, mask, n_stream, TWO)
        if FUSED_REDUCE:
            if last_split_arrived(cnt_ptr):
                if LATE_NORM:  # requested beside the partials
                    shares = first_shares(stats_in_ptr, parts_in, rows_t, M, PARTS_BLOCK)
                if SUM_TILE:  # the program's whole tile: rows of its warps' tiles, its token block
                    m_t = rows_t[:, None]
                    n_t = (prog * 16 * WARPS + tl.arange(0, 16 * WARPS))[None, :]
                    mask_t = (m_t < M) & (n_t < n_stream)
                    y, y_up = sum_splits_tile(ws_ptr, m_t, n_t, mask_t, M, n_stream, tl.num_programs(1), TWO, S_BLOCK)
                    if LATE_NORM:
                        r = rstd_of_shares(shares, stats_in_ptr, parts_in, rows_t, M, KC * 64, eps_in, PARTS_BLOCK)
                        y, y_up = y * r[:, None], y_up * r[:, None]
                    sq = finish_outputs(y, y_up, m_t, n_t, mask_t, n_stream, res_ptr, stride_rm, out_ptr, stride_om,
                                        nw_ptr, normed_ptr, stride_nm, SWIGLU, PAIR, HAS_RES, NORM, DEFER)
                    if DEFER:
                        store_row_stats(stats_out_ptr, prog, rows_t, M, tl.sum(sq, axis=1))
                elif SUM_ACROSS:
                    m_idxs = ()
                    n_idxs = ()
                    masks = ()
                    for i in tl.static_range(4 * NB):
                        m_idx, n_idx, mask = lane_position(i, tile_out, slots, g, t, tok0, M)
                        m_idxs, n_idxs, masks = m_idxs + (m_idx,), n_idxs + (n_idx,), masks + (mask,)
                    sums = sum_splits_of(ws_ptr, m_idxs, n_idxs, masks, M, n_stream, tl.num_programs(1), TWO)
                    if LATE_NORM:
                        r = rstd_of_shares(shares, stats_in_ptr, parts_in, rows_t, M, KC * 64, eps_in, PARTS_BLOCK)
                    for i in tl.static_range(4 * NB):
                        y, y_up = sums[2 * i], sums[2 * i + 1]
                        if LATE_NORM:
                            f = lane_factors(r, t, 8 * (i // 4) + i % 2, 8 * NB)
                            y, y_up = y * f, y_up * f
                        sq = finish_outputs(y, y_up, m_idxs[i], n_idxs[i], masks[i], n_stream, res_ptr, stride_rm,
                                            out_ptr, stride_om, nw_ptr, normed_ptr, stride_nm, SWIGLU, PAIR, HAS_RES,
                                            NORM, DEFER)
                        if DEFER:
                            sq_rows = add_lane_squares(sq_rows, sq, 8 * (i // 4) + 2 * t + i % 2, 8 * NB)
                    if DEFER:
                        store_row_stats(stats_out_ptr, prog, rows_t, M, tl.sum(sq_rows, axis=0))
                else:
                    if LATE_NORM:
                        r = rstd_of_shares(shares, stats_in_ptr, parts_in, rows_t, M, KC * 64, eps_in, PARTS_BLOCK)
                    for i in tl.static_range(4 * NB):
                        m_idx, n_idx, mask = lane_position(i, tile_out, slots, g, t, tok0, M)
                        y, y_up = sum_splits_at(ws_ptr, m_idx, n_idx, mask, M, n_stream, tl.num_programs(1), TWO)
                        if LATE_NORM:
                            f = lane_factors(r, t, 8 * (i // 4) + i % 2, 8 * NB)
                            y, y_up = y * f, y_up * f
                        sq = finish_outputs(y, y_up, m_idx, n_idx, mask, n_stream, res_ptr, stride_rm, out_ptr,
                                            stride_om, nw_ptr, normed_ptr, stride_nm, SWIGLU, PAIR, HAS_RES, NORM,
                                            DEFER)
                        if DEFER:
                            sq_rows = add_lane_squares(sq_rows, sq, 8 * (i // 4) + 2 * t + i % 2, 8 * NB)
                    if DEFER:
                        store_row_stats(stats_out_ptr, prog, rows_t, M, tl.sum(sq_rows, axis=0))
                reset_counter(cnt_ptr)
                if NORM:
                    norm_when_all_arrived(cnt_ptr, out_ptr, stride_om, nw_ptr, normed_ptr, stride_nm, M, N_OUT, eps,
                                          NORM_CHUNKS)
    else:
        for i in tl.static_range(4 * NB):
            m_idx, n_idx, mask = lane_position(i, tile_out, slots, g, t, tok0, M)
            sq = finish_outputs(acc[i], acc_up[i], m_idx, n_idx, mask, n_stream, res_ptr, stride_rm, out_ptr,
                                stride_om, nw_ptr, normed_ptr, stride_nm, SWIGLU, PAIR, HAS_RES, NORM, DEFER)
            if DEFER:
                sq_rows = add_lane_squares(sq_rows, sq, 8 * (i // 4) + 2 * t + i % 2, 8 * NB)
        if DEFER:
            store_row_stats(stats_out_ptr, prog, rows_t, M, tl.sum(sq_rows, axis=0))
        if NORM:
            norm_when_all_arrived(cnt_ptr, out_ptr, stride_om, nw_ptr, normed_ptr, stride_nm, M, N_OUT, eps,
                                  NORM_CHUNKS)


def fragment_tile_groups(n_out: int, cfg: GemmConfig) -> int:
    """Programs along the output of ``cfg`` over ``n_out`` outputs: the parts of a deferred norm's row sums."""
    if cfg.kind == KSPLIT_KIND:  # one tile a program
        return n_out // TILE_ROWS
    return triton.cdiv(n_out // (2 * TILE_ROWS if cfg.kind == PAIR_KIND else TILE_ROWS), cfg.num_warps)


def launch_fragment_mma(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, res: torch.Tensor | None,
                        out: torch.Tensor, swiglu: bool, group: int, cfg: GemmConfig,
                        row_scale: torch.Tensor | None = None, norm: NextNorm | None = None,
                        deferred: NormedRows | None = None, row_norm: NormedRows | None = None) -> None:
    """Launch the fragment decode (``cfg.kind``: ``"frag"``, ``"frag-pair"``: two tiles per warp, one in each
    half of the output, or ``"frag-ksplit"``: the program's warps on one tile, each over an equal share of its
    split's chunks, summed through shared memory, which needs K in whole, equal shares; ``block_m`` tokens per
    program (8, 16, 32 or 64), ``num_warps`` warps of 16 rows (a pair 32) per program, ``block_k / 64`` chunks per
    loop trip, ``split_k``) on codes and scales in the fragment
    layout; ``x [M, K]`` with unit stride along K, ``out [M, N_OUT]`` contiguous. nvfp4 (``row_scale``: its
    per-row global scales) has scale groups of 16 and an even number of chunks per trip. With ``norm`` (as the MoE
    combine takes it) ``y + norm.residual`` goes to ``norm.new_residual`` and ``out`` receives its RMSNorm, written by
    the launch's last program (:mod:`.norm_epilogue`; it needs the device's arrival counters, ``tile_counters``), or
    with ``deferred`` too, ``deferred`` receives it in the deferred form (:mod:`.deferred_norm`: ``deferred.stats``
    has :func:`fragment_tile_groups` parts). ``row_norm``: ``x`` is ``row_norm.scaled``, whose rows the kernel
    normalizes by ``row_norm.stats``."""
    normed = out
    if norm is not None:
        if res is not None or swiglu:
            raise ValueError("a GEMM that applies the norm after it takes its residual from the norm, and no SwiGLU")
        res, out = norm.residual, norm.new_residual
        if deferred is not None:
            normed = deferred.scaled
    m, k = x.shape
    n_out = out.shape[1]
    unroll = cfg.block_k // CHUNK_COLS
    fp4 = row_scale is not None
    cpg = 1 if fp4 else group // CHUNK_COLS
    pair = cfg.kind == PAIR_KIND
    ksplit = cfg.kind == KSPLIT_KIND
    rows = 2 * TILE_ROWS if pair else TILE_ROWS
    bad_group = (unroll % 2 or group != 16) if fp4 else (group % CHUNK_COLS or unroll % cpg)
    if (bad_group or k % cfg.block_k or n_out % rows or cfg.block_m not in (8, 16, 32, 64)
            or (pair and swiglu)):
        raise ValueError(f"frag config {cfg} does not fit K = {k}, N = {n_out}, scale group {group}"
                         + (", SwiGLU" if swiglu else ""))
    asm = not INTERPRET and x.dtype in (torch.bfloat16, torch.float16)
    bits = code_bits(q)
    pdl = asm and pdl_enabled(x.device)
    if asm and (x.data_ptr() % 16 or x.stride(0) % 8):  # 16-byte activation loads
        x = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)
    kc = k // CHUNK_COLS
    per, splits = fragment_splits(kc, unroll, cfg.split_k)
    if ksplit and (kc % per or per % (cfg.num_warps * unroll)):
        raise ValueError(f"frag-ksplit config {cfg} does not split K = {k} into whole, equal shares of its warps")
    ws = torch.empty(splits, m, n_out * (2 if swiglu else 1), dtype=torch.float32, device=x.device) \
        if splits > 1 else out
    res_arg = res if res is not None else out
    tile_groups = n_out // rows if ksplit else triton.cdiv(n_out // rows, cfg.num_warps)
    token_blocks = triton.cdiv(m, cfg.block_m)
    tokens_first = token_blocks > 1 and tile_groups <= 65535  # grid axis 2 holds at most 65535
    grid = (token_blocks, splits, tile_groups) if tokens_first else (tile_groups, splits, token_blocks)
    sum_mode = split_sum_mode()
    last_norm = norm is not None and deferred is None  # the last program normalizes (.norm_epilogue)
    counters = tile_counters(x.device, grid[0] * grid[2] + last_norm) if splits > 1 or last_norm else None
    if (last_norm or (deferred is not None and splits > 1)) and counters is None:
        raise ValueError("the norm after a GEMM needs arrival counters: none are free for this launch")
    if deferred is not None and tuple(deferred.stats.shape) != (fragment_tile_groups(n_out, cfg), m):
        raise ValueError(f"deferred norm stats of shape {tuple(deferred.stats.shape)} for {cfg} over {m} x {n_out}")
    if row_norm is not None and (row_norm.scaled.shape != x.shape or row_norm.stats.shape[1] != m):
        raise ValueError("row_norm must describe x (its scaled rows) and have one column of stats per row")
    nw, eps = (norm.weight, norm.eps) if norm is not None else (out, 0.0)
    reads = reader_args(row_norm, cfg.block_m, out)
    stats_out = deferred.stats if deferred is not None else out
    tile_sum = splits > 1 and counters is not None and sum_mode == "tile" and not ksplit  # its sum: split after split
    stages = cfg.num_stages if cfg.num_stages >= ASYNC_MIN_STAGES else 1  # the loop's software pipeline
    _fragment_mma_kernel[grid](
        x, q if asm and stages == 1 else words(q), words(scales), row_scale if fp4 else scales, res_arg, out, ws,
        counters, nw, normed, reads.stats, stats_out, m, n_out, kc, k // group, per, x.stride(0), res_arg.stride(0),
        out.stride(0), normed.stride(0), eps, reads.parts, reads.eps,
        CPG=cpg, NORM=last_norm, NORM_CHUNKS=triton.cdiv(n_out, NORM_COLS) if last_norm else 1,
        DEFER=deferred is not None, ROW_NORM=row_norm is not None, PARTS_BLOCK=reads.parts_block,
        SWIGLU=swiglu,
        PAIR=pair, HAS_RES=res is not None, SPLIT=splits > 1, FUSED_REDUCE=counters is not None,
        SUM_ACROSS=counters is not None and (sum_mode == "across" or (ksplit and sum_mode == "tile")),
        SUM_TILE=tile_sum,  # S_BLOCK: one variant otherwise
        S_BLOCK=min(triton.next_power_of_2(splits), max(1, 16 // ((cfg.block_m // 8) * (2 if swiglu or pair else 1))))
        if tile_sum else 1,
        NB=cfg.block_m // 8,
        WARPS=cfg.num_warps, UNROLL=unroll, PREFETCH=cfg.num_stages == 2, STAGES=stages, KSPLIT=ksplit,
        TOKENS_FIRST=tokens_first, PDL=pdl,
        ASM=asm,
        BITS=bits, FP4=fp4, num_warps=cfg.num_warps, num_stages=1, **asm_constants(x.dtype, bits, fp4),
        **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}), **({"launch_pdl": True} if pdl else {}),
    )
    if splits > 1 and counters is None:
        reduce_splits(ws, res_arg, out, m, splits, swiglu, res is not None)
