"""The fragment layout of int4 and int8 weights (nvfp4: :mod:`.fragments_fp4`): codes and scales stored in the order the
decode kernel's lanes read them.

The tensor-core decode of :mod:`.fragment_mma` gives each warp 16 weight rows and multiplies them with
``mma.sync.m16n8k16``, whose A operand (16 rows x 16 columns) lives in registers: lane ``(g, t)`` (``g =
lane // 4``, ``t = lane % 4``) holds rows ``g`` and ``g + 8``. This layout stores the codes so that the lane's
16-byte loads per 64 columns (one for int4, two for int8) are exactly its A registers of four MMAs, and decoding
them takes a ``lop3`` or two (plus a shift and a packed ``fma``) per register: no shared memory, no shuffles, no
``ldmatrix`` (:mod:`.fragment_ptx`).

* The MMAs may take the 64 columns of a chunk in any order, as long as A and B use the same one. Lane ``t``'s
  MMA ``j`` takes columns ``16 t + 4 j .. + 3`` (k slots ``2t, 2t+1`` the first two, ``2t+8, 2t+9`` the other
  two), so its B registers over the four MMAs are the activations' 16 consecutive columns ``16 t .. 16 t + 15``:
  two 16-byte loads straight from the activation row, which therefore needs no re-layout.
* int4: word ``j`` of lane ``(g, t)`` in chunk ``c`` holds the 8 codes of rows ``g``, ``g + 8`` and columns
  ``64 c + 16 t + 4 j + (0..3)``; nibble ``4 e + 2 b + h`` is row ``g + 8 h``, column ``... + 2 b + e``. So
  ``word >> 4 r`` masked with ``0x000F000F`` puts the codes of A register ``r`` (``r = 2 b + h``: rows g / g+8,
  first / second column pair) in the two 16-bit halves of a word. A warp's load of one chunk is 512 contiguous
  bytes.
* int8: word ``2 j + b`` of the lane holds the 4 codes of column pair ``b`` of MMA ``j``; byte ``2 e + h`` is row
  ``g + 8 h``, column ``64 c + 16 t + 4 j + 2 b + e``, so ``word`` and ``word >> 8`` masked with ``0x00FF00FF``
  are A registers ``2 b`` and ``2 b + 1``. The lane's words 0..3 (MMAs 0, 1) are one 16-byte load, words 4..7
  the other, 512 bytes on: a chunk is 1024 contiguous bytes, half after half, lane after lane.
* Codes are stored tile after tile (16 rows), chunk after chunk: the 16 rows of a tile occupy exactly the bytes
  that rows ``16 T .. 16 T + 15`` of the row-major codes occupy, so the tensor keeps its shape and 16-row slices
  stay whole tiles.
* Scales: per tile and scale group, the 16 rows' scales as ``(row g, row g + 8)`` pairs, ``g = 0..7``: one
  32-bit load gives a lane both of its rows' scales. Same shape ``[N, K / G]`` as the row-major scales.

The layout is a property of the stored tensors (``QuantizedTensor.layout``); ``QuantizedTensor.dequantize`` and
the prefill dequantization (:func:`dequantize_fragments`) read it, so every path computes the same function.
The code width follows from the codes' dtype (uint8 nibble pairs: int4 or, with e4m3 scales, nvfp4; int8). Only 2-D
weights with ``N % 16 == 0``, ``K % 128 == 0`` and scale groups of a multiple of 64 columns (nvfp4: 16, one per lane
and chunk) take it (:func:`fragments_fit`): an MMA's 16 columns then share one scale, and the register decode's
shortest loop trip (two chunks) divides K.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.quant_gemm.fragments_fp4 import fp4_from_fragments, fp4_to_fragments

FRAGMENTS = "mma-fragments"  # QuantizedTensor.layout of re-laid weights; the default is "rows"
TILE_ROWS, CHUNK_COLS = 16, 64
MIN_TRIP_CHUNKS = 2  # chunks per loop trip of the register decode, at least
_TILES_PER_PASS = 512  # tiles converted at once: bounds the temporaries of a large weight to ~2 x its codes
_GROUPS = {"int4-g64": 64, "int4-g128": 128, "int8-g64": 64, "nvfp4": 16}  # scale groups: whole chunks, or a lane's


def fragments_fit(fmt: str, shape: tuple[int, ...]) -> bool:
    """Whether a weight of this format and shape can take the fragment layout and be served by the register
    decode, whose loop trips are two or four chunks (``quant_gemm.tune.fragment_candidates``; a K of one chunk
    had no candidate at all)."""
    return (fmt in _GROUPS and len(shape) == 2 and shape[0] % TILE_ROWS == 0
            and shape[1] % (MIN_TRIP_CHUNKS * CHUNK_COLS) == 0)


def code_bits(q: torch.Tensor) -> int:
    """The code width of stored codes: int8 tensors hold one code per byte, uint8 two nibbles."""
    return 8 if q.dtype == torch.int8 else 4


def is_fp4(scales: torch.Tensor) -> bool:
    """Whether stored scales are nvfp4's (e4m3 block scales; int4 and int8 store fp16 group scales)."""
    return scales.dtype == torch.float8_e4m3fn


