"""The fragment layout of int4 and int8 weights and the register decode GEMM that reads it, on CPU.

* The layout against the PTX ISA's ``m16n8k16`` fragment map: an emulation that builds each MMA's A (16 x 16) and
  B (16 x 8) from what every lane holds, as the kernel's PTX assigns registers, must give ``x @ W^T``. For int8 the
  emulation also runs the decode's bit arithmetic (``lop3`` masks, the bf16 / fp16 bit patterns, the ``fma``) on
  every code, with the constants the PTX uses.
* Round trips, row slices, the dequantization kernel (bit for bit ``QuantizedTensor.dequantize``).
* The decode kernel in the interpreter (``ASM`` off: the same layout read by Triton gathers): token counts, splits
  with the fused and the separate reduction, SwiGLU and residual epilogues, fp16 and fp32 activations; the same
  for the tiled GEMM of the prefill sizes (``fragment_tiled``). Outputs and scratch are NaN-poisoned. The PTX itself runs in ``tests/gpu/test_quant_fragments_gpu.py``.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import QUANT_TOL as TOL
from kernel_testing import check_fragment_decode as _check
from kernel_testing import frag_config as _frag
from kernel_testing import fragment_laid, poisoned_outputs  # noqa: F401  (fixture)

from ninfer.kernels.quant_gemm import (
    QuantizedTensor,
    quant_matmul_reference,
    quant_matmul_triton,
)
from ninfer.kernels.quant_gemm.fragments import (
    FRAGMENTS,
    dequantize_fragments,
    fragments_fit,
    from_fragments,
)
from ninfer.kernels.quant_gemm.tune import (
    GemmConfig,
    candidates,
    fragment_candidates,
    graph_candidates,
    graph_fallback,
    tiled_fragment_candidates,
)
from ninfer.quant.formats import quantize


def _weight(n: int, k: int, fmt: str = "int4-g128", seed: int = 0) -> QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=g) * 0.05, fmt)


def _lane_registers(words: list[int]) -> list[list[tuple[int, int]]]:
    """A lane's A registers of one chunk's code words, per MMA j, as (low, high) integer values: int4 (4 words):
    register r of MMA j = nibbles at bits 4r and 16 + 4r of word j, minus 8; int8 (8 words): registers 2b and
    2b + 1 of MMA j = bytes 0, 2 and 1, 3 of word 2j + b, through the PTX's bit decode."""
    if len(words) == 4:
        return [[(((w >> (4 * r)) & 0xF) - 8, ((w >> (16 + 4 * r)) & 0xF) - 8) for r in range(4)] for w in words]
    regs = []
    for j in range(4):
        per_mma = []
        for b in range(2):
            for h in range(2):
                per_mma.append(_decode_int8_register(words[2 * j + b] >> (8 * h)))
        regs.append(per_mma)
    return regs


def _bits_to_float(bits: int, ty: str) -> float:
    """The 16-bit float (bf16 / fp16) with these bits."""
    signed = bits - 0x10000 if bits >= 0x8000 else bits
    return torch.tensor([signed], dtype=torch.int16).view(torch.bfloat16 if ty == "bf16" else torch.float16).item()


def _decode_int8_register(src: int, ty: str = "bf16") -> tuple[int, int]:
    """``lop3(src, 0x007F007F, magic)``, ``lop3(src, 0x00800080, base)``, ``fma(m, 1, o)`` per 16-bit half, with the
    constants of ``fragment_ptx`` for ``ty``, as integers (the decode must be exact)."""
    from ninfer.kernels.quant_gemm.fragment_ptx import _CONSTS

    _, _, magic, base = (int(c, 16) for c in _CONSTS[ty])
    src &= 0xFFFFFFFF
    m = (src & 0x007F007F) | magic
    o = (src & 0x00800080) | base
    halves = []
    for shift in (0, 16):
        value = _bits_to_float((m >> shift) & 0xFFFF, ty) + _bits_to_float((o >> shift) & 0xFFFF, ty)
        assert value == int(value)
        halves.append(int(value))
    return halves[0], halves[1]


