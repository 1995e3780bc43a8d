"""The inline PTX of the register decode (:mod:`.fragment_mma`): loads of fragment-laid codes, their decode into
``mma.sync`` A registers, and the MMAs, as strings the kernel takes as ``constexpr`` arguments.

Decoding avoids integer-to-float conversions: a code placed in the low mantissa bits of a 16-bit float whose
exponent makes one unit of the mantissa worth 1.0 *is* that float plus a known offset, which one packed ``fma``
removes (two 16-bit values per 32-bit register).

* int4 (offset-binary codes 0..15, value ``code - 8``): ``(word >> 4r) & 0x000F000F | magic`` is the pair ``M +
  code`` (``M`` = 128 in bf16, 1024 in fp16); the ``fma`` adds ``-(M + 8)``. One shift, one ``lop3`` and one
  ``fma`` per register.
* int8 (two's complement codes -128..127): bf16 has 8 significant bits, so ``128 + byte`` does not fit for
  bytes of 128 and up. The byte's low 7 bits go into the mantissa (``M + (byte & 0x7F)``, exact), and its sign
  bit picks the offset: ``-(M + 128 * sign)`` is ``0xC300 | (byte & 0x80)`` in bf16 (-128 / -256) and ``0xE400 |
  (byte & 0x80)`` in fp16 (-1024 / -1152), so a second ``lop3`` builds the offset from the same byte and the
  ``fma`` adds it: ``(M + low7) - M - 128 * sign`` is the code, exactly. Two ``lop3``, one ``fma`` and (for the
  odd bytes) one shift per register.
* nvfp4 (:mod:`.fragments_fp4`): the sign and magnitude bits shifted into a 16-bit float's sign and lowest
  exponent / highest mantissa bits are the e2m1 value times a power of two; the ``fma`` multiplies by the lane's
  block scale (times the power of two that makes the product ``e2m1 * scale * 2^-8``) and adds zero. One ``and``
  to two shifts, an ``and`` and a ``lop3`` per register, then the ``fma``.
"""
from __future__ import annotations

from functools import cache

import torch

from ninfer.kernels.quant_gemm.fragments_fp4 import FP4_PLACES

# Per 16-bit type: (1.0, the int4 offset -(M + 8), M, the int8 offset base -M), as packed pairs.
_CONSTS = {"bf16": ("0x3F803F80", "0xC308C308", "0x43004300", "0xC300C300"),
           "f16": ("0x3C003C00", "0xE408E408", "0x64006400", "0xE400E400")}


def chunk_bytes(bits: int) -> int:
    """Bytes of one 16-row tile's 64-column chunk (a warp's loads of it: 512 per 16-byte load per lane)."""
    return 128 * bits


def load_asm(bits: int, u: int) -> str:
    """A lane's codes of chunk ``u`` of a loop trip at address ``$N`` (the last operand): one 16-byte load (int4,
    outputs $0..$3) or two, 512 bytes apart (int8, $0..$7). ``ld.global.nc`` with no L1 allocation: each code
    byte is read once."""
    base = chunk_bytes(bits) * u
    if bits == 4:
        return f"ld.global.nc.L1::no_allocate.v4.b32 {{$0, $1, $2, $3}}, [$4+{base}];"
    return (f"ld.global.nc.L1::no_allocate.v4.b32 {{$0, $1, $2, $3}}, [$8+{base}]; "
            f"ld.global.nc.L1::no_allocate.v4.b32 {{$4, $5, $6, $7}}, [$8+{base + 512}];")


def x_load_asm(u: int) -> str:
    """A lane's 16 activations (8 words, $0..$7) of chunk ``u`` of a loop trip at ``$8``: 128 bytes per chunk."""
    return (f"ld.global.v4.b32 {{$0, $1, $2, $3}}, [$8+{128 * u}]; "
            f"ld.global.v4.b32 {{$4, $5, $6, $7}}, [$8+{128 * u + 16}];")