def to_fragments(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major codes (int4: ``[N, K / 2]`` uint8, byte ``i`` = columns ``2i`` low nibble, ``2i + 1`` high; int8:
    ``[N, K]``) and scales ``[N, K / G]`` -> the same shapes in the fragment layout (new tensors, same device)."""
    if is_fp4(scales):
        return fp4_to_fragments(qweight, scales, _TILES_PER_PASS)
    n, kb = qweight.shape
    q = torch.empty_like(qweight)
    for t0 in range(0, n // TILE_ROWS, _TILES_PER_PASS):
        rows = slice(t0 * TILE_ROWS, min(n, (t0 + _TILES_PER_PASS) * TILE_ROWS))
        part = qweight[rows]
        if code_bits(qweight) == 8:  # row = 16 T + 8 h + g; column = 64 C + 16 t + 4 (2 jh + jl) + 2 b + e
            codes = part.view(-1, 2, 8, kb // 64, 4, 2, 2, 2, 2)  # T, h, g, C, t, jh, jl, b, e
            q[rows] = codes.permute(0, 3, 5, 2, 4, 6, 7, 8, 1).reshape(part.shape)  # T, C, jh, g, t, jl, b, e, h
            continue
        codes = torch.stack([part & 0xF, part >> 4], dim=-1)  # [rows, K/2, 2]: column 2i + low/high
        # row = 16 T + 8 h + g; column = 64 C + 16 t + 4 j + 2 b + e
        codes = codes.view(-1, 2, 8, kb // 32, 4, 4, 2, 2)  # T, h, g, C, t, j, b, e
        codes = codes.permute(0, 3, 2, 4, 5, 7, 6, 1)  # T, C, g, t, j, e, b, h: nibble 4e + 2b + h
        q[rows] = (codes[..., 0] | (codes[..., 1] << 4)).reshape(part.shape)  # byte 2e + b of the word
    s = scales.view(n // TILE_ROWS, 2, 8, -1).permute(0, 3, 2, 1).reshape(scales.shape)  # T, group, g, h
    return q, s.contiguous()


def from_fragments(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`to_fragments`: row-major codes and scales."""
    if is_fp4(s):
        return fp4_from_fragments(q, s, _TILES_PER_PASS)
    n, kb = q.shape
    qweight = torch.empty_like(q)
    for t0 in range(0, n // TILE_ROWS, _TILES_PER_PASS):
        rows = slice(t0 * TILE_ROWS, min(n, (t0 + _TILES_PER_PASS) * TILE_ROWS))
        part = q[rows]
        if code_bits(q) == 8:
            codes = part.view(-1, kb // 64, 2, 8, 4, 2, 2, 2, 2)  # T, C, jh, g, t, jl, b, e, h
            qweight[rows] = codes.permute(0, 8, 3, 1, 4, 2, 5, 6, 7).reshape(part.shape)  # T, h, g, C, t, jh, jl, b, e
            continue
        nib = torch.stack([part & 0xF, part >> 4], dim=-1)  # byte 2e + b, then h
        nib = nib.view(-1, kb // 32, 8, 4, 4, 2, 2, 2)  # T, C, g, t, j, e, b, h
        nib = nib.permute(0, 7, 2, 1, 3, 4, 6, 5)  # T, h, g, C, t, j, b, e: row-major columns, pairs (2i, 2i + 1)
        nib = nib.reshape(part.shape[0], kb, 2)
        qweight[rows] = nib[..., 0] | (nib[..., 1] << 4)
    groups = s.shape[1]
    scales = s.view(n // TILE_ROWS, groups, 8, 2).permute(0, 3, 2, 1).reshape(s.shape)
    return qweight, scales.contiguous()


@triton.jit
def fragment_values(q_ptr, chunk_word, g, h, cols, BITS: tl.constexpr):
    """Integer weights of rows ``g + 8 h`` (``[L, 1]``) at columns ``cols`` (``[1, 64]``, ``0..63``) of the chunk
    whose first int32 word is ``chunk_word`` (scalar or ``[L, 1]``), gathered from the four lanes ``(g, 0..3)``
    that hold them: ``[L, 64]`` int32 (int4: ``code - 8``; int8: the code). ``q_ptr``: the codes as int32 words."""
    lane_word = (4 * g + cols // 16) * 4
    if BITS == 4:
        nibble = 4 * (cols % 2) + 2 * ((cols % 4) // 2) + h
        words = tl.load(q_ptr + chunk_word + lane_word + (cols % 16) // 4)
        return ((words >> (4 * nibble)) & 0xF) - 8
    else:
        j = (cols % 16) // 4
        byte = 2 * (cols % 2) + h
        words = tl.load(q_ptr + chunk_word + (j // 2) * 128 + lane_word + 2 * (j % 2) + (cols % 4) // 2)
        return (words << (24 - 8 * byte)) >> 24  # the byte, sign-extended


@triton.jit
def scale_pair(ptr):
    """fp32 scales of rows ``g`` and ``g + 8`` from their 32-bit word at ``ptr`` (the scales viewed as int32:
    word ``(tile * groups + group) * 8 + g``)."""
    word = tl.load(ptr)
    return _half(word, 0), _half(word, 1)


@triton.jit
def _half(word, h):
    """fp16 half ``h`` (0: low, 1: high; scalar or tensor) of 32-bit words, as fp32."""
    return ((word >> (16 * h)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_fragments_kernel(q_ptr, s_ptr, w_ptr, KC, NG, stride_wn, GROUP: tl.constexpr, CHUNKS: tl.constexpr,
                              BITS: tl.constexpr):
    """One tile's 16 rows x ``CHUNKS`` chunks into the row-major workspace: ``value * scale`` in fp32, one
    rounding (what ``QuantizedTensor.dequantize`` gives in the workspace dtype)."""
    tile = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, 16)[:, None]
    g, h = r % 8, r // 8
    cols = tl.arange(0, 64)[None, :]
    for ci in tl.static_range(CHUNKS):
        c = tl.program_id(1) * CHUNKS + ci
        values = fragment_values(q_ptr, (tile * KC + c) * (32 * BITS), g, h, cols, BITS)
        col = c * 64 + cols
        scale = _half(tl.load(s_ptr + (tile * NG + col // GROUP) * 8 + g), h)
        w = values.to(tl.float32) * scale
        tl.store(w_ptr + (tile * 16 + r) * stride_wn + col, w.to(w_ptr.dtype.element_ty))


def words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as int32 words (1-D: a row of scales may hold an odd number of halves)."""
    return t.reshape(-1).view(torch.int32)


def dequantize_fragments(q: torch.Tensor, s: torch.Tensor, group: int, out: torch.Tensor) -> torch.Tensor:
    """Write the dequantized weight ``[N, K]`` (row-major, unit stride along K, any float dtype) of fragment-laid
    codes ``q`` and scales ``s`` into ``out`` and return it."""
    n, k = out.shape
    kc = k // CHUNK_COLS
    chunks = 4 if kc % 4 == 0 else 2 if kc % 2 == 0 else 1
    _dequant_fragments_kernel[(n // TILE_ROWS, kc // chunks)](
        words(q), words(s), out, kc, k // group, out.stride(0), GROUP=group, CHUNKS=chunks, BITS=code_bits(q),
        num_warps=4)
    return out