def _emulate(q: torch.Tensor, s: torch.Tensor, x: torch.Tensor, group: int) -> torch.Tensor:
    """``x [<= 8, K] @ W^T`` from the fragment layout through the m16n8k16 fragment map: lane (g, t) holds A
    elements (g, 2t..2t+1) in register 0, (g+8, 2t..) in 1, (g, 2t+8..) in 2, (g+8, 2t+8..) in 3, and B elements
    (k = 2t..2t+1, n = g) in register 0, (2t+8.., g) in 1; D = A B. Each lane's B registers for MMA j are
    activation words 2j and 2j + 1 of its 16 columns 16t..16t+15 of the chunk."""
    n, kb = q.shape
    int8 = q.dtype == torch.int8
    k = kb if int8 else 2 * kb
    per_lane = 8 if int8 else 4
    flat = q.contiguous().view(torch.int32).view(n // 16, k // 64, -1).tolist()  # tile, chunk, words
    sc = s.float().view(n // 16, k // group, 8, 2)
    xp = torch.zeros(8, k, dtype=torch.float64)
    xp[: x.shape[0]] = x.double()
    y = torch.zeros(8, n, dtype=torch.float64)
    for tile in range(n // 16):
        for c in range(k // 64):
            d = torch.zeros(16, 8, dtype=torch.float64)
            chunk = flat[tile][c]
            lanes = []
            for lane in range(32):  # int8: words 0..3 in the first 512 bytes (lane after lane), 4..7 in the second
                words = [chunk[lane * 4 + i] for i in range(4)]
                if int8:
                    words += [chunk[128 + lane * 4 + i] for i in range(4)]
                assert len(words) == per_lane
                lanes.append(_lane_registers([w & 0xFFFFFFFF for w in words]))
            for j in range(4):
                a = torch.zeros(16, 16, dtype=torch.float64)
                b = torch.zeros(16, 8, dtype=torch.float64)
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    for r, (lo, hi) in enumerate(lanes[lane][j]):
                        row = g + 8 * (r % 2)
                        slot = 2 * t + 8 * (r // 2)
                        a[row, slot], a[row, slot + 1] = lo, hi
                    col = 64 * c + 16 * t + 4 * j
                    b[2 * t, g], b[2 * t + 1, g] = xp[g, col], xp[g, col + 1]
                    b[2 * t + 8, g], b[2 * t + 9, g] = xp[g, col + 2], xp[g, col + 3]
                d += a @ b
            group_of = 64 * c // group
            scale = torch.cat([sc[tile, group_of, :, 0], sc[tile, group_of, :, 1]]).double()
            y[:, tile * 16:(tile + 1) * 16] += (d * scale[:, None]).t()
    return y[: x.shape[0]]


@pytest.mark.parametrize("ty", ["bf16", "f16"])
def test_int8_decode_is_exact_for_every_byte(ty: str) -> None:
    """Every byte pair through the decode's bit arithmetic gives the two's complement codes."""
    for lo in range(256):
        hi = (lo * 37 + 11) % 256
        other = (lo * 91 + 5) % 256  # the register's other bytes (the next row's codes) must not leak in
        word = lo | (other << 8) | (hi << 16) | ((255 - other) << 24)
        assert _decode_int8_register(word, ty) == (lo - 256 * (lo >= 128), hi - 256 * (hi >= 128))
    assert _decode_int8_register(0x80FF7F00 >> 8, ty) == (127, -128)  # bytes 1 and 3 after the shift


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "int8-g64"])
def test_layout_matches_the_mma_fragment_map(fmt: str) -> None:
    w = _weight(32, 256, fmt, seed=1)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    f = fragment_laid(w)
    got = _emulate(f.tensors["qweight"], f.tensors["scales"], x, w.format.group_size)
    ref = x.double() @ w.dequantize(torch.float64).t()
    assert torch.allclose(got, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("fmt", ["int4-g64", "int8-g64"])
def test_round_trip_and_row_slices(fmt: str) -> None:
    w = _weight(48, 384, fmt, seed=3)
    f = fragment_laid(w)
    q, s = from_fragments(f.tensors["qweight"], f.tensors["scales"])
    assert torch.equal(q, w.tensors["qweight"]) and torch.equal(s, w.tensors["scales"])
    assert torch.equal(f.dequantize(), w.dequantize())
    # rows 16..31 of the weight are bytes 16..31 of the re-laid tensors: tiles stay whole under row slices
    part = QuantizedTensor(w.format, (16, 384), {name: t[16:32] for name, t in f.tensors.items()}, layout=FRAGMENTS)
    assert torch.equal(part.dequantize(), w.dequantize()[16:32])


def test_fit() -> None:
    assert fragments_fit("int4-g128", (5120, 17408)) and fragments_fit("int4-g64", (16, 128))
    assert not fragments_fit("int4-g128", (257, 2048))  # the MoE router's rows
    assert fragments_fit("int8-g64", (248320, 5120)) and not fragments_fit("int8-g32", (5120, 5120))
    assert not fragments_fit("int4-g64", (16, 64))  # one chunk: shorter than the decode's loop trip
    assert not fragments_fit("int4-g64", (8, 16, 128)) and not fragments_fit("fp8", (5120, 5120))


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "int8-g64"])
def test_every_weight_that_fits_has_a_register_decode(fmt: str) -> None:
    """A re-laid weight is served by the register decode at every token count (its other paths, dequantization
    and the graph fallback, need it too): no shape that fits may be left without a candidate."""
    for k in range(64, 2048 + 1, 64):
        if fragments_fit(fmt, (192, k)):
            for m in (1, 4, 32, 128):
                assert fragment_candidates(fmt, m, 192, k, 132), (fmt, k, m)


@pytest.mark.parametrize("fmt", ["int4-g128", "int8-g64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_fragments_is_bit_exact(fmt: str, dtype: torch.dtype) -> None:
    w = _weight(32, 512, fmt, seed=4)
    f = fragment_laid(w)
    out = torch.full((32, 512), float("nan"), dtype=dtype)
    dequantize_fragments(f.tensors["qweight"], f.tensors["scales"], w.format.group_size, out)
    assert torch.equal(out, w.dequantize(dtype))


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "int8-g64"])
@pytest.mark.parametrize("m", [1, 6])
def test_fragment_decode(fmt: str, m: int) -> None:
    _check(fmt, m, 48, 256, _frag(8, 2, 2, 1), seed=m)  # a ragged last program (3 tiles, 2 per program)
    _check(fmt, m, 32, 512, _frag(8, 1, 2, 3), residual=True, seed=m + 1)  # splits of unequal length


def test_fragment_decode_tokens_per_program() -> None:
    _check("int4-g64", 16, 32, 256, _frag(16, 1, 1, 2), residual=True, seed=5)
    _check("int4-g128", 29, 32, 256, _frag(32, 2, 2, 1), seed=6)
    _check("int4-g64", 11, 32, 256, _frag(8, 1, 4, 1), seed=7)  # two programs along the tokens
    _check("int4-g64", 70, 32, 256, _frag(64, 1, 2, 2), residual=True, seed=15)  # the prefill sizes' 64 tokens
    _check("int8-g64", 64, 32, 256, _frag(64, 2, 2, 1), seed=16)


@pytest.mark.parametrize("split", [1, 2])
def test_fragment_swiglu(split: int) -> None:
    _check("int4-g64", 3, 64, 256, _frag(8, 1, 2, split), swiglu=True, residual=split > 1, seed=8)
    _check("int8-g64", 9, 64, 256, _frag(16, 1, 2, split), swiglu=True, residual=split > 1, seed=14)


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "int8-g64"])
def test_fragment_pairs_of_tiles(fmt: str) -> None:
    """Two tiles per warp, one in each half of the output (``frag-pair``): a ragged last program (96 rows = 3 pairs,
    2 per program), split-K with the fused reduction and a residual, several token blocks, prefetching; SwiGLU
    (already two streams a warp) refuses it."""
    _check(fmt, 3, 96, 256, _frag(8, 2, 2, 1, kind="frag-pair"), seed=30)
    _check(fmt, 5, 64, 512, _frag(8, 1, 2, 3, 2, kind="frag-pair"), residual=True, seed=31)
    _check(fmt, 19, 64, 256, _frag(16, 1, 2, 2, kind="frag-pair"), residual=True, seed=32)
    with pytest.raises(ValueError, match="SwiGLU"):
        _check(fmt, 3, 128, 256, _frag(8, 1, 2, 1, kind="frag-pair"), swiglu=True)
    assert all(c.kind == "frag" for c in fragment_candidates(fmt, 1, 17408, 5120, 132, swiglu=True))
    pairs = [c for c in fragment_candidates(fmt, 1, 5120, 17408, 132) if c.kind == "frag-pair"]
    assert pairs and all(c.block_n == 32 * c.num_warps for c in pairs)
    assert fragment_candidates(fmt, 1, 5120, 17408, 132)[0].kind == "frag"  # untuned keys keep the favourite


