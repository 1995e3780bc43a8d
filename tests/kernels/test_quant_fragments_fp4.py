"""nvfp4 in the fragment layout (``fragments_fp4``) and its register decode, on CPU.

* The decode's PTX strings run through a small emulator of the instructions they use (``and``, shifts, ``lop3``,
  ``prmt``, packed 16-bit ``fma``): every e2m1 code in every register place, every nonnegative e4m3 scale, bf16 and
  fp16, must come out exactly ``e2m1 * scale * 2^-8``.
* The layout against the ``m16n8k16`` fragment map: A registers built per lane by the emulated PTX, B from the
  activations, the MMA sums and the epilogue's ``global * 2^8`` give ``x @ W^T``.
* Round trips, row slices, the dequantization kernel (bit for bit), the decode kernel in the interpreter (``ASM``
  off: Triton gathers of the same layout) with splits, SwiGLU, pairs of tiles, residuals and fp32 activations.
  The PTX itself runs in ``tests/gpu/test_quant_fragments_gpu.py``.
"""
from __future__ import annotations

import re

import pytest
import torch
from kernel_testing import QUANT_TOL as TOL
from kernel_testing import fragment_laid, poisoned_outputs  # noqa: F401  (fixture)
from kernel_testing import frag_config as _frag

from ninfer.kernels.quant_gemm import QuantizedTensor, quant_matmul_reference, quant_matmul_triton
from ninfer.kernels.quant_gemm.fragment_ptx import fp4_decode_asm, fp4_scale_asm
from ninfer.kernels.quant_gemm.fragments import FRAGMENTS, fragments_fit, from_fragments
from ninfer.kernels.quant_gemm.fragments_fp4 import FP4_PLACES, dequantize_fp4_fragments
from ninfer.kernels.quant_gemm.tune import candidates, tiled_fragment_candidates
from ninfer.quant.formats import quantize
from ninfer.quant.linear import QuantLinear

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
MASK = 0xFFFFFFFF


