"""The norm after a decode GEMM left to the GEMMs that read its rows (``quant_gemm.deferred_norm``), in the interpreter.

Producer (``quant_matmul_then_norm(..., defer=True)`` with ``NINFER_DEFERRED_NORM=1``): the new residual stream
bit-equal to the unfused GEMM's output plus the residual as the reference norm rounds it, the scaled rows bit-equal to
``deferred_norm_reference``'s, the row sums within fp32 rounding; every split-K sum, pairs of tiles, several token
blocks, ragged programs. Consumer (the register decode with ``row_norm``): within fp32 / fp16 rounding of the same GEMM
on the materialized rows, SwiGLU and residual epilogues included, and of the oracle; other configs read the
materialized rows bit for bit. Off by default.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import fragment_laid, poisoned_outputs  # noqa: F401  (fixture)
from kernel_testing import frag_config as _frag

import ninfer.kernels.quant_gemm.dispatch as quant_dispatch
from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.norms import NormedRows, deferred_norm_reference, rms_norm_reference
from ninfer.kernels.quant_gemm import quant_matmul, quant_matmul_reference, quant_matmul_triton
from ninfer.kernels.quant_gemm.dispatch import quant_matmul_then_norm
from ninfer.kernels.quant_gemm.fragment_mma import fragment_tile_groups
from ninfer.kernels.quant_gemm.tune import GemmConfig
from ninfer.quant.formats import quantize

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
EPS = 1e-6


@pytest.fixture
def deferred(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_DEFERRED_NORM", "1")
    monkeypatch.setattr(quant_dispatch, "use_triton", lambda x: True)


def _weights(fmt: str, n: int, k: int, g: torch.Generator):
    return quantize(torch.randn(n, k, generator=g) * 0.05, fmt)


def _produce(fmt: str, m: int, n: int, k: int, cfg: GemmConfig, *, residual: bool = True,
             dtype: torch.dtype = torch.float16, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    w = _weights(fmt, n, k, g)
    x = torch.randn(m, k, generator=g).to(dtype)
    res = (torch.randn(m, n, generator=g) * 3).to(dtype) if residual else None
    norm_w = (torch.randn(n, generator=g) * 0.3).to(dtype)
    laid = fragment_laid(w)
    y = quant_matmul_triton(x, laid, config=cfg)  # the unfused layer: the GEMM, then the norm
    parts = fragment_tile_groups(n, cfg)
    want, want_res = deferred_norm_reference(y, norm_w, EPS, res, parts)
    normed, new_res = quant_matmul_then_norm(x, laid, norm_w, EPS, res, config=cfg, defer=True)
    assert isinstance(normed, NormedRows) and normed.eps == EPS
    assert torch.equal(new_res, want_res), f"{fmt} {cfg}: the new residual stream differs from the unfused path's"
    assert torch.equal(normed.scaled, want.scaled), f"{fmt} {cfg}: scaled rows"
    assert normed.stats.shape == (parts, m)
    torch.testing.assert_close(normed.stats, _part_sums(want_res, cfg), atol=1e-3, rtol=1e-5)
    ref = rms_norm_reference(y, norm_w, EPS, res)[0]
    torch.testing.assert_close(normed.materialize(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.usefixtures("deferred")
@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "int8-g64"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_producer_writes_the_deferred_norm(fmt: str, dtype: torch.dtype) -> None:
    _produce(fmt, 1, 48, 256, _frag(8, 2, 2, 1), dtype=dtype, seed=1)  # a ragged last program (3 tiles, 2 a program)
    _produce(fmt, 5, 32, 512, _frag(8, 1, 2, 3), dtype=dtype, seed=2)  # splits of unequal length, fused reduction
    _produce(fmt, 3, 64, 256, _frag(8, 1, 2, 1), residual=False, dtype=dtype, seed=3)


@pytest.mark.usefixtures("deferred")
def test_warps_splitting_k_produce_and_consume() -> None:
    """``frag-ksplit`` (one tile a program: as many row-sum parts as tiles), unsplit and with the fused sum."""
    _produce("int4-g64", 2, 48, 512, _frag(8, 2, 2, 1, 2, kind="frag-ksplit"), seed=16)
    _produce("int8-g64", 5, 32, 512, _frag(8, 2, 2, 2, 3, kind="frag-ksplit"), seed=17)
    _consume("int4-g128", 3, 32, 512, _frag(8, 2, 2, 2, kind="frag-ksplit"), parts=5, seed=18)
    _consume("int4-g64", 6, 64, 512, _frag(8, 4, 2, 1, 3, kind="frag-ksplit"), swiglu=True, parts=3, seed=19)


@pytest.mark.usefixtures("deferred")
@pytest.mark.parametrize("mode", ["each", "across", "tile"])
def test_the_producer_under_every_split_sum(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_SPLIT_SUM", mode)
    _produce("int4-g64", 3, 96, 256, _frag(8, 2, 2, 2, kind="frag-pair"), seed=4)
    _produce("int4-g128", 11, 32, 512, _frag(8, 1, 2, 3), seed=5)  # two token blocks, splits
    _produce("int8-g64", 16, 64, 256, _frag(16, 2, 1, 2), seed=6)


def _part_sums(h: torch.Tensor, cfg: GemmConfig) -> torch.Tensor:
    """The producer's shares of each row's sum of squares: program p of the register decode finishes columns
    ``16 warps`` wide from column ``16 warps p`` (a pair: the same in each half of the output)."""
    n = h.shape[1]
    half = n // 2 if cfg.kind == "frag-pair" else n
    group = 16 if cfg.kind == "frag-ksplit" else 16 * cfg.num_warps
    col = torch.arange(n) % half
    sq = h.float().pow(2)
    return torch.stack([sq[:, col // group == p].sum(1) for p in range(fragment_tile_groups(n, cfg))])


def _consume(fmt: str, m: int, n: int, k: int, cfg: GemmConfig, *, swiglu: bool = False, residual: bool = False,
             dtype: torch.dtype = torch.float16, parts: int = 5, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    w = _weights(fmt, 2 * n if swiglu else n, k, g)
    h = (torch.randn(m, k, generator=g) * 4).to(dtype)
    norm_w = (torch.randn(k, generator=g) * 0.3).to(dtype)
    res = (torch.randn(m, n, generator=g)).to(dtype) if residual else None
    normed, _ = deferred_norm_reference(h, norm_w, EPS, None, parts)
    laid = fragment_laid(w)
    got = quant_matmul_triton(normed.scaled, laid, res, swiglu, config=cfg, row_norm=normed)
    want = quant_matmul_triton(normed.materialize(), laid, res, swiglu, config=cfg)
    assert got.dtype == dtype and torch.isfinite(got).all(), f"{fmt} {cfg}: unwritten outputs"
    torch.testing.assert_close(got, want, atol=TOL[dtype] * 3, rtol=TOL[dtype] * 3)
    oracle = quant_matmul_reference(rms_norm_reference(h, norm_w, EPS)[0], w, res, swiglu).float()
    assert (got.float() - oracle).norm() / oracle.norm() < 2e-2


@pytest.mark.parametrize("fmt", ["int4-g64", "int8-g64"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_consumer_normalizes_its_rows(fmt: str, dtype: torch.dtype) -> None:
    _consume(fmt, 1, 32, 256, _frag(8, 1, 2, 1), dtype=dtype, seed=7)
    _consume(fmt, 6, 48, 512, _frag(8, 2, 2, 3), swiglu=True, dtype=dtype, seed=8)  # SwiGLU after the factor, splits
    _consume(fmt, 3, 64, 256, _frag(8, 2, 2, 2, kind="frag-pair"), residual=True, dtype=dtype, parts=3, seed=9)


def test_the_consumer_over_token_blocks_and_many_parts() -> None:
    _consume("int4-g64", 11, 32, 256, _frag(8, 1, 2, 2), parts=128, seed=10)  # two programs along the tokens
    _consume("int4-g128", 16, 32, 512, _frag(16, 1, 2, 1), parts=320, seed=11)  # more parts than one load step


@pytest.mark.parametrize("mode", ["each", "across", "tile"])
def test_the_consumer_under_every_split_sum(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the fused split-K sum the split that sums applies the rows' factors, after the sum: in each of its three
    ways, over two token blocks and with SwiGLU after the factor."""
    monkeypatch.setenv("NINFER_SPLIT_SUM", mode)
    _consume("int4-g64", 11, 32, 256, _frag(8, 1, 1, 3), parts=7, seed=13)
    _consume("int8-g64", 5, 48, 512, _frag(8, 2, 2, 2), swiglu=True, residual=True, parts=130, seed=14)
    _consume("int4-g64", 3, 64, 256, _frag(8, 2, 1, 2, kind="frag-pair"), parts=3, seed=15)