def test_fragment_prefetch() -> None:
    """The next loop trip's codes requested during this one (``num_stages=2``), the last trip of a split requesting
    its own again: splits of two trips, of one, and of unequal length."""
    _check("int4-g64", 3, 48, 512, _frag(8, 2, 2, 2, 2), residual=True, seed=20)
    _check("int4-g128", 5, 64, 768, _frag(8, 1, 2, 1, 2), swiglu=True, seed=21)
    _check("int8-g64", 2, 32, 384, _frag(8, 1, 2, 2, 2), seed=22)


def test_fragment_odd_scale_groups_per_row() -> None:
    """K = 384 in groups of 128: three scale halves per row (the scales are read as words across rows)."""
    _check("int4-g128", 2, 32, 384, _frag(8, 1, 2, 1), residual=True, seed=13)


def test_fragment_fp32_activations() -> None:
    _check("int4-g128", 4, 32, 256, _frag(8, 2, 2, 2), residual=True, dtype=torch.float32, seed=9)


def test_fragment_separate_reduce_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from ninfer.kernels.quant_gemm import gemv as quant_gemv

    monkeypatch.setattr(quant_gemv, "_COUNTER_SLOTS", 1)
    _check("int4-g64", 3, 64, 256, _frag(8, 1, 1, 4), swiglu=True, residual=True, seed=10)


