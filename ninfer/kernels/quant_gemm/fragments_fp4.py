"""The fragment layout of nvfp4 weights: e2m1 codes placed so that a few shifts and masks turn a word into ``mma.sync``
A registers of 16-bit floats, and the e4m3 block scales of each lane's 16 columns beside them.

The register decode (:mod:`.fragment_mma`) gives lane ``(g, t)`` of a warp rows ``g`` and ``g + 8`` of a 16-row tile
and, per 64-column chunk, columns ``16 t .. 16 t + 15`` (:mod:`.fragments`): exactly one nvfp4 scale group of 16
columns per row. So the block scale multiplies the decoded weights in the A registers (one packed ``fma`` per
register, which the int4 decode spends on its offset anyway), and the MMAs accumulate every chunk into the same
fp32 accumulators; the row's global scale multiplies the result once.

* Codes: word ``j`` of the lane holds the same 8 codes as int4's (rows g / g + 8, columns ``64 c + 16 t + 4 j +
  2 b + e``), A register ``r = 2 b + h`` in half ``e`` of the word, but not as plain nibbles: in each 16-bit half,
  register ``r``'s sign bit sits at bit ``FP4_PLACES[r][0]`` and its 3 magnitude bits (exponent, mantissa) at
  ``FP4_PLACES[r][1]`` and up. A 16-bit float with the sign at bit 15 and those bits just above the mantissa
  (bf16: bits 6..8, fp16: 9..11) *is* the e2m1 value times ``2^-126`` (bf16) or ``2^-14`` (fp16), subnormals
  included; the places are chosen so that register 0 needs one ``and`` and register 1 a shift and an ``and``
  (no placement of all four in a 16-bit half lets every register come out of one shift).
* Scales: per tile and pair of chunks, lane after lane, 4 bytes per lane (chunk ``2 p``: rows g, g + 8; chunk
  ``2 p + 1``: rows g, g + 8): one 32-bit load per lane per two chunks. Same bytes and shape ``[N, K / 16]`` as
  the row-major scales. A 16-bit float with the e4m3 byte shifted into its exponent is the scale times
  ``2^-120`` (bf16) or ``2^-8`` (fp16), subnormals included; the decode multiplies it up to ``scale * 2^118`` /
  ``scale * 2^6`` so that each A value is ``e2m1 * scale * 2^-8`` exactly (at most 6 significant bits), and the
  epilogue multiplies by ``global_scale * 2^8``.

Only nonnegative block scales take the layout (the sign bit of a scale is not decoded; nvfp4 quantizers write
none): :func:`fp4_scales_fit`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.quant_gemm.e2m1 import e2m1_values

# (sign bit, lowest magnitude bit) of A register r's code in each 16-bit half of its word
FP4_PLACES = ((15, 6), (12, 3), (13, 9), (14, 0))
FP4_OUT_SCALE = tl.constexpr(256.0)  # 2^8: the decoded A values are e2m1 * scale * 2^-8
_TWO_126 = tl.constexpr(8.507059173023462e37)


def fp4_scales_fit(scales: torch.Tensor) -> bool:
    """Whether e4m3 block scales can take the fragment layout: none has its sign bit set."""
    return not bool((scales.view(torch.uint8) & 0x80).any())


def _place(code: torch.Tensor, r: int) -> torch.Tensor:
    sign, low = FP4_PLACES[r]
    return ((code >> 3) << sign) | ((code & 7) << low)


def fp4_to_fragments(qweight: torch.Tensor, scales: torch.Tensor, tiles_per_pass: int) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """Row-major nvfp4 codes ``[N, K / 2]`` (byte ``i``: column ``2 i`` low nibble, ``2 i + 1`` high) and e4m3 scales
    ``[N, K / 16]`` -> the same shapes in the fragment layout (new tensors, same device)."""
    n, kb = qweight.shape
    q = torch.empty_like(qweight)
    for t0 in range(0, n // 16, tiles_per_pass):
        rows = slice(t0 * 16, min(n, (t0 + tiles_per_pass) * 16))
        part = qweight[rows]
        codes = torch.stack([part & 0xF, part >> 4], dim=-1).to(torch.int32)  # column 2i + low/high
        # row = 16 T + 8 h + g; column = 64 C + 16 t + 4 j + 2 b + e
        codes = codes.view(-1, 2, 8, kb // 32, 4, 4, 2, 2).permute(0, 3, 2, 4, 5, 7, 6, 1)  # T, C, g, t, j, e, b, h
        halves = sum(_place(codes[..., b, h], 2 * b + h) for b in range(2) for h in range(2))  # T, C, g, t, j, e
        bytes_ = torch.stack([halves & 0xFF, halves >> 8], dim=-1).flatten(-2)  # bytes of half 0, then half 1
        q[rows] = bytes_.to(torch.uint8).reshape(part.shape)
    s = scales.view(torch.uint8)
    s = s.view(n // 16, 2, 8, -1, 2, 4).permute(0, 3, 2, 5, 4, 1)  # T, h, g, P, u, t -> T, P, g, t, u, h
    return q, s.reshape(scales.shape).contiguous().view(scales.dtype)


def fp4_from_fragments(q: torch.Tensor, s: torch.Tensor, tiles_per_pass: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`fp4_to_fragments`."""
    n, kb = q.shape
    qweight = torch.empty_like(q)
    for t0 in range(0, n // 16, tiles_per_pass):
        rows = slice(t0 * 16, min(n, (t0 + tiles_per_pass) * 16))
        part = q[rows].to(torch.int32).view(-1, kb // 32, 8, 4, 4, 2, 2)  # T, C, g, t, j, e, byte
        halves = part[..., 0] | (part[..., 1] << 8)  # T, C, g, t, j, e
        codes = torch.stack([torch.stack([((halves >> FP4_PLACES[2 * b + h][0]) & 1) << 3
                                          | ((halves >> FP4_PLACES[2 * b + h][1]) & 7) for h in range(2)], -1)
                             for b in range(2)], -2)  # T, C, g, t, j, e, b, h
        codes = codes.permute(0, 7, 2, 1, 3, 4, 6, 5).reshape(part.shape[0] * 16, kb, 2)  # rows, pairs, low / high
        qweight[rows] = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    groups = s.shape[1]
    raw = s.view(torch.uint8).view(n // 16, groups // 8, 8, 4, 2, 2).permute(0, 5, 2, 1, 4, 3)  # T, h, g, P, u, t
    return qweight, raw.reshape(s.shape).contiguous().view(s.dtype)


@triton.jit
def fp4_fragment_values(q_ptr, chunk_word, g, h, cols):
    """fp32 e2m1 values of rows ``g + 8 h`` (``[L, 1]``) at columns ``cols`` (``[1, 64]``) of the chunk whose first
    int32 word is ``chunk_word``, gathered from the lanes ``(g, 0..3)`` that hold them (:func:`.fragment_values`'
    nvfp4 counterpart)."""
    words = tl.load(q_ptr + chunk_word + (4 * g + cols // 16) * 4 + (cols % 16) // 4)
    return e2m1_values(_code(words, 2 * ((cols % 4) // 2) + h, cols % 2)) * _TWO_126


@triton.jit
def _code(words, r, e):
    """The e2m1 code of A register ``r`` in half ``e`` of code words (``FP4_PLACES``, spelled out for Triton)."""
    sign = tl.where(r == 0, 15, tl.where(r == 1, 12, tl.where(r == 2, 13, 14))) + 16 * e
    low = tl.where(r == 0, 6, tl.where(r == 1, 3, tl.where(r == 2, 9, 0))) + 16 * e
    return (((words >> sign) & 1) << 3) | ((words >> low) & 7)


@triton.jit
def fp4_fragment_scales(s_ptr, tile, KC, c, g, h, t):
    """fp32 block scales of rows ``g + 8 h`` of ``tile``, scale group ``t`` of chunk ``c`` (any broadcastable shapes);
    ``s_ptr``: the scales as int32 words."""
    byte = tile.to(tl.int64) * KC * 64 + ((c // 2) * 32 + 4 * g + t) * 4 + (c % 2) * 2 + h
    raw = (tl.load(s_ptr + byte // 4) >> (8 * (byte % 4).to(tl.int32))) & 0xFF
    return raw.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_fp4_kernel(q_ptr, s_ptr, rs_ptr, w_ptr, KC, stride_wn, CHUNKS: tl.constexpr):
    """One tile's 16 rows x ``CHUNKS`` chunks into the row-major workspace: ``e2m1 * (scale * global)`` in fp32 (the
    order of ``Nvfp4Format.dequantize``), one rounding. Each chunk's 128 code words are read once, in order, and
    decoded 8 codes a word (``(lane, word) x (h, b, e)``), then rearranged into the tile's rows and columns."""
    tile = tl.program_id(0).to(tl.int64)
    word = tl.arange(0, 128)[:, None]  # (g, t, j): lane 4 g + t, its word j
    code = tl.arange(0, 8)[None, :]  # (h, b, e): row g + 8 h, column pair b, half e
    g, t = word // 16, (word // 4) % 4
    h, b, e = code // 4, (code // 2) % 2, code % 2
    rows = tl.arange(0, 16)[:, None]
    cols = tl.arange(0, 64)[None, :]
    glob = tl.load(rs_ptr + tile * 16 + rows)
    for ci in tl.static_range(CHUNKS):
        c = tl.program_id(1) * CHUNKS + ci
        words = tl.load(q_ptr + (tile * KC + c) * 128 + word)
        nib = _code(words, 2 * b + h, e)
        pair = tl.load(s_ptr + tile * KC * 16 + (c // 2) * 32 + 4 * g + t)  # the lane's scale word
        scale = ((pair >> (16 * (c % 2) + 8 * h)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        w = _tile_order(e2m1_values(nib) * _TWO_126) * (_tile_order(scale.to(tl.float32)) * glob)
        tl.store(w_ptr + (tile * 16 + rows) * stride_wn + c * 64 + cols, w.to(w_ptr.dtype.element_ty))


@triton.jit
def _tile_order(x):
    """``[128, 8]`` values in ``(g, t, j) x (h, b, e)`` order -> ``[16, 64]``: row ``g + 8 h``, column ``16 t + 4 j +
    2 b + e``."""
    return tl.reshape(tl.permute(tl.reshape(x, (8, 4, 4, 2, 2, 2)), (3, 0, 1, 2, 4, 5)), (16, 64))


def dequantize_fp4_fragments(q: torch.Tensor, s: torch.Tensor, global_scale: torch.Tensor,
                             out: torch.Tensor) -> torch.Tensor:
    """Write the dequantized weight ``[N, K]`` of fragment-laid nvfp4 codes, scales and per-row global scales into
    ``out`` (row-major, unit stride along K) and return it."""
    n, k = out.shape
    kc = k // 64
    chunks = 4 if kc % 4 == 0 else 2
    words = q.reshape(-1).view(torch.int32)
    scale_words = s.reshape(-1).view(torch.uint8).view(torch.int32)
    _dequant_fp4_kernel[(n // 16, kc // chunks)](words, scale_words, global_scale, out, kc, out.stride(0),
                                                 CHUNKS=chunks, num_warps=4)
    return out
