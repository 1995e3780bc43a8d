"""The loop-trip building blocks of the register decode (:mod:`.fragment_mma`): a lane's loads of codes, scales and
activations, the PTX decode into ``mma.sync`` A registers, the MMAs of one chunk and token block, and one trip over
``UNROLL`` chunks for int4 / int8 (:func:`trip_step`: per scale group from zero, scaled once) and for nvfp4
(:func:`trip_step_fp4`: the block scales in the A registers); in the interpreter, and for fp32 activations, Triton
gathers of the same layout (:func:`chunk_portable`). The expert register decode (``kernels/moe/quant_mma.py``) shares
the decode, the MMAs and the activation loads.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ninfer.kernels.pdl import l2_prefetch
from ninfer.kernels.quant_gemm.fragment_ptx import x_load_asm
from ninfer.kernels.quant_gemm.fragments import fragment_values, scale_pair
from ninfer.kernels.quant_gemm.fragments_fp4 import FP4_OUT_SCALE, fp4_fragment_scales, fp4_fragment_values

# Activation loads at a chunk's constant offset from the loop trip's address (folded into the instruction, no
# address arithmetic per chunk).
_X0, _X1, _X2, _X3 = (tl.constexpr(x_load_asm(u)) for u in range(4))
_MMA_OPERANDS = tl.constexpr("=f,=f,=f,=f," + "r," * 24 + "f,f,f,f")


@triton.jit
def load_codes(addr, LOAD: tl.constexpr, BITS: tl.constexpr):
    """A lane's codes of one chunk (``LOAD``: its load at a constant offset from ``addr``): 4 words (int4) or 8."""
    if BITS == 4:
        w = tl.inline_asm_elementwise(LOAD, "=r,=r,=r,=r,l", [addr], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    else:
        w = tl.inline_asm_elementwise(LOAD, "=r,=r,=r,=r,=r,=r,=r,=r,l", [addr], dtype=(tl.int32,) * 8,
                                      is_pure=True, pack=1)
    return w


@triton.jit
def x_words(addr, U: tl.constexpr, X0: tl.constexpr, X1: tl.constexpr, X2: tl.constexpr, X3: tl.constexpr,
            PURE: tl.constexpr):
    """A lane's 8 activation words of chunk ``U`` of the loop trip at ``addr``, by the load ``X<U % 4>`` (its inline
    PTX at that chunk's constant offset) from ``addr`` moved on by 4 chunks (128 bytes each) per 4 chunks before."""
    cons: tl.constexpr = "=r,=r,=r,=r,=r,=r,=r,=r,l"
    if U >= 4:
        addr = addr + (U // 4) * 512
    if U % 4 == 0:
        x = tl.inline_asm_elementwise(X0, cons, [addr], dtype=(tl.int32,) * 8, is_pure=PURE, pack=1)
    elif U % 4 == 1:
        x = tl.inline_asm_elementwise(X1, cons, [addr], dtype=(tl.int32,) * 8, is_pure=PURE, pack=1)
    elif U % 4 == 2:
        x = tl.inline_asm_elementwise(X2, cons, [addr], dtype=(tl.int32,) * 8, is_pure=PURE, pack=1)
    else:
        x = tl.inline_asm_elementwise(X3, cons, [addr], dtype=(tl.int32,) * 8, is_pure=PURE, pack=1)
    return x


@triton.jit
def load_x(addr, U: tl.constexpr):
    """A lane's 16 activations (8 words) of chunk ``U`` of the loop trip at ``addr``. Not pure: the
    compiler must not move them above the wait for the kernel that wrote them (programmatic dependent launch)."""
    return x_words(addr, U, _X0, _X1, _X2, _X3, False)


@triton.jit
def decode_codes(w, DECODE_ASM: tl.constexpr, DECODE_OPERANDS: tl.constexpr, BITS: tl.constexpr):
    """One chunk's code words ``w`` (4 for int4, 8 for int8) -> the 16 A registers of its four MMAs."""
    if BITS == 4:
        args = [w[0], w[1], w[2], w[3]]
    else:
        args = [w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]
    return tl.inline_asm_elementwise(DECODE_ASM, DECODE_OPERANDS, args, dtype=(tl.int32,) * 16, is_pure=True, pack=1)


@triton.jit
def decode_fp4(w, s_lo, s_hi, DECODE_ASM: tl.constexpr, DECODE_OPERANDS: tl.constexpr):
    """One chunk's nvfp4 code words ``w`` and the lane's scale pairs of rows g / g + 8 -> the 16 A registers."""
    args = [w[0], w[1], w[2], w[3], s_lo, s_hi]
    return tl.inline_asm_elementwise(DECODE_ASM, DECODE_OPERANDS, args, dtype=(tl.int32,) * 16, is_pure=True, pack=1)


@triton.jit
def scale_pairs(word, SCALE_ASM: tl.constexpr):
    """A lane's nvfp4 scale word of two chunks -> its scale pairs (chunk 0 rows g, g + 8, chunk 1 rows g, g + 8)."""
    return tl.inline_asm_elementwise(SCALE_ASM, "=r,=r,=r,=r,r", [word], dtype=(tl.int32,) * 4, is_pure=True, pack=1)


@triton.jit
def mma_block(a, xw, c0, c1, c2, c3, MMA_ASM: tl.constexpr):
    """The four MMAs of one chunk and 8-token block: A registers ``a``, activation words ``xw``, accumulators in."""
    args = [a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15],
            xw[0], xw[1], xw[2], xw[3], xw[4], xw[5], xw[6], xw[7], c0, c1, c2, c3]
    return tl.inline_asm_elementwise(MMA_ASM, _MMA_OPERANDS, args, dtype=(tl.float32,) * 4, is_pure=True, pack=1)


@triton.jit
def chunk_portable(d, q_ptr, s_ptr, x_ptr, tile, c, g, t, tok0, M, KC, stride_xm, NB: tl.constexpr,
                   BITS: tl.constexpr, FP4: tl.constexpr):
    """What the PTX of one chunk adds to ``d`` (4 per token block: rows g / g + 8 x tokens 2t / 2t + 1), from
    Triton gathers of the same layout (interpreter, fp32 activations); nvfp4's weights scaled as its PTX scales
    them (``e2m1 * scale * 2^-8``). ``c``: the chunk, one for the program or (warps splitting K) one per lane."""
    c = (c + tl.zeros_like(tile))[:, None]
    cols = tl.arange(0, 64)[None, :]
    chunk_word = (tile.to(tl.int64)[:, None] * KC + c) * (32 * BITS)
    if FP4:
        s_lo = fp4_fragment_scales(s_ptr, tile[:, None], KC, c, g[:, None], 0, cols // 16) / FP4_OUT_SCALE
        s_hi = fp4_fragment_scales(s_ptr, tile[:, None], KC, c, g[:, None], 1, cols // 16) / FP4_OUT_SCALE
        lo = fp4_fragment_values(q_ptr, chunk_word, g[:, None], 0, cols) * s_lo
        hi = fp4_fragment_values(q_ptr, chunk_word, g[:, None], 1, cols) * s_hi
    else:
        lo = fragment_values(q_ptr, chunk_word, g[:, None], 0, cols, BITS).to(tl.float32)
        hi = fragment_values(q_ptr, chunk_word, g[:, None], 1, cols, BITS).to(tl.float32)
    out = ()
    for b in tl.static_range(NB):
        tok = tok0 + 8 * b + 2 * t
        x0 = tl.load(x_ptr + tl.minimum(tok, M - 1).to(tl.int64)[:, None] * stride_xm + c * 64 + cols).to(tl.float32)
        x1 = tl.load(x_ptr + tl.minimum(tok + 1, M - 1).to(tl.int64)[:, None] * stride_xm + c * 64 + cols)
        x1 = x1.to(tl.float32)
        out = out + (d[4 * b] + tl.sum(lo * x0, axis=1), d[4 * b + 1] + tl.sum(lo * x1, axis=1),
                     d[4 * b + 2] + tl.sum(hi * x0, axis=1), d[4 * b + 3] + tl.sum(hi * x1, axis=1))
    return out


@triton.jit
def load_trip(code_lane, scale_lane, c, UNROLL: tl.constexpr, ASM: tl.constexpr, BITS: tl.constexpr,
              FP4: tl.constexpr, LOAD0: tl.constexpr, LOAD1: tl.constexpr, LOAD2: tl.constexpr, LOAD3: tl.constexpr):
    """A lane's codes of the ``UNROLL`` chunks from chunk ``c`` (``code_lane``: its address of chunk 0), then for
    nvfp4 its scale word of each pair of them (``scale_lane``: its word of chunks 0 and 1); nothing in the
    interpreter's body, which gathers its own."""
    codes = ()
    if ASM:
        trip_codes = code_lane + c * (128 * BITS)
        for u in tl.static_range(UNROLL):
            # LOAD<j> loads chunk j of four at its constant offset: chunks past the fourth move the address on
            quad = trip_codes + (u // 4) * (4 * 128 * BITS)
            if u % 4 == 0:
                codes = codes + (load_codes(quad, LOAD0, BITS),)
            elif u % 4 == 1:
                codes = codes + (load_codes(quad, LOAD1, BITS),)
            elif u % 4 == 2:
                codes = codes + (load_codes(quad, LOAD2, BITS),)
            else:
                codes = codes + (load_codes(quad, LOAD3, BITS),)
        if FP4:
            for p in tl.static_range(UNROLL // 2):
                codes = codes + (tl.load(scale_lane + (c // 2 + p) * 32),)
    return codes


@triton.jit
def _four_words(block):
    """A lane's 16-byte row ``[N, 4]`` of int32 as its four words ``[N]`` each (the tuple :func:`load_codes` gives)."""
    evens, odds = tl.split(tl.reshape(block, (block.shape[0], 2, 2)))  # words 0, 2 and words 1, 3
    w0, w2 = tl.split(evens)
    w1, w3 = tl.split(odds)
    return w0, w1, w2, w3


@triton.jit
def load_trip_async(code_words, scale_lane, c, UNROLL: tl.constexpr, BITS: tl.constexpr, FP4: tl.constexpr):
    """:func:`load_trip` through plain loads (``code_words``: the lane's first code word of chunk 0, an int32
    pointer ``[N]``), which the compiler's software pipeline of a ``tl.range(..., num_stages=S)`` loop turns into
    16-byte ``cp.async`` copies into shared memory, ``S - 1`` loop trips ahead: the bytes in flight are then bounded
    by shared memory, not by registers. int8 chunks are two 16-byte rows, 512 bytes apart."""
    quad = tl.arange(0, 4)[None, :]
    codes = ()
    for u in tl.static_range(UNROLL):
        row = code_words + (c + u) * (32 * BITS)
        w = _four_words(tl.load(row[:, None] + quad, cache_modifier=".cg"))
        if BITS == 8:
            w = w + _four_words(tl.load(row[:, None] + 128 + quad, cache_modifier=".cg"))
        codes = codes + (w,)
    if FP4:
        for p in tl.static_range(UNROLL // 2):
            codes = codes + (tl.load(scale_lane + (c // 2 + p) * 32),)
    return codes


@triton.jit
def l2_prefetch_first_trips(tile_codes, lane, c_first, c_last, LINES: tl.constexpr, BITS: tl.constexpr):
    """Ask the L2 for the first ``32 * LINES`` 128-byte lines of a split's codes (``tile_codes``: the address of
    the lane's tile's chunk 0; chunks ``[c_first, c_last)``), one line per lane and step, clamped to the split:
    issued before a programmatic-dependent-launch wait, so the pipeline's first copies after it hit the L2."""
    first = tile_codes + c_first * (128 * BITS)
    last = tile_codes + c_last * (128 * BITS) - 1
    for j in tl.static_range(LINES):
        l2_prefetch(tl.minimum(first + (lane + 32 * j) * 128, last))


@triton.jit
def chunk_mmas(a, a_up, trip_x, U: tl.constexpr, d, d_up, NB: tl.constexpr, TWO: tl.constexpr,
               MMA_ASM: tl.constexpr):
    """The MMAs of chunk ``U`` of the trip over every token block: A registers ``a`` into ``d`` and, with ``TWO``,
    the second stream's ``a_up`` into ``d_up``, both taking each activation load (``trip_x``: its addresses)."""
    new = ()
    new_up = ()
    for b in tl.static_range(NB):
        xw = load_x(trip_x[b], U)
        new = new + mma_block(a, xw, d[4 * b], d[4 * b + 1], d[4 * b + 2], d[4 * b + 3], MMA_ASM)
        if TWO:
            new_up = new_up + mma_block(a_up, xw, d_up[4 * b], d_up[4 * b + 1], d_up[4 * b + 2], d_up[4 * b + 3],
                                        MMA_ASM)
    if not TWO:
        new_up = d_up
    return new, new_up


@triton.jit
def trip_step(acc, acc_up, codes, codes_up, q_ptr, s_lane, s_lane_up, x_ptr, x_lane, tile, tile_up, c, k_off, g, t,
              tok0, M, KC, stride_xm, CPG: tl.constexpr, UNROLL: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr,
              TWO: tl.constexpr, DECODE_ASM: tl.constexpr, DECODE_OPERANDS: tl.constexpr, MMA_ASM: tl.constexpr,
              ASM: tl.constexpr):
    """``UNROLL`` chunks from chunk ``c`` of a warp's weight stream (its tile; ``codes`` from :func:`load_trip`)
    into ``acc`` (4 * NB fp32 per lane), and with ``TWO`` of its second stream (``tile_up``: the up rows of
    SwiGLU, or a second tile of rows) into ``acc_up``: both streams' MMAs take the same activation registers,
    loaded once. Per scale group (``CPG`` chunks) the unscaled products accumulate from zero and are scaled
    once. ``x_lane`` (one per token block) and ``s_lane`` / ``s_lane_up``: the lane's addresses of chunk 0 and of
    scale group 0 (for warps splitting K, of its warp's first chunk ``k_off``, which the interpreter's gathers add to
    ``c``)."""
    if ASM:
        trip_x = ()
        for b in tl.static_range(NB):
            trip_x = trip_x + (x_lane[b] + c * 128,)
    trip_scales = s_lane + (c // CPG) * 8
    trip_scales_up = s_lane_up + (c // CPG) * 8
    for grp in tl.static_range(UNROLL // CPG):
        s_lo, s_hi = scale_pair(trip_scales + grp * 8)
        s_lo_up, s_hi_up = s_lo, s_hi
        if TWO:
            s_lo_up, s_hi_up = scale_pair(trip_scales_up + grp * 8)
        d = ()
        for i in tl.static_range(4 * NB):
            d = d + (tl.zeros_like(s_lo),)
        d_up = d
        for ci in tl.static_range(CPG):
            cc = c + grp * CPG + ci
            if ASM:
                a = decode_codes(codes[grp * CPG + ci], DECODE_ASM, DECODE_OPERANDS, BITS)
                a_up = a
                if TWO:
                    a_up = decode_codes(codes_up[grp * CPG + ci], DECODE_ASM, DECODE_OPERANDS, BITS)
                d, d_up = chunk_mmas(a, a_up, trip_x, grp * CPG + ci, d, d_up, NB, TWO, MMA_ASM)
            else:
                d = chunk_portable(d, q_ptr, q_ptr, x_ptr, tile, cc + k_off, g, t, tok0, M, KC, stride_xm, NB, BITS,
                                   False)
                if TWO:
                    d_up = chunk_portable(d_up, q_ptr, q_ptr, x_ptr, tile_up, cc + k_off, g, t, tok0, M, KC, stride_xm,
                                          NB, BITS, False)
        acc = add_scaled(acc, d, s_lo, s_hi, NB)
        if TWO:
            acc_up = add_scaled(acc_up, d_up, s_lo_up, s_hi_up, NB)
    return acc, acc_up


@triton.jit
def trip_step_fp4(acc, acc_up, codes, codes_up, q_ptr, s_ptr, x_ptr, x_lane, tile, tile_up, c, k_off, g, t, tok0, M,
                  KC, stride_xm, UNROLL: tl.constexpr, NB: tl.constexpr, TWO: tl.constexpr, DECODE_ASM: tl.constexpr,
                  DECODE_OPERANDS: tl.constexpr, MMA_ASM: tl.constexpr, SCALE_ASM: tl.constexpr, ASM: tl.constexpr):
    """:func:`trip_step` for nvfp4: the block scales are in the A registers (:func:`decode_fp4`), so every chunk's MMAs
    accumulate straight into ``acc`` (``acc_up``). ``codes``: the chunks' code words, then each pair's scale word."""
    if ASM:
        trip_x = ()
        for b in tl.static_range(NB):
            trip_x = trip_x + (x_lane[b] + c * 128,)
        pairs = ()
        pairs_up = ()
        for p in tl.static_range(UNROLL // 2):
            pairs = pairs + scale_pairs(codes[UNROLL + p], SCALE_ASM)
            if TWO:
                pairs_up = pairs_up + scale_pairs(codes_up[UNROLL + p], SCALE_ASM)
    for u in tl.static_range(UNROLL):
        if ASM:
            a = decode_fp4(codes[u], pairs[2 * u], pairs[2 * u + 1], DECODE_ASM, DECODE_OPERANDS)
            a_up = a
            if TWO:
                a_up = decode_fp4(codes_up[u], pairs_up[2 * u], pairs_up[2 * u + 1], DECODE_ASM, DECODE_OPERANDS)
            acc, acc_up = chunk_mmas(a, a_up, trip_x, u, acc, acc_up, NB, TWO, MMA_ASM)
        else:
            acc = chunk_portable(acc, q_ptr, s_ptr, x_ptr, tile, c + u + k_off, g, t, tok0, M, KC, stride_xm, NB, 4,
                                 True)
            if TWO:
                acc_up = chunk_portable(acc_up, q_ptr, s_ptr, x_ptr, tile_up, c + u + k_off, g, t, tok0, M, KC,
                                        stride_xm, NB, 4, True)
    return acc, acc_up


@triton.jit
def add_scaled(acc, d, s_lo, s_hi, NB: tl.constexpr):
    """``acc`` plus one scale group's products ``d``: values 0, 1 of a block are row g's, 2, 3 row g + 8's."""
    out = ()
    for b in tl.static_range(NB):
        out = out + (acc[4 * b] + d[4 * b] * s_lo, acc[4 * b + 1] + d[4 * b + 1] * s_lo,
                     acc[4 * b + 2] + d[4 * b + 2] * s_hi, acc[4 * b + 3] + d[4 * b + 3] * s_hi)
    return out