def _tiled(tokens: int, rows: int, split: int = 1, kind: str = "frag-tiled") -> GemmConfig:
    return GemmConfig(tokens, rows, 64, split, 4, 1, kind)


@pytest.mark.parametrize("kind", ["frag-tiled", "frag-tiled-codes"])
@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "int8-g64"])
def test_fragment_tiled(fmt: str, kind: str) -> None:
    """The tiled GEMM over the fragment layout, both variants (weights scaled before the MMA, exact codes into it):
    token blocks with a ragged last one, a ragged last row block (48 rows in 32-row programs), split-K of unequal
    splits with a residual, SwiGLU, fp32 activations."""
    k = 256 if fmt == "int4-g128" else 384
    _check(fmt, 40, 96, 256, _tiled(32, 32, kind=kind), seed=1)
    _check(fmt, 21, 48, 256, _tiled(16, 32, kind=kind), residual=True, seed=2)
    _check(fmt, 17, 64, k, _tiled(16, 64, 3, kind), residual=True, seed=3)
    _check(fmt, 20, 64, 256, _tiled(16, 32, 2, kind), swiglu=True, residual=True, seed=4)
    _check(fmt, 20, 64, 256, _tiled(16, 32, kind=kind), swiglu=True, dtype=torch.float32, seed=5)


def test_verification_sizes_also_offer_narrower_programs() -> None:
    """9-32 tokens: besides programs of 16 / 32 tokens, ones of 8 (and 16) tokens side by side; decode sizes and
    prefill sizes keep their lists. The narrower programs compute the same (a ragged last token block)."""
    def token_blocks(m: int) -> set[int]:
        return {c.block_m for c in fragment_candidates("int4-g64", m, 17408, 5120, 132)}

    assert token_blocks(8) == {8} and token_blocks(16) == {16, 8} and token_blocks(29) == {32, 16, 8}
    assert token_blocks(64) == {32}
    narrow = [c for c in fragment_candidates("int4-g64", 29, 64, 256, 4) if c.block_m == 8]
    assert narrow
    _check("int4-g64", 29, 64, 256, narrow[0], residual=True, seed=23)


