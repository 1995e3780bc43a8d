"""The decode GEMV path of the quantized GEMM (``GemmConfig(kind="gemv")``) in the Triton interpreter.

Against the dequantize-then-matmul reference for every format, fp32 and fp16 activations, M in
{1, 3, 8}, N in {48, 200} (not multiples of BLOCK_N), K in {256, 640} (640 leaves a partial last K
step), with and without residual, SwiGLU, split-K 1 and > 1. Outputs and the split-K scratch are
NaN-poisoned, so an element nobody writes fails the check.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import QUANT_FORMATS as FORMATS, QUANT_TOL as TOL
from kernel_testing import poisoned_outputs  # noqa: F401  (fixture)

from ninfer.kernels.quant_gemm import quant_matmul_reference, quant_matmul_triton
from ninfer.kernels.quant_gemm.tune import (
    GEMV_MAX_M,
    GemmConfig,
    candidates,
    gemv_candidates,
    kernel_params,
    m_bucket,
)
from ninfer.quant.formats import quantize


pytestmark = pytest.mark.usefixtures("poisoned_outputs")


def _check(fmt: str, dtype: torch.dtype, m: int, n: int, k: int, cfg: GemmConfig, *, swiglu: bool = False,
           residual: bool = False, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(n, k, generator=g) * 0.05, fmt)
    x = torch.randn(m, k, generator=g).to(dtype)
    n_out = n // 2 if swiglu else n
    res = torch.randn(m, n_out, generator=g).to(dtype) if residual else None
    out = torch.full((m, n_out), float("nan"), dtype=dtype)
    got = quant_matmul_triton(x, w, res, swiglu, out=out, config=cfg)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(got).all(), f"{fmt} {cfg}: unwritten or non-finite outputs"
    ref = quant_matmul_reference(x, w, res, swiglu).float()
    err = (got.float() - ref).norm() / ref.norm()
    assert err < TOL[dtype], f"{fmt} {dtype} m={m} n={n} k={k} {cfg}: relative error {err:.2e}"


def _gemv(m: int, block_n: int, block_k: int, split: int, block_m: int | None = None) -> GemmConfig:
    return GemmConfig(block_m or m_bucket(m), block_n, block_k, split, 4, 1, "gemv")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_formats(fmt: str, dtype: torch.dtype, m: int) -> None:
    _check(fmt, dtype, m, 48, 256, _gemv(m, 32, 128, 1), seed=m)  # one K step per split
    _check(fmt, dtype, m, 200, 640, _gemv(m, 16, 256, 2), residual=True, seed=m + 1)  # ragged K, split-K


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("split", [1, 3])
def test_gemv_swiglu_and_residual(fmt: str, split: int) -> None:
    _check(fmt, torch.float32, 3, 256, 640, _gemv(3, 16, 128, split), swiglu=True, residual=split > 1, seed=7)


@pytest.mark.parametrize("fmt", ["int4-g64", "fp8-b128"])
def test_gemv_swiglu_fp16_eight_rows(fmt: str) -> None:
    _check(fmt, torch.float16, 8, 256, 256, _gemv(8, 32, 128, 2), swiglu=True, residual=True, seed=8)


@pytest.mark.parametrize("fmt", ["fp8", "fp8-b128"])
def test_gemv_partial_scale_block(fmt: str) -> None:
    """fp8 formats allow any K: the last 128-column scale block is partial."""
    _check(fmt, torch.float32, 3, 48, 200, _gemv(3, 16, 128, 2), residual=True, seed=9)


def test_gemv_more_rows_than_block_m() -> None:
    _check("int4-g64", torch.float32, 7, 48, 640, _gemv(7, 16, 128, 2, block_m=2), residual=True, seed=10)


def test_gemv_rejects_block_k_below_group() -> None:
    with pytest.raises(ValueError, match="multiple of the scale group"):
        _check("int4-g128", torch.float32, 1, 48, 256, _gemv(1, 16, 64, 1))


def test_gemv_candidates_follow_the_dot_favourite() -> None:
    for fmt in FORMATS:
        for m in range(1, 17):
            for n, k in ((1024, 5120), (5120, 17408), (34816, 5120), (248320, 5120)):
                cands = candidates(fmt, m, n, k, 132)
                assert cands[0].kind == "dot"
                gemv = [c for c in cands if c.kind == "gemv"]
                assert bool(gemv) == (m <= GEMV_MAX_M)
                for c in gemv:
                    kernel_params(fmt, c)
                    assert c.block_m >= m and c.block_k % max(1, {"fp8": 1}.get(fmt, 16)) == 0
                    programs = -(-n // c.block_n) * c.split_k
                    assert programs >= 4 * 132 or c.split_k == -(-k // c.block_k), (fmt, m, n, k, c)
    assert gemv_candidates("nvfp4", 1, 1024, 5120, 132)[0].split_k > 1


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_prefetch(fmt: str, m: int) -> None:
    """The register-prefetch variant: several K steps per split (ragged K too), with SwiGLU and a residual."""
    prefetch = lambda bn, bk, split: GemmConfig(m_bucket(m), bn, bk, split, 4, 1, "gemv-prefetch")  # noqa: E731
    _check(fmt, torch.float32, m, 48, 512, prefetch(32, 128, 1), seed=m)  # four steps, one split
    _check(fmt, torch.float32, m, 200, 640, prefetch(16, 128, 2), residual=True, seed=m + 1)  # ragged last step
    _check(fmt, torch.float16, m, 96, 768, prefetch(16, 128, 3), swiglu=True, seed=m + 2)


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_on_32_bit_words(fmt: str, m: int) -> None:
    """int4 codes read as 32-bit words (``gemv-w32``): several K steps per split, a ragged last step,
    split-K with a residual, SwiGLU in fp16; nibble j of a word is column 8 w + j."""
    words = lambda bn, bk, split: GemmConfig(m_bucket(m), bn, bk, split, 4, 1, "gemv-w32")  # noqa: E731
    _check(fmt, torch.float32, m, 48, 512, words(32, 128, 1), seed=m)  # four steps, one split
    _check(fmt, torch.float32, m, 200, 640, words(16, 128, 2), residual=True, seed=m + 1)  # ragged last step
    _check(fmt, torch.float16, m, 96, 768, words(16, 256, 3), swiglu=True, seed=m + 2)


def test_gemv_words_only_for_int4() -> None:
    assert any(c.kind == "gemv-w32" for c in gemv_candidates("int4-g64", 1, 5120, 17408, 132))
    assert not any(c.kind == "gemv-w32" for c in gemv_candidates("nvfp4", 1, 5120, 17408, 132))
    with pytest.raises(ValueError, match="32-bit words"):
        _check("nvfp4", torch.float32, 1, 48, 512, GemmConfig(1, 32, 128, 1, 4, 1, "gemv-w32"))


@pytest.mark.parametrize("swiglu", [False, True])
def test_split_k_fused_reduction_equals_the_reduce_kernel(swiglu: bool) -> None:
    """Split-K partials summed by each tile's last program (arrival counters) give the same bits as the
    separate reduce kernel (both sum in split order), and every counter is back at zero afterwards."""
    from ninfer.kernels.quant_gemm import gemv as quant_gemv

    g = torch.Generator().manual_seed(11)
    w = quantize(torch.randn(200, 640, generator=g) * 0.05, "int4-g64")
    x = torch.randn(3, 640, generator=g)
    res = torch.randn(3, 100 if swiglu else 200, generator=g)
    cfg = _gemv(3, 16, 128, 3)
    fused = quant_matmul_triton(x, w, res, swiglu, config=cfg)
    counters = quant_gemv.tile_counters(x.device, 1)
    assert counters is not None and int(counters.abs().sum()) == 0
    with quant_gemv.reduce_kernel_for_splits():
        assert quant_gemv.tile_counters(x.device, 1) is None
        separate = quant_matmul_triton(x, w, res, swiglu, config=cfg)
    assert quant_gemv.tile_counters(x.device, 1) is counters
    assert torch.equal(fused, separate)
    ref = quant_matmul_reference(x, w, res, swiglu)
    assert (fused - ref).norm() / ref.norm() < TOL[torch.float32]


def test_split_k_falls_back_when_tiles_exceed_the_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    from ninfer.kernels.quant_gemm import gemv as quant_gemv

    monkeypatch.setattr(quant_gemv, "_COUNTER_SLOTS", 4)  # 200 rows / 16 = 13 tiles: the reduce kernel
    _check("int4-g64", torch.float32, 3, 200, 640, _gemv(3, 16, 128, 3), residual=True, seed=12)
