"""The tensor-core int4 decode path (``GemmConfig(kind="gemv-mma")``) in the Triton interpreter.

The interpreter cannot run inline PTX, so the kernel decodes with Triton bit operations here (``ASM``
off): these tests cover its indexing (even / odd column pairs, scale groups, several groups per K step),
split-K with the fused and the separate reduction, SwiGLU and residual epilogues, token counts beyond a
program's 8 or 16, and ragged N. The PTX decode runs in ``tests/gpu/test_quant_gemm_gpu.py``. fp16
activations (the interpreter's bf16 arithmetic is wrong); outputs and scratch are NaN-poisoned.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import QUANT_TOL as TOL
from kernel_testing import poisoned_outputs  # noqa: F401  (fixture)

from ninfer.kernels.quant_gemm import quant_matmul_reference, quant_matmul_triton
from ninfer.kernels.quant_gemm.tune import GemmConfig, candidates, mma_candidates
from ninfer.quant.formats import quantize

pytestmark = pytest.mark.usefixtures("poisoned_outputs")


def _check(fmt: str, m: int, n: int, k: int, cfg: GemmConfig, *, swiglu: bool = False, residual: bool = False,
           seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(n, k, generator=g) * 0.05, fmt)
    x = torch.randn(m, k, generator=g).half()
    n_out = n // 2 if swiglu else n
    res = torch.randn(m, n_out, generator=g).half() if residual else None
    out = torch.full((m, n_out), float("nan"), dtype=torch.float16)
    got = quant_matmul_triton(x, w, res, swiglu, out=out, config=cfg)
    assert torch.isfinite(got).all(), f"{fmt} {cfg}: unwritten or non-finite outputs"
    ref = quant_matmul_reference(x, w, res, swiglu).float()
    err = (got.float() - ref).norm() / ref.norm()
    assert err < TOL[torch.float16], f"{fmt} m={m} n={n} k={k} {cfg}: relative error {err:.2e}"


def _mma(tokens: int, block_n: int, block_k: int, split: int) -> GemmConfig:
    return GemmConfig(tokens, block_n, block_k, split, 2, 2, "gemv-mma")


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128"])
@pytest.mark.parametrize("m", [1, 5, 8])
def test_mma_decode(fmt: str, m: int) -> None:
    _check(fmt, m, 48, 512, _mma(8, 32, 256, 1), seed=m)  # ragged N, two K steps, groups per step
    _check(fmt, m, 96, 768, _mma(8, 32, 128 if fmt == "int4-g64" else 256, 3), residual=True, seed=m + 1)


@pytest.mark.parametrize("split", [1, 2])
def test_mma_swiglu(split: int) -> None:
    _check("int4-g64", 3, 128, 512, _mma(8, 32, 128, split), swiglu=True, residual=split > 1, seed=21)


def test_mma_more_tokens_than_a_program() -> None:
    """16 and 32 tokens per program, and 8 per program with 11 tokens (two programs along M)."""
    _check("int4-g64", 16, 64, 256, _mma(16, 32, 64, 2), residual=True, seed=22)
    _check("int4-g64", 29, 64, 256, _mma(32, 32, 128, 1), swiglu=True, seed=27)
    _check("int4-g64", 11, 64, 256, _mma(8, 32, 64, 1), seed=23)


def test_mma_separate_reduce_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from ninfer.kernels.quant_gemm import gemv as quant_gemv

    monkeypatch.setattr(quant_gemv, "_COUNTER_SLOTS", 1)  # 96 rows / 32 = 3 tiles: the reduce kernel
    _check("int4-g64", 3, 96, 512, _mma(8, 32, 128, 4), swiglu=True, residual=True, seed=24)


def test_mma_unaligned_activations_are_copied() -> None:
    """x rows read as 32-bit column pairs: a view starting at an odd element still gives the right result."""
    g = torch.Generator().manual_seed(25)
    w = quantize(torch.randn(64, 256, generator=g) * 0.05, "int4-g64")
    base = torch.randn(2, 257, generator=g).half()
    x = base[:, 1:]
    got = quant_matmul_triton(x, w, config=_mma(8, 32, 128, 1))
    ref = quant_matmul_reference(x, w).float()
    assert (got.float() - ref).norm() / ref.norm() < TOL[torch.float16]


def test_mma_rejects_fp32_activations_and_ragged_k() -> None:
    g = torch.Generator().manual_seed(26)
    w = quantize(torch.randn(64, 320, generator=g) * 0.05, "int4-g64")
    with pytest.raises(ValueError, match="gemv-mma"):
        quant_matmul_triton(torch.randn(1, 320, generator=g), w, config=_mma(8, 32, 64, 1))
    with pytest.raises(ValueError, match="gemv-mma"):
        quant_matmul_triton(torch.randn(1, 320, generator=g).half(), w, config=_mma(8, 32, 128, 1))


def test_mma_candidates() -> None:
    """int4 only, M <= 32, 16-bit activations; whole K steps; 8, 16 or 32 tokens per program;
    split-K brings small weights to several programs per SM."""
    assert mma_candidates("int8-g64", 1, 5120, 5120, 132) == []
    assert mma_candidates("int4-g64", 33, 5120, 5120, 132) == []
    assert not any(c.kind == "gemv-mma" for c in candidates("int4-g64", 1, 5120, 5120, 132))
    for m in (1, 8, 9, 16, 17, 32):
        for n, k, swiglu in ((5120, 17408, False), (17408, 5120, True), (12288, 5120, False)):
            cands = candidates("int4-g128", m, n, k, 132, swiglu=swiglu, mma=True)
            assert cands[0].kind == "dot"
            mma = [c for c in cands if c.kind == "gemv-mma"]
            assert mma and all(k % c.block_k == 0 and c.block_k % 128 == 0 for c in mma)
            assert all(c.block_m == (8 if m <= 8 else 16 if m <= 16 else 32) for c in mma)
            assert max(-(-n // c.block_n) * c.split_k for c in mma) >= 8 * 132