@pytest.mark.usefixtures("poisoned_outputs")
def test_fragment_weights_take_their_own_candidates() -> None:
    """Decode sizes: the fragment decode (from 17 tokens also the tiled GEMM's first two, int4 / int8: they compute
    the same at 29 tokens); prefill sizes: the dequantization path first (untuned keys), then
    the decode's favourite up to 512 tokens and its 64-token program (not with SwiGLU), the dequantization alone
    above; a weight too large for the workspace: the decode's favourite and the tiled GEMM's first two; graphs
    capture the decode where the dequantization was chosen, and their own keys offer the tiled GEMM instead."""
    for m in (1, 8, 16, 32):
        cands = candidates("int4-g128", m, 5120, 17408, 132, layout=FRAGMENTS)
        decodes = [c for c in cands if c.kind in ("frag", "frag-pair") and c.block_m <= 32]
        assert decodes and cands[:len(decodes)] == decodes and cands[0] == decodes[0]
        assert [c.kind for c in cands[len(decodes):]] == (["frag-tiled"] * 2 if m > 16 else []), m
    assert all(c.kind == "frag" for c in candidates("nvfp4", 32, 17408, 5120, 132, swiglu=True, layout=FRAGMENTS))
    w, x = fragment_laid(_weight(128, 256, "int8-g64", 13)), torch.randn(29, 256).half()
    for cfg in candidates("int8-g64", 29, 128, 256, 4, layout=FRAGMENTS)[-2:]:
        got, ref = quant_matmul_triton(x, w, config=cfg), quant_matmul_reference(x, w).float()
        assert cfg.kind == "frag-tiled" and (got.float() - ref).norm() / ref.norm() < TOL[torch.float16], cfg
    cands = candidates("int4-g128", 512, 5120, 17408, 132, layout=FRAGMENTS)
    assert [(c.kind, c.block_m) for c in cands] == [("dequant", 128), ("frag", 32), ("frag", 64)]
    swiglu = candidates("int4-g128", 512, 17408, 5120, 132, swiglu=True, layout=FRAGMENTS)
    assert [(c.kind, c.block_m) for c in swiglu] == [("dequant", 128), ("frag", 32)]
    assert [c.kind for c in candidates("int4-g128", 4096, 5120, 17408, 132, layout=FRAGMENTS)] == ["dequant"]
    assert [c.kind for c in candidates("int8-g64", 4096, 248320, 5120, 132, layout=FRAGMENTS)] == \
        ["frag", "frag-tiled", "frag-tiled"]
    assert graph_fallback("int4-g128", 4096, 5120, 17408, 132, FRAGMENTS).kind == "frag"
    for m in (64, 128, 4096):
        graph = graph_candidates("int4-g64", m, 17408, 5120, 132, swiglu=True, layout=FRAGMENTS)
        assert "dequant" not in {c.kind for c in graph} and "frag-tiled" in {c.kind for c in graph}, m
    assert all(c.block_m == 64 for c in tiled_fragment_candidates("int4-g64", 64, 5120, 17408, 132))
    assert tiled_fragment_candidates("int4-g64", 128, 24, 256, 132) == []  # rows in part of a 16-row tile
    kinds = {c.kind for c in tiled_fragment_candidates("int4-g64", 128, 5120, 17408, 132)}
    assert kinds == {"frag-tiled", "frag-tiled-codes"}
    swiglu_codes = [c for c in tiled_fragment_candidates("int4-g64", 128, 17408, 5120, 132, swiglu=True)
                    if c.kind == "frag-tiled-codes"]
    assert [(c.block_n, c.num_warps) for c in swiglu_codes] == [(64, 8)]  # the one that does not spill
    w = fragment_laid(_weight(32, 256, "int4-g64", 11))
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(12)).half()
    for cfg in candidates("int4-g64", 40, 32, 256, 4, layout=FRAGMENTS):
        got = quant_matmul_triton(x, w, config=cfg)
        ref = quant_matmul_reference(x, w).float()
        assert (got.float() - ref).norm() / ref.norm() < TOL[torch.float16], cfg