def _e2m1(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def _e4m3(byte: int) -> float:
    return torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()


def _half_value(bits: int, ty: str) -> float:
    signed = bits - 0x10000 if bits >= 0x8000 else bits
    return torch.tensor([signed], dtype=torch.int16).view(torch.bfloat16 if ty == "bf16" else torch.float16).item()


def _half_bits(value: float, ty: str) -> int:
    t = torch.tensor([value], dtype=torch.float64).to(torch.bfloat16 if ty == "bf16" else torch.float16)
    assert t.double().item() == value, f"{value} is not exact in {ty}"
    return t.view(torch.int16).item() & 0xFFFF


def _run_ptx(asm: str, operands: list[int], ty: str) -> list[int]:
    """The ``{ ... }`` block of PTX ``asm`` on 32-bit ``operands`` ($0.. outputs first, inputs after); returns every
    operand's final value. Knows the instructions the fragment decode emits, nothing more."""
    regs: dict[str, int] = {f"${i}": v & MASK for i, v in enumerate(operands)}

    def val(tok: str) -> int:
        return regs[tok] if tok in regs else int(tok, 0) & MASK

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        if op == "mov.b32":
            regs[a[0]] = val(a[1])
        elif op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "shl.b32":
            regs[a[0]] = (val(a[1]) << int(a[2])) & MASK
        elif op == "shr.b32":
            regs[a[0]] = val(a[1]) >> int(a[2])
        elif op == "lop3.b32":
            x, y, z, lut = val(a[1]), val(a[2]), val(a[3]), int(a[4], 0)
            regs[a[0]] = sum(((lut >> ((((x >> i) & 1) << 2) | (((y >> i) & 1) << 1) | ((z >> i) & 1))) & 1) << i
                             for i in range(32))
        elif op == "prmt.b32":
            pool = val(a[1]) | (val(a[2]) << 32)
            sel = int(a[3], 0)
            regs[a[0]] = sum(((pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif re.fullmatch(r"fma\.rn\.(bf16|f16)x2", op):
            x, y, z = val(a[1]), val(a[2]), val(a[3])
            out = 0
            for shift in (0, 16):
                exact = (_half_value((x >> shift) & 0xFFFF, ty) * _half_value((y >> shift) & 0xFFFF, ty)
                         + _half_value((z >> shift) & 0xFFFF, ty))
                out |= _half_bits(exact, ty) << shift  # asserts the product needs no rounding
            regs[a[0]] = out
        else:
            raise AssertionError(f"the emulator does not know {op!r}")
    return [regs[f"${i}"] for i in range(len(operands))]


def _scale_pairs(word: int, ty: str) -> list[int]:
    return _run_ptx(fp4_scale_asm(ty), [0, 0, 0, 0, word], ty)[:4]


def _decode(words: list[int], s_lo: int, s_hi: int, ty: str) -> list[int]:
    return _run_ptx(fp4_decode_asm(ty), [0] * 16 + words + [s_lo, s_hi], ty)[:16]


def _place(code: int, r: int) -> int:
    sign, low = FP4_PLACES[r]
    return ((code >> 3) << sign) | ((code & 7) << low)


@pytest.mark.parametrize("ty", ["bf16", "f16"])
def test_scale_asm_for_every_scale(ty: str) -> None:
    factor = 2.0 ** (118 if ty == "bf16" else 6)
    for byte in range(127):  # 0x7F is e4m3fn's NaN
        others = [(byte * 29 + 7) % 127, (byte * 53 + 1) % 127, (byte * 71 + 3) % 127]
        for place in range(4):
            raw = others[:place] + [byte] + others[place:]
            pairs = _scale_pairs(sum(b << (8 * i) for i, b in enumerate(raw)), ty)
            for i, pair in enumerate(pairs):
                want = _e4m3(raw[i]) * factor
                assert _half_value(pair & 0xFFFF, ty) == want and _half_value(pair >> 16, ty) == want, (byte, i)


@pytest.mark.parametrize("ty", ["bf16", "f16"])
def test_decode_asm_is_exact_for_every_code(ty: str) -> None:
    """Every code in every register place of every word, beside other codes that must not leak in, times two
    different scales (rows g and g + 8): ``e2m1 * scale * 2^-8``, exactly."""
    scales = (0x3A, 0x05)  # a normal e4m3 and a subnormal one
    pairs = _scale_pairs(scales[0] | (scales[1] << 8), ty)[:2]
    for code in range(16):
        for j in range(4):
            grid = [[[(code * 5 + 3 * r + 7 * e + 11 * w) % 16 for e in range(2)] for r in range(4)] for w in range(4)]
            grid[j][code % 4][code // 8] = code  # the code under test in register code % 4 of word j
            words = [sum(_place(grid[w][r][e], r) << (16 * e) for r in range(4) for e in range(2)) for w in range(4)]
            regs = _decode(words, *pairs, ty)
            for w in range(4):
                for r in range(4):
                    for e in range(2):
                        want = _e2m1(grid[w][r][e]) * _e4m3(scales[r % 2]) / 256
                        got = _half_value((regs[4 * w + r] >> (16 * e)) & 0xFFFF, ty)
                        assert got == want, (code, w, r, e, got, want)


def _weight(n: int, k: int, seed: int, scale: float = 0.05) -> QuantizedTensor:
    return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * scale, "nvfp4")


def _emulate(f: QuantizedTensor, x: torch.Tensor, ty: str) -> torch.Tensor:
    """``x [<= 8, K] @ W^T`` as the kernel computes it: per lane and chunk its code words and scale word from the
    fragment layout, the emulated PTX for its A registers, B from activation columns ``16 t .. 16 t + 15``, the
    ``m16n8k16`` fragment map (see ``test_quant_fragments._emulate``), then the rows' ``global * 2^8``."""
    q, s, glob = f.tensors["qweight"], f.tensors["scales"], f.tensors["global_scale"]
    n, k = f.shape
    codes = q.contiguous().view(torch.int32).view(n // 16, k // 64, 128).tolist()  # tile, chunk, words
    scale_words = s.contiguous().view(torch.uint8).view(torch.int32).view(n // 16, k // 128, 32).tolist()
    xp = torch.zeros(8, k, dtype=torch.float64)
    xp[: x.shape[0]] = x.double()
    y = torch.zeros(8, n, dtype=torch.float64)
    for tile in range(n // 16):
        d = torch.zeros(16, 8, dtype=torch.float64)
        for c in range(k // 64):
            regs = []
            for lane in range(32):
                pairs = _scale_pairs(scale_words[tile][c // 2][lane], ty)[2 * (c % 2): 2 * (c % 2) + 2]
                regs.append(_decode(codes[tile][c][4 * lane: 4 * lane + 4], *pairs, ty))
            for j in range(4):
                a = torch.zeros(16, 16, dtype=torch.float64)
                b = torch.zeros(16, 8, dtype=torch.float64)
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    for r in range(4):
                        reg = regs[lane][4 * j + r]
                        slot = 2 * t + 8 * (r // 2)
                        a[g + 8 * (r % 2), slot] = _half_value(reg & 0xFFFF, ty)
                        a[g + 8 * (r % 2), slot + 1] = _half_value(reg >> 16, ty)
                    col = 64 * c + 16 * t + 4 * j
                    b[2 * t, g], b[2 * t + 1, g] = xp[g, col], xp[g, col + 1]
                    b[2 * t + 8, g], b[2 * t + 9, g] = xp[g, col + 2], xp[g, col + 3]
                d += a @ b
        y[:, tile * 16:(tile + 1) * 16] = (d * (glob[tile * 16:(tile + 1) * 16].double() * 256)[:, None]).t()
    return y[: x.shape[0]]


@pytest.mark.parametrize("ty", ["bf16", "f16"])
def test_layout_matches_the_mma_fragment_map(ty: str) -> None:
    w = _weight(16, 256, seed=1)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    got = _emulate(fragment_laid(w), x, ty)
    # the reference rounds scale * global to fp32 once per block; the kernel multiplies by global last
    ref = x.double() @ w.dequantize(torch.float64).t()
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-7)


def test_round_trip_row_slices_and_dequantization() -> None:
    w = _weight(48, 384, seed=3)
    f = fragment_laid(w)
    q, s = from_fragments(f.tensors["qweight"], f.tensors["scales"])
    assert torch.equal(q, w.tensors["qweight"])
    assert torch.equal(s.view(torch.uint8), w.tensors["scales"].view(torch.uint8))
    assert torch.equal(f.dequantize(), w.dequantize())
    part = QuantizedTensor(w.format, (16, 384), {name: t[16:32] for name, t in f.tensors.items()}, layout=FRAGMENTS)
    assert torch.equal(part.dequantize(), w.dequantize()[16:32])
    for dtype in (torch.float32, torch.float16):
        out = torch.full((48, 384), float("nan"), dtype=dtype)
        dequantize_fp4_fragments(f.tensors["qweight"], f.tensors["scales"].view(torch.uint8),
                                 f.tensors["global_scale"], out)
        assert torch.equal(out, w.dequantize(dtype))


def test_fit_and_candidates() -> None:
    """nvfp4 weights take the layout like int4 (block scales of 16 columns); their prefill sizes take the
    dequantization path and the register decode, never the tiled GEMM (int4 / int8 codes only); a weight with a
    negative block scale stays row-major."""
    assert fragments_fit("nvfp4", (5120, 5120)) and not fragments_fit("nvfp4", (5120, 64))
    assert tiled_fragment_candidates("nvfp4", 128, 5120, 17408, 132) == []
    kinds = [c.kind for c in candidates("nvfp4", 4096, 248320, 5120, 132, layout=FRAGMENTS)]
    assert kinds == ["frag"]
    linear = QuantLinear(128, 32, "nvfp4")
    linear.load_float_(torch.randn(32, 128))
    linear.scales.data.view(torch.uint8)[3, 1] |= 0x80
    assert not linear.use_fragment_layout_() and linear.layout != FRAGMENTS
    linear.scales.data.view(torch.uint8)[3, 1] &= 0x7F
    assert linear.use_fragment_layout_() and linear.layout == FRAGMENTS


@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("case", [
    dict(m=1, n=48, k=256, cfg=_frag(8, 2, 2, 1)),  # a ragged last program
    dict(m=6, n=32, k=512, cfg=_frag(8, 1, 2, 3), residual=True),  # splits of unequal length
    dict(m=6, n=64, k=256, cfg=_frag(8, 2, 2, 2), swiglu=True),
    dict(m=5, n=64, k=256, cfg=_frag(8, 1, 2, 1, kind="frag-pair")),
    dict(m=11, n=32, k=512, cfg=_frag(16, 1, 4, 2, stages=2), residual=True),
    dict(m=3, n=64, k=512, cfg=_frag(8, 1, 4, 1), dtype=torch.float32),
])
def test_fragment_decode(case: dict) -> None:
    m, n, k, cfg = case["m"], case["n"], case["k"], case["cfg"]
    swiglu, dtype = case.get("swiglu", False), case.get("dtype", torch.float16)
    g = torch.Generator().manual_seed(m * 31 + n)
    w = _weight(n, k, seed=m)
    x = torch.randn(m, k, generator=g).to(dtype)
    n_out = n // 2 if swiglu else n
    res = torch.randn(m, n_out, generator=g).to(dtype) if case.get("residual") else None
    out = torch.full((m, n_out), float("nan"), dtype=dtype)
    got = quant_matmul_triton(x, fragment_laid(w), res, swiglu, out=out, config=cfg)
    ref = quant_matmul_reference(x, w, res, swiglu).float()
    err = (got.float() - ref).norm() / ref.norm()
    assert torch.isfinite(got).all() and err < TOL[dtype], f"{case}: relative error {err:.2e}"
