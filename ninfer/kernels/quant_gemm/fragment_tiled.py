"""Prefill-size GEMM over fragment-laid int4 / int8 weights: each weight tile decoded once per ``BLOCK_M`` tokens and
multiplied on tensor cores by ``tl.dot``.

The register decode (:mod:`.fragment_mma`) holds at most 64 tokens per program, so a 128-token chunk reads and
decodes every weight four times; and inside a CUDA graph the dequantization path (the whole weight into a shared
workspace, then cuBLAS) is not available. A prompt-chunk graph's step beside decodes spent 40 of its 51.5 ms in
those repeated decodes (run 2026-12-04.5, ``docs/performance.md``). Here a program owns ``BLOCK_N`` output rows x
``BLOCK_M`` tokens, as the row-major tiled path of :mod:`.gemm` does, and needs no workspace (split-K aside).

* The layout (:mod:`.fragments`) keeps a 16-row tile's chunk of 64 columns together: lane ``(g, t)``'s words hold
  rows ``g`` and ``g + 8``. The program loads, per tile and chunk, the words of each ``g`` as one row, i.e. a
  ``[BLOCK_N / 2, W]`` tensor of int32 words in the layout's own order (contiguous runs: 64 bytes for int4, 16 for
  int8), and splits every word's codes into two half tiles, rows ``g`` (``h = 0``) and rows ``g + 8`` (``h = 1``),
  each ``[BLOCK_N / 2, 64]`` in natural column order (``tl.join``, then a reshape), so the activations load
  unpermuted. Two accumulators (four with SwiGLU); the epilogue stores each half at its rows.
* int4: word ``4 t + j`` of row ``g`` holds columns ``16 t + 4 j + 2 b + e`` in nibble ``4 e + 2 b + h``: the
  words' order already is the columns' order, four columns per word. int8: the word of column pair ``p = 8 t + 2 j
  + b`` sits at ``128 (j // 2) + 16 g + 4 t + 2 (j % 2) + b`` and holds column ``2 p + e`` in byte ``2 e + h``.
* Codes become floats by the bit-pattern tricks of :mod:`.common` (no conversion instructions). Two variants
  (``CODES``, a tuner choice): ``"frag-tiled"`` scales each weight in fp32 and rounds it once to the activations'
  dtype (what ``QuantizedTensor.dequantize`` gives); ``"frag-tiled-codes"`` feeds the exact codes (int4 as
  bf16 / fp16 pairs, ``HADD2``) to the MMA and multiplies each chunk's fp32 product by its group scale, as the
  register decode does. Offline (Triton 3.6, sm_90, the 27B down projection, 128 x 128 tiles, 8 warps) the
  second issues 256 instead of 328 instructions per thread and chunk, and ptxas pipelines its wgmma where it
  serialises the first's (its A operand from registers); it was not yet timed on a GPU when it was added.
* Split-K over grid axis 1 (for shapes whose tiles cannot fill the GPU, the 27B down projection at 128 tokens):
  partials to an fp32 scratch, summed in split order by :func:`.gemv_steps.reduce_splits` (deterministic).

The interpreter runs the same body (fp32 / fp16), so the CPU tests check the index arithmetic; the GPU tests the
compiled kernel at the 27B shapes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.quant_gemm.common import dot, finish_at, grouped_tile, int4_values
from ninfer.kernels.quant_gemm.fragment_configs import fragment_splits
from ninfer.kernels.quant_gemm.fragments import CHUNK_COLS, TILE_ROWS, code_bits, words
from ninfer.kernels.quant_gemm.gemv_steps import reduce_splits, store_partials_at
from ninfer.kernels.quant_gemm.tune import GemmConfig


@triton.jit
def _int4_half(w, h: tl.constexpr, R: tl.constexpr, DTYPE: tl.constexpr):
    """Rows ``g + 8 h`` of words ``w [R, 16]`` (int32, lane row g's words in order): values ``[R, 64]`` in DTYPE."""
    e0 = tl.join((w >> (4 * h)) & 0xF, (w >> (4 * (2 + h))) & 0xF)  # [R, 16, b] of e = 0
    e1 = tl.join((w >> (4 * (4 + h))) & 0xF, (w >> (4 * (6 + h))) & 0xF)  # of e = 1
    nib = tl.reshape(tl.join(e0, e1), (R, 64))  # [R, 16 words, b, e]: column 4 word + 2 b + e
    return int4_values(nib, DTYPE)


@triton.jit
def _int8_half(w, h: tl.constexpr, R: tl.constexpr, DTYPE: tl.constexpr):
    """Rows ``g + 8 h`` of words ``w [R, 32]`` (int32, column pair p's word at p): values ``[R, 64]`` in DTYPE."""
    e0 = (w << (24 - 8 * h)) >> 24  # byte h (e = 0), sign-extended
    e1 = (w << (8 - 8 * h)) >> 24  # byte 2 + h (e = 1)
    v = tl.reshape(tl.join(e0, e1), (R, 64))  # column 2 p + e
    return ((v + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0).to(DTYPE)  # exact: 2^23 + 128 + v


@triton.jit
def _halves(q_ptr, s_ptr, tile, g, c, KC, NG, GROUP: tl.constexpr, BITS: tl.constexpr, R: tl.constexpr,
            DTYPE: tl.constexpr):
    """The code values (exact) of the half tiles (rows g, rows g + 8; ``[R, 64]`` each, DTYPE) of chunk ``c`` for
    rows ``(tile, g)`` (``[R]`` each), and their fp32 scales ``[R]`` each."""
    base = (tile.to(tl.int64) * KC + c) * (32 * BITS)  # the chunk's first word
    if BITS == 4:
        kw = tl.arange(0, 16)
        w = tl.load(q_ptr + (base + 16 * g)[:, None] + kw[None, :])
        lo, hi = _int4_half(w, 0, R, DTYPE), _int4_half(w, 1, R, DTYPE)
    else:
        p = tl.arange(0, 32)
        j = (p // 2) % 4
        offs = 128 * (j // 2) + 4 * (p // 8) + 2 * (j % 2) + p % 2
        w = tl.load(q_ptr + (base + 16 * g)[:, None] + offs[None, :])
        lo, hi = _int8_half(w, 0, R, DTYPE), _int8_half(w, 1, R, DTYPE)
    pair = ((tile.to(tl.int64) * NG + (c * 64) // GROUP) * 8 + g) * 2  # scales: (tile, group, g, h)
    return lo, hi, tl.load(s_ptr + pair).to(tl.float32), tl.load(s_ptr + pair + 1).to(tl.float32)


@triton.jit
def _chunk(acc, codes, scale, xt, CODES: tl.constexpr, IEEE: tl.constexpr):
    """``acc += (codes * scale) @ xt`` for one half tile of one chunk: with CODES the exact codes go to the MMA and
    the scale multiplies its ``[R, BLOCK_M]`` product; otherwise each weight is scaled in fp32 and rounded once to
    the activations' dtype (``QuantizedTensor.dequantize``) before it."""
    if CODES:
        return acc + dot(codes.to(xt.dtype), xt, tl.zeros_like(acc), IEEE) * scale[:, None]
    return dot((codes * scale[:, None]).to(xt.dtype), xt, acc, IEEE)


@triton.jit
def _store(acc, acc_up, ws_ptr, res_ptr, out_ptr, pid_s, M, N_OUT, m_idx, n_idx, mask, stride_rm, stride_om,
           SWIGLU: tl.constexpr, HAS_RES: tl.constexpr, SPLIT: tl.constexpr):
    if SPLIT:
        store_partials_at(ws_ptr, acc, acc_up, pid_s, M, m_idx, n_idx, mask, N_OUT, SWIGLU)
    else:
        finish_at(acc, acc_up, m_idx, n_idx, mask, res_ptr, stride_rm, out_ptr, stride_om, SWIGLU, HAS_RES)


@triton.jit(do_not_specialize=["M", "chunks_per_split"])
def _fragment_tiled_kernel(
    x_ptr, q_ptr, s_ptr, res_ptr, out_ptr, ws_ptr,
    M, N_OUT, KC, NG, chunks_per_split, stride_xm, stride_rm, stride_om,
    GROUP: tl.constexpr, BITS: tl.constexpr, SWIGLU: tl.constexpr, HAS_RES: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, CODES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    R: tl.constexpr = BLOCK_N // 2
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N_OUT, BLOCK_M, BLOCK_N, GROUP_M)

    tiles = N_OUT // 16
    i = tl.arange(0, R)
    tile_out = pid_n * (BLOCK_N // 16) + i // 8
    g = i % 8
    tile = tl.minimum(tile_out, tiles - 1)  # a clamped tile loads valid memory; its stores are masked
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    xrows = tl.minimum(offs_m, M - 1).to(tl.int64)
    offs_k = tl.arange(0, 64)
    acc_lo = tl.zeros((R, BLOCK_M), dtype=tl.float32)
    acc_hi = tl.zeros((R, BLOCK_M), dtype=tl.float32)
    up_lo = acc_lo
    up_hi = acc_hi
    c_first = tl.program_id(1) * chunks_per_split
    c_last = tl.minimum(c_first + chunks_per_split, KC)
    VALUES: tl.constexpr = x_ptr.dtype.element_ty if CODES else tl.float32  # the codes' values: exact either way
    for c in range(c_first, c_last):
        xt = tl.load(x_ptr + xrows[None, :] * stride_xm + c * 64 + offs_k[:, None])  # x^T [64, BLOCK_M]
        lo, hi, s_lo, s_hi = _halves(q_ptr, s_ptr, tile, g, c, KC, NG, GROUP, BITS, R, VALUES)
        acc_lo = _chunk(acc_lo, lo, s_lo, xt, CODES, IEEE)
        acc_hi = _chunk(acc_hi, hi, s_hi, xt, CODES, IEEE)
        if SWIGLU:  # the up rows of the same outputs: tiles N_OUT / 16 further on
            lo, hi, s_lo, s_hi = _halves(q_ptr, s_ptr, tile + tiles, g, c, KC, NG, GROUP, BITS, R, VALUES)
            up_lo = _chunk(up_lo, lo, s_lo, xt, CODES, IEEE)
            up_hi = _chunk(up_hi, hi, s_hi, xt, CODES, IEEE)
    m_idx = offs_m[None, :]
    mask = (tile_out < tiles)[:, None] & (offs_m < M)[None, :]
    pid_s = tl.program_id(1)
    row = (tile_out * 16 + g)[:, None]
    _store(acc_lo, up_lo, ws_ptr, res_ptr, out_ptr, pid_s, M, N_OUT, m_idx, row, mask, stride_rm, stride_om, SWIGLU,
           HAS_RES, SPLIT)
    _store(acc_hi, up_hi, ws_ptr, res_ptr, out_ptr, pid_s, M, N_OUT, m_idx, row + 8, mask, stride_rm, stride_om,
           SWIGLU, HAS_RES, SPLIT)


CODES_KIND = "frag-tiled-codes"  # the variant whose MMAs take the exact codes (the scale on their products)


def launch_fragment_tiled(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, res: torch.Tensor | None,
                          out: torch.Tensor, swiglu: bool, group: int, cfg: GemmConfig) -> None:
    """Launch the tiled GEMM (``cfg.kind``: ``"frag-tiled"`` or :data:`CODES_KIND`; ``block_m`` tokens x
    ``block_n`` rows per program, a multiple of 32, ``split_k``) on codes and scales in the fragment layout;
    ``x [M, K]`` with unit stride along K, ``out [M, N_OUT]`` contiguous."""
    m, k = x.shape
    n_out = out.shape[1]
    if group % CHUNK_COLS or k % CHUNK_COLS or n_out % TILE_ROWS or cfg.block_n % 32 or cfg.block_m < 16:
        raise ValueError(f"frag-tiled config {cfg} does not fit K = {k}, N = {n_out}, scale group {group}")
    kc = k // CHUNK_COLS
    per, splits = fragment_splits(kc, 1, cfg.split_k)
    ws = torch.empty(splits, m, n_out * (2 if swiglu else 1), dtype=torch.float32, device=x.device) \
        if splits > 1 else out
    res_arg = res if res is not None else out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n_out, cfg.block_n), splits)
    _fragment_tiled_kernel[grid](
        x, words(q), scales, res_arg, out, ws, m, n_out, kc, k // group, per, x.stride(0), res_arg.stride(0),
        out.stride(0), GROUP=group, BITS=code_bits(q), SWIGLU=swiglu, HAS_RES=res is not None, SPLIT=splits > 1,
        IEEE=x.dtype == torch.float32, CODES=cfg.kind == CODES_KIND, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        GROUP_M=8, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        reduce_splits(ws, res_arg, out, m, splits, swiglu, res is not None)