def decode_asm(ty: str, bits: int) -> str:
    """One chunk's code words -> the 16 A registers of its four MMAs ($0..$15; MMA ``j`` takes 4j..4j+3,
    register ``r = 2b + h``: rows g / g + 8 for h = 0 / 1, the first / second column pair for b = 0 / 1).

    int4: words $16..$19, word j gives MMA j's registers, register r from the nibbles at bits 4r and 16 + 4r.
    int8: words $16..$23, word ``2j + b`` gives registers ``2b`` (bytes 0 and 2) and ``2b + 1`` (bytes 1, 3)."""
    one, bias4, magic, base8 = _CONSTS[ty]
    lines = ["{", ".reg .b32 s, one, bias, m, o;", f"mov.b32 one, {one};", f"mov.b32 bias, {bias4};"]

    def shifted(word: int, shift: int) -> str:  # the code word (input operand) shifted right, in "s"
        if not shift:
            return f"${word}"
        lines.append(f"shr.u32 s, ${word}, {shift};")
        return "s"

    for j in range(4):
        for r in range(4):  # register r = 2b + h
            if bits == 4:
                out, src = f"${4 * j + r}", shifted(16 + j, 4 * r)
                lines.append(f"lop3.b32 {out}, {src}, 0x000F000F, {magic}, 0xEA;")  # (src & 0x000F000F) | magic
                lines.append(f"fma.rn.{ty}x2 {out}, {out}, one, bias;")
            else:
                src = shifted(16 + 2 * j + r // 2, 8 * (r % 2))
                lines.append(f"lop3.b32 m, {src}, 0x007F007F, {magic}, 0xEA;")  # M + low 7 bits
                lines.append(f"lop3.b32 o, {src}, 0x00800080, {base8}, 0xEA;")  # -(M + 128 * sign)
                lines.append(f"fma.rn.{ty}x2 ${4 * j + r}, m, one, o;")
    lines.append("}")
    return "\n".join(lines)


def decode_operands(bits: int, fp4: bool = False) -> str:
    """Outputs: 16 A registers; inputs: the chunk's code words (and nvfp4's two scale pairs)."""
    return "=r," * 16 + ",".join(["r"] * (6 if fp4 else 4 if bits == 4 else 8))


# Per 16-bit type: the lowest bit of an e2m1 code's 3 magnitude bits in the decoded float (the exponent's lowest
# two bits and the mantissa's top bit), the e4m3 scale byte's shift into the exponent, and the packed factors that
# take it to ``scale * 2^118`` (bf16: twice 2^119 from ``scale * 2^-120``) or ``scale * 2^6`` (fp16: 2^14 from
# ``scale * 2^-8``, then 1).
_FP4 = {"bf16": (6, 4, ("0x7B007B00", "0x7B007B00")), "f16": (9, 7, ("0x74007400", "0x3C003C00"))}


def fp4_decode_asm(ty: str) -> str:
    """:func:`decode_asm` for nvfp4: words ``$16..$19`` (word j gives MMA j's registers, register r's codes at the
    places of ``FP4_PLACES[r]`` in both halves), the lane's scale pairs of rows g and g + 8 in ``$20`` and ``$21``
    (:func:`fp4_scale_asm`): register r = the decoded pair times scale pair ``r % 2``."""
    low, _, _ = _FP4[ty]
    mag = (7 << low) * 0x10001
    lines = ["{", ".reg .b32 s, m, zero;", "mov.b32 zero, 0;"]
    for j in range(4):
        word = f"${16 + j}"
        for r, (sign, first) in enumerate(FP4_PLACES):
            out, up_sign, up_mag = f"${4 * j + r}", 15 - sign, low - first
            if up_sign == up_mag:  # one shift puts both fields in place
                src = word
                if up_sign:
                    lines.append(f"shl.b32 s, {word}, {up_sign};")
                    src = "s"
                lines.append(f"and.b32 {out}, {src}, {hex(0x80008000 | mag)};")
            else:
                lines.append(f"shl.b32 s, {word}, {up_sign};" if up_sign else f"mov.b32 s, {word};")
                lines.append("and.b32 s, s, 0x80008000;")
                m = word
                if up_mag:
                    lines.append(f"{'shl' if up_mag > 0 else 'shr'}.b32 m, {word}, {abs(up_mag)};")
                    m = "m"
                lines.append(f"lop3.b32 {out}, {m}, {hex(mag)}, s, 0xEA;")  # (m & mag) | s
            lines.append(f"fma.rn.{ty}x2 {out}, {out}, ${20 + r % 2}, zero;")
    lines.append("}")
    return "\n".join(lines)


def fp4_scale_asm(ty: str) -> str:
    """A lane's scale word of two chunks (``$4``: bytes chunk 0 rows g / g + 8, chunk 1 rows g / g + 8) -> four
    packed pairs ``$0..$3`` (each byte in both halves), each ``scale * 2^118`` (bf16) or ``scale * 2^6`` (fp16)."""
    _, shift, (f1, f2) = _FP4[ty]
    lines = ["{", ".reg .b32 f1, f2, zero;", f"mov.b32 f1, {f1};", f"mov.b32 f2, {f2};", "mov.b32 zero, 0;"]
    for i in range(4):
        lines.append(f"prmt.b32 ${i}, $4, zero, {hex(0x4040 | (i << 8) | i)};")  # byte i in both halves' low bytes
        lines.append(f"shl.b32 ${i}, ${i}, {shift};")
        lines.append(f"fma.rn.{ty}x2 ${i}, ${i}, f1, zero;")
        lines.append(f"fma.rn.{ty}x2 ${i}, ${i}, f2, zero;")
    lines.append("}")
    return "\n".join(lines)


def mma_asm(ty: str) -> str:
    """Four MMAs of one 8-token block: A registers $4..$19, the block's 8 activation words $20..$27 (two per
    MMA), accumulators in $28..$31, out $0..$3."""
    lines = ["{"]
    for j in range(4):
        a = ", ".join(f"${4 + 4 * j + r}" for r in range(4))
        c = "$28, $29, $30, $31" if j == 0 else "$0, $1, $2, $3"
        lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{$0, $1, $2, $3}}, {{{a}}}, "
                     f"{{${20 + 2 * j}, ${21 + 2 * j}}}, {{{c}}};")
    lines.append("}")
    return "\n".join(lines)


