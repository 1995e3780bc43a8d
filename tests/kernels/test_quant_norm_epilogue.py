"""The RMSNorm after a decode GEMM in the GEMM's own launch (``quant_gemm.quant_matmul_then_norm``, the register
decode's NORM epilogue), in the interpreter: the new residual stream bit-equal to the unfused GEMM's output plus the
residual as the reference norm rounds it, the normed output within fp32 / fp16 rounding of the reference norm, for
splits with the fused reduction, pairs of tiles, several token blocks and ragged programs; the arrival counter left
at zero; the unfused path where the fusion does not apply."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import fragment_laid, poisoned_outputs  # noqa: F401  (fixture)
from kernel_testing import frag_config as _frag

import ninfer.kernels.quant_gemm.dispatch as quant_dispatch
from ninfer.kernels.counters import arrival_counters
from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.norms import rms_norm_reference
from ninfer.kernels.quant_gemm import quant_matmul_reference, quant_matmul_triton
from ninfer.kernels.quant_gemm.dispatch import quant_matmul_then_norm
from ninfer.kernels.quant_gemm.tune import GemmConfig
from ninfer.quant.formats import quantize

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_NORM_IN_GEMM", "1")
    monkeypatch.setattr(quant_dispatch, "use_triton", lambda x: True)
    monkeypatch.setattr(quant_dispatch, "MAX_ROWS", 16)  # the kernel at every decode size, not just the default

def _case(fmt: str, m: int, n: int, k: int, dtype: torch.dtype, residual: bool, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(n, k, generator=g) * 0.05, fmt)
    x = torch.randn(m, k, generator=g).to(dtype)
    res = (torch.randn(m, n, generator=g) * 3).to(dtype) if residual else None
    norm_w = (torch.randn(n, generator=g) * 0.3).to(dtype)
    return w, x, res, norm_w


def _check(fmt: str, m: int, n: int, k: int, cfg: GemmConfig, *, residual: bool = True,
           dtype: torch.dtype = torch.float16, seed: int = 0) -> None:
    w, x, res, norm_w = _case(fmt, m, n, k, dtype, residual, seed)
    laid = fragment_laid(w)
    y = quant_matmul_triton(x, laid, config=cfg)  # the unfused layer: the GEMM, then the norm
    ref, ref_res = rms_norm_reference(y, norm_w, 1e-6, res)
    normed, new_res = quant_matmul_then_norm(x, laid, norm_w, 1e-6, res, config=cfg)
    assert torch.equal(new_res, ref_res), f"{fmt} {cfg}: the new residual stream differs from the unfused path's"
    assert normed.dtype == dtype and torch.isfinite(normed).all(), f"{fmt} {cfg}: unwritten normed outputs"
    torch.testing.assert_close(normed, ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert not arrival_counters(x.device).any(), "the launch left an arrival counter set"
    want = rms_norm_reference(quant_matmul_reference(x, w), norm_w, 1e-6, res)[0].float()  # and the oracle
    assert (normed.float() - want).norm() / want.norm() < 2e-2


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "int8-g64"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_gemm_applies_the_norm(fmt: str, dtype: torch.dtype) -> None:
    _check(fmt, 1, 48, 256, _frag(8, 2, 2, 1), dtype=dtype, seed=1)  # a ragged last program (3 tiles, 2 a program)
    _check(fmt, 5, 32, 512, _frag(8, 1, 2, 3), dtype=dtype, seed=2)  # splits of unequal length, fused reduction
    _check(fmt, 3, 64, 256, _frag(8, 1, 2, 1), residual=False, dtype=dtype, seed=3)


@pytest.mark.usefixtures("fused")
def test_pairs_of_tiles_token_blocks_and_prefetch() -> None:
    _check("int4-g64", 3, 96, 256, _frag(8, 2, 2, 1, kind="frag-pair"), seed=4)
    _check("int4-g128", 5, 64, 512, _frag(8, 1, 2, 3, 2, kind="frag-pair"), seed=5)
    _check("int4-g64", 11, 32, 256, _frag(8, 1, 2, 2), seed=6)  # two programs along the tokens, split
    _check("int8-g64", 16, 32, 256, _frag(16, 1, 1, 1, 2), seed=7)
    _check("int4-g64", 4, 2048, 128, _frag(8, 4, 2, 1), seed=8)  # rows wider than one step of the norm's passes


@pytest.mark.usefixtures("fused")
def test_the_norm_runs_on_its_own_where_the_gemm_cannot_apply_it() -> None:
    """More tokens than MAX_ROWS (as the fixture sets it), and a row-major weight (not read by the register decode):
    the GEMM, then the norm kernel, bit for bit."""
    w, x, res, norm_w = _case("int4-g64", 20, 32, 256, torch.float32, True, seed=9)
    for weight, cfg, rows in ((fragment_laid(w), _frag(32, 1, 2, 1), 20), (w, GemmConfig(16, 32, 128, 1, 2, 1), 2)):
        got = quant_matmul_then_norm(x[:rows], weight, norm_w, 1e-6, res[:rows], config=cfg)
        want = rms_norm_reference(quant_matmul_triton(x[:rows], weight, config=cfg), norm_w, 1e-6, res[:rows])
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_off_by_default_and_off_cuda() -> None:
    w, x, res, norm_w = _case("int8-g64", 2, 32, 128, torch.float32, True, seed=10)
    got = quant_matmul_then_norm(x, fragment_laid(w), norm_w, 1e-6, res)
    want = rms_norm_reference(quant_matmul_reference(x, w), norm_w, 1e-6, res)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_default_bound_on_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to MAX_ROWS tokens (2 by default) the GEMM applies the norm; from one more the norm is its own launch."""
    monkeypatch.setenv("NINFER_NORM_IN_GEMM", "1")
    monkeypatch.setattr(quant_dispatch, "use_triton", lambda x: True)
    launches = []
    launch = quant_dispatch.launch_fragment_mma
    monkeypatch.setattr(quant_dispatch, "launch_fragment_mma",
                        lambda *a, **k: launches.append(k.get("norm") is not None) or launch(*a, **k))
    w, x, res, norm_w = _case("int4-g64", 3, 32, 256, torch.float16, True, seed=11)
    for rows in (1, 2, 3):
        quant_matmul_then_norm(x[:rows], fragment_laid(w), norm_w, 1e-6, res[:rows], config=_frag(8, 1, 2, 1))
    assert launches == [True, True, False]


@pytest.mark.usefixtures("fused")
def test_warps_splitting_k() -> None:
    """``frag-ksplit``: one tile a program, warps 1.. masked at the stores; the last program normalizes."""
    _check("int4-g64", 1, 48, 512, _frag(8, 2, 2, 1, 2, kind="frag-ksplit"), seed=9)
    _check("int8-g64", 5, 32, 512, _frag(8, 2, 2, 2, 3, kind="frag-ksplit"), seed=10)