def test_other_configs_read_the_materialized_rows() -> None:
    g = torch.Generator().manual_seed(12)
    w = _weights("int4-g64", 32, 256, g)
    normed, _ = deferred_norm_reference(torch.randn(3, 256, generator=g), torch.randn(256, generator=g) * 0.3, EPS,
                                        None, 4)
    row_major = GemmConfig(16, 32, 128, 1, 2, 1)
    got = quant_matmul_triton(normed.scaled, w, config=row_major, row_norm=normed)
    assert torch.equal(got, quant_matmul_triton(normed.materialize(), w, config=row_major))
    assert torch.equal(quant_matmul(normed, w), quant_matmul_reference(normed.materialize(), w))  # the CPU path


@pytest.mark.parametrize("setting", [None, "0"])
def test_on_by_default_and_off_by_the_switch(monkeypatch: pytest.MonkeyPatch, setting: str | None) -> None:
    """Unset, a producer whose readers take deferred rows defers; ``NINFER_DEFERRED_NORM=0`` applies the norm."""
    monkeypatch.setattr(quant_dispatch, "use_triton", lambda x: True)
    if setting is None:
        monkeypatch.delenv("NINFER_DEFERRED_NORM", raising=False)
    else:
        monkeypatch.setenv("NINFER_DEFERRED_NORM", setting)
    g = torch.Generator().manual_seed(13)
    w = fragment_laid(_weights("int4-g64", 32, 256, g))
    x, res, norm_w = torch.randn(2, 256, generator=g), torch.randn(2, 32, generator=g), torch.randn(32, generator=g)
    normed, new_res = quant_matmul_then_norm(x, w, norm_w, EPS, res, config=_frag(8, 1, 2, 1), defer=True)
    if setting is None:
        assert isinstance(normed, NormedRows)
        want = rms_norm_reference(quant_matmul_triton(x, w, config=_frag(8, 1, 2, 1)), norm_w, EPS, res)
        torch.testing.assert_close(normed.materialize(), want[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(new_res, want[1])
        return
    assert isinstance(normed, torch.Tensor)
    want = rms_norm_reference(quant_matmul_triton(x, w, config=_frag(8, 1, 2, 1)), norm_w, EPS, res)
    assert torch.equal(normed, want[0]) and torch.equal(new_res, want[1])