@cache
def asm_constants(dtype: torch.dtype, bits: int, fp4: bool = False) -> dict[str, str]:
    """The kernel's PTX for 16-bit activations of ``dtype`` and ``bits``-bit codes, or nvfp4's (its constexpr
    arguments)."""
    ty = "f16" if dtype == torch.float16 else "bf16"
    loads = {f"LOAD{u}": load_asm(bits, u) for u in range(4)}
    return {**loads, "DECODE_ASM": fp4_decode_asm(ty) if fp4 else decode_asm(ty, bits),
            "DECODE_OPERANDS": decode_operands(bits, fp4), "MMA_ASM": mma_asm(ty),
            "SCALE_ASM": fp4_scale_asm(ty) if fp4 else ""}


# Row-major int4 codes (byte i of a row: columns 2i (low nibble), 2i + 1): the expert stacks of the MoE decode
# (ninfer.kernels.moe.quant_mma), which stay in the layout the prefill's grouped GEMMs read. Lane (g, t) loads the
# 8 bytes of columns 16 t .. 16 t + 15 of rows g and g + 8 per chunk: words (row g low, row g high, row g + 8 low,
# row g + 8 high), word w's nibble n being column 8 w' + n of the lane's 16 (w' = w % 2). ``(word >> 4 j) &
# 0x000F000F`` pairs columns j and j + 4 of a word, so MMA j takes the lane's columns j, j + 4, 8 + j, 12 + j
# (k slots 2t, 2t + 1, 2t + 8, 2t + 9): the decode costs what the fragment layout's does, and the activations'
# pairs are packed to match with one ``prmt`` per B register.

def row_major_load_asm(u: int) -> str:
    """A lane's codes of chunk ``u`` of a loop trip: 8 bytes of row g at ``$4``, 8 of row g + 8 at ``$5``."""
    return (f"ld.global.nc.L1::no_allocate.v2.b32 {{$0, $1}}, [$4+{32 * u}]; "
            f"ld.global.nc.L1::no_allocate.v2.b32 {{$2, $3}}, [$5+{32 * u}];")


def row_major_decode_asm(ty: str) -> str:
    """:func:`decode_asm` for row-major int4 words ``$16..$19`` (row g low / high, row g + 8 low / high): MMA j's
    register ``r = 2b + h`` from word ``2h + b`` shifted by ``4 j``."""
    one, bias4, magic, _ = _CONSTS[ty]
    lines = ["{", ".reg .b32 s, one, bias;", f"mov.b32 one, {one};", f"mov.b32 bias, {bias4};"]
    for j in range(4):
        for r in range(4):
            word, out = 16 + 2 * (r % 2) + r // 2, f"${4 * j + r}"
            src = f"${word}"
            if j:
                lines.append(f"shr.u32 s, {src}, {4 * j};")
                src = "s"
            lines.append(f"lop3.b32 {out}, {src}, 0x000F000F, {magic}, 0xEA;")
            lines.append(f"fma.rn.{ty}x2 {out}, {out}, one, bias;")
    lines.append("}")
    return "\n".join(lines)


def paired_x_load_asm(u: int) -> str:
    """A lane's 16 activations of chunk ``u`` (at ``$8``) packed for the row-major decode's MMAs: B registers
    ``2j`` = columns (j, j + 4) and ``2j + 1`` = (8 + j, 12 + j) of the lane's 16 ($0..$7)."""
    lines = ["{", ".reg .b32 w<8>;", f"ld.global.v4.b32 {{w0, w1, w2, w3}}, [$8+{128 * u}];",
             f"ld.global.v4.b32 {{w4, w5, w6, w7}}, [$8+{128 * u + 16}];"]
    for j in range(4):
        sel = "0x5410" if j % 2 == 0 else "0x7632"  # the low / high halves of two words
        lines.append(f"prmt.b32 ${2 * j}, w{j // 2}, w{j // 2 + 2}, {sel};")
        lines.append(f"prmt.b32 ${2 * j + 1}, w{4 + j // 2}, w{6 + j // 2}, {sel};")
    lines.append("}")
    return "\n".join(lines)
