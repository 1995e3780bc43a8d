"""Quantized GEMM kernels in the Triton interpreter vs the dequantize-then-matmul reference.

Shapes are small but ragged: N is not a multiple of BLOCK_N, M not of BLOCK_M, and K (a multiple of
each format's group size) is not a multiple of BLOCK_K except where noted, so masks and clamped
rows are exercised. Each format runs the skinny path (post-dot group scales), its split-K variant
and the tiled path (scales applied to the tile).
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import QUANT_FORMATS as FORMATS, QUANT_K_FOR as K_FOR, QUANT_TOL as TOL

from ninfer.kernels.quant_gemm import (
    quant_matmul,
    quant_matmul_reference,
    quant_matmul_triton,
)
from ninfer.kernels.quant_gemm.tune import GemmConfig, candidates, kernel_params
from ninfer.quant.formats import quantize



def _bk(fmt: str, bytes_per_row: int) -> int:
    return bytes_per_row * (2 if fmt.startswith("int4") or fmt == "nvfp4" else 1)


def _check(fmt: str, dtype: torch.dtype, m: int, n: int, cfg: GemmConfig, *, swiglu: bool = False,
           residual: bool = False, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    k = K_FOR[fmt]
    w = quantize(torch.randn(n, k, generator=g) * 0.05, fmt)
    x = torch.randn(m, k, generator=g).to(dtype)
    n_out = n // 2 if swiglu else n
    res = torch.randn(m, n_out, generator=g).to(dtype) if residual else None
    out = torch.full((m, n_out), float("nan"), dtype=dtype)
    got = quant_matmul_triton(x, w, res, swiglu, out=out, config=cfg)
    assert got.data_ptr() == out.data_ptr()
    ref = quant_matmul_reference(x, w, res, swiglu).float()
    err = (got.float() - ref).norm() / ref.norm()
    assert err < TOL[dtype], f"{fmt} {dtype} {cfg}: relative error {err:.2e}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_skinny_path(fmt: str, dtype: torch.dtype) -> None:
    _check(fmt, dtype, m=3, n=40, cfg=GemmConfig(16, 32, _bk(fmt, 128), 1, 2, 1))


@pytest.mark.parametrize("fmt", FORMATS)
def test_skinny_split_k_with_residual(fmt: str) -> None:
    _check(fmt, torch.float32, m=1, n=40, cfg=GemmConfig(16, 16, _bk(fmt, 32) if fmt != "int4-g128" else 128, 3, 1, 1),
           residual=True, seed=1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiled_path(fmt: str) -> None:
    assert kernel_params(fmt, GemmConfig(32, 32, 64)).get("scaled") == (fmt != "fp8")
    _check(fmt, torch.float16, m=37, n=40, cfg=GemmConfig(32, 32, 64, 1, 4, 1), seed=2)


@pytest.mark.parametrize("fmt", ["int4-g64", "nvfp4", "fp8"])
@pytest.mark.parametrize("split", [1, 2])
def test_swiglu_epilogue_on_stacked_gate_up(fmt: str, split: int) -> None:
    _check(fmt, torch.float32, m=5, n=64, cfg=GemmConfig(16, 16, _bk(fmt, 64), split, 1, 1), swiglu=True,
           residual=True, seed=3)


def test_tiled_swiglu_and_leading_dims() -> None:
    g = torch.Generator().manual_seed(4)
    w = quantize(torch.randn(64, 128, generator=g), "int8-g64")
    x = torch.randn(2, 9, 128, generator=g).to(torch.float16)
    got = quant_matmul_triton(x, w, swiglu=True, config=GemmConfig(32, 16, 64, 1, 4, 1))
    assert got.shape == (2, 9, 32)
    ref = quant_matmul_reference(x, w, swiglu=True).float()
    assert (got.float() - ref).norm() / ref.norm() < TOL[torch.float16]


def test_default_config_and_cpu_dispatch() -> None:
    g = torch.Generator().manual_seed(5)
    w = quantize(torch.randn(24, 64, generator=g), "int4-g64")
    x = torch.randn(2, 64, generator=g)
    ref = quant_matmul_reference(x, w)
    assert torch.equal(quant_matmul(x, w), ref)  # CPU tensors take the reference
    got = quant_matmul_triton(x, w)  # first candidate under the interpreter
    assert (got - ref).norm() / ref.norm() < TOL[torch.float32]


def test_candidates_are_valid_for_every_format() -> None:
    for fmt in FORMATS:
        for m in (1, 16, 17, 64, 4096):
            cands = candidates(fmt, m, 5120, 17408, 132)
            assert cands and all(kernel_params(fmt, c) for c in cands)
            assert any(c.split_k > 1 for c in candidates(fmt, m, 1024, 5120, 132)) or m > 16


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8-b128"])
def test_expert_slice_views(fmt: str) -> None:
    from ninfer.quant.linear import QuantWeight

    g = torch.Generator().manual_seed(6)
    experts = QuantWeight.from_float(torch.randn(3, 256, 128, generator=g), fmt)
    x = torch.randn(4, 128, generator=g)
    for e in (0, 2):
        w = experts.select(e)
        got = quant_matmul_triton(x, w, config=GemmConfig(16, 64, 128, 1, 4, 1))
        ref = quant_matmul_reference(x, w)
        assert (got - ref).norm() / ref.norm() < TOL[torch.float32]


def test_tuner_times_decode_from_graphs_and_falls_back_to_eager_for_all(monkeypatch: pytest.MonkeyPatch) -> None:
    from ninfer.kernels.quant_gemm import timing as quant_gemm_timing
    from ninfer.kernels.quant_gemm import tune as quant_gemm_tune

    cands = [GemmConfig(16, 64, 256), GemmConfig(16, 32, 256), GemmConfig(1, 32, 512, 4, 4, 1, "gemv")]
    calls: list[tuple[str, GemmConfig]] = []

    def graph_ms(fn, cold: bool | None = None) -> float:
        assert cold is None  # the dense tuner: NINFER_TUNE_L2_COLD decides in graph_ms (warm by default)
        fn()
        if calls[-1][1].kind == "gemv":
            raise RuntimeError("capture failed")
        return 1.0

    def eager_ms(fn, warmup: int, rep: int) -> float:
        fn()
        return 2.0 if calls[-1][1].kind == "gemv" else 3.0

    monkeypatch.setattr(quant_gemm_timing, "graph_ms", graph_ms)
    monkeypatch.setattr(quant_gemm_tune.triton.testing, "do_bench", eager_ms)
    monkeypatch.setattr(quant_gemm_tune.torch.cuda, "synchronize", lambda: None)
    timings = quant_gemm_tune.time_candidates(cands, lambda cfg: calls.append(("run", cfg)), graphs=True)
    # one failed capture: every candidate is timed the same (eager) way, so the comparison stays fair
    assert timings == {cands[0]: 3.0, cands[1]: 3.0, cands[2]: 2.0}
    assert quant_gemm_tune.time_candidates(cands[:2], lambda cfg: calls.append(("run", cfg)), graphs=True) == {
        cands[0]: 1.0, cands[1]: 1.0}