@pytest.mark.parametrize("swiglu", [False, True])
def test_split_sums_across_accumulators_equal_the_default(swiglu: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``NINFER_SPLIT_SUM=across`` (the default: the fused split-K reduction summing split after split for all of a
    program's accumulators at once) gives the same bits as ``each``, which sums accumulator after accumulator: both
    add each output's partials in split order. Three unequal splits, 16 tokens (two token blocks), a residual."""
    g = torch.Generator().manual_seed(40)
    w = fragment_laid(_weight(64, 512, "int4-g64", 40))
    x = torch.randn(13, 512, generator=g).to(torch.float16)
    res = torch.randn(13, 32 if swiglu else 64, generator=g).to(torch.float16)
    cfg = _frag(16, 1, 2, 3)
    outs = []
    for mode in ("each", "across"):
        monkeypatch.setenv("NINFER_SPLIT_SUM", mode)
        out = torch.full_like(res, float("nan"))
        outs.append(quant_matmul_triton(x, w, res, swiglu, out=out, config=cfg))
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kind", ["frag", "frag-pair"])
@pytest.mark.parametrize("swiglu", [False, True])
def test_split_sums_of_whole_tiles(kind: str, swiglu: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``NINFER_SPLIT_SUM=tile``: the last split loads its whole tile's partials of several splits at once and sums
    them in a tree (not split order), so results match the reference (and the default within rounding): splits of
    unequal length, more splits than one load takes (S_BLOCK), several token blocks and programs, residual,
    SwiGLU, pairs of tiles."""
    if kind == "frag-pair" and swiglu:
        return
    monkeypatch.setenv("NINFER_SPLIT_SUM", "tile")
    _check("int4-g64", 13, 64, 512, _frag(16, 1, 2, 3, kind=kind), swiglu=swiglu, residual=True, seed=41)
    _check("int8-g64", 3, 96, 2048, _frag(8, 2 if kind == "frag" else 1, 1, 32, kind=kind),
           swiglu=swiglu, residual=not swiglu, seed=42)  # 32 splits of one chunk: S_BLOCK 16 or 8, two or four loads
    _check("int4-g128", 37, 64, 256, _frag(32, 2, 2, 2, kind=kind), swiglu=swiglu, seed=43)


def test_an_unknown_split_sum_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_SPLIT_SUM", "tree")
    with pytest.raises(ValueError, match="NINFER_SPLIT_SUM='tree'"):
        _check("int4-g64", 2, 32, 256, _frag(8, 1, 1, 2))


def test_the_tile_sum_offers_more_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``NINFER_SPLIT_SUM=tile`` the candidates add 32 programs per SM (splits of one or two loop trips on the
    27B o_proj at one token); the default's list is unchanged and a prefix of it."""
    default = fragment_candidates("int4-g64", 1, 5120, 6144, 132)
    monkeypatch.setenv("NINFER_SPLIT_SUM", "tile")
    tile = fragment_candidates("int4-g64", 1, 5120, 6144, 132)
    extra = [c for c in tile if c not in default]
    assert set(default) <= set(tile) and tile[0] == default[0] and extra
    assert max(c.split_k for c in extra) > max(c.split_k for c in default)
    eight = [c for c in extra if c.block_k == 512]
    assert eight and all(c.num_stages == 1 for c in eight)
    _check("int4-g128", 3, 64, 1024, eight[0].__class__(8, 32, 512, 2, 2, 1, "frag"), residual=True, seed=44)


def test_the_tile_sum_tunes_its_own_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Choices made under the default sum are not reused under ``NINFER_SPLIT_SUM=tile`` (its candidates and
    timings differ): fragment-laid keys carry a marker there; row-major keys do not."""
    from ninfer.kernels.quant_gemm import tune
    from ninfer.kernels.quant_gemm.weights import ROWS

    keys = []

    class Recorder:
        def choose(self, table, key, cands, time_fn, device):  # noqa: ANN001, ANN201
            keys.append(key)
            return cands()[0]

    monkeypatch.setattr(tune, "default_tuner", lambda: Recorder())
    x = torch.zeros(1, 512, dtype=torch.float16)
    for mode in ("each", "tile"):
        monkeypatch.setenv("NINFER_SPLIT_SUM", mode)
        for layout in (FRAGMENTS, ROWS):
            tune.select_config("int4-g64", x, 64, 512, False, False, lambda cfg: None, layout)
    assert [k[-1] == "split-tile" for k in keys] == [False, False, True, False]
