"""The RMSNorm prologue of the decode GEMVs (``gemv``, ``gemv-prefetch``, ``gemv-w32``) and of the tensor-core
int4 decode (``gemv-mma``) in the Triton interpreter: ``quant_matmul_triton(x, w, norm=(weight, eps))``
against the norm kernel followed by the same GEMM config, and against the reference.

fp32 and fp16 activations (the interpreter's bf16 arithmetic is wrong), M = 1..8, split-K 1 and > 1 (the
fused and the separate reduction), SwiGLU and residual epilogues, ragged N and K. Outputs and scratch are
NaN-poisoned. Rows of +-2^j make every rstd exact whatever the summation order, so there the fused result
must equal norm-then-GEMM to the bit; random rows differ by that order only.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import QUANT_TOL as TOL
from kernel_testing import poisoned_outputs  # noqa: F401  (fixture)

from ninfer.kernels.norms import rms_norm_reference, rms_norm_triton
from ninfer.kernels.quant_gemm import quant_matmul, quant_matmul_reference, quant_matmul_triton
from ninfer.kernels import tune_cache, tuning
from ninfer.kernels.quant_gemm import tune as quant_gemm_tune
from ninfer.kernels.quant_gemm.tune import NORM_FIRST, GemmConfig, m_bucket, norm_candidates, norm_fusable
from ninfer.kernels.tuning import TunerState, use_tuner
from ninfer.quant.formats import quantize

pytestmark = pytest.mark.usefixtures("poisoned_outputs")
EPS = 1e-6


def _inputs(fmt: str, dtype: torch.dtype, m: int, n: int, k: int, *, swiglu: bool, residual: bool, exact: bool,
            seed: int, norm_dtype: torch.dtype | None = None) -> tuple:
    g = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(n, k, generator=g) * 0.05, fmt)
    if exact:  # +-2^j per row: sums of squares exact in any order
        signs = torch.randint(0, 2, (m, k), generator=g) * 2.0 - 1.0
        x = signs * 2.0 ** (torch.arange(m, dtype=torch.float32) % 8 - 2)[:, None]
    else:
        x = torch.randn(m, k, generator=g) * 3.0
    norm_w = (torch.randn(k, generator=g) * 0.3).to(norm_dtype or dtype)
    n_out = n // 2 if swiglu else n
    res = torch.randn(m, n_out, generator=g).to(dtype) if residual else None
    return w, x.to(dtype), norm_w, res


def _check(fmt: str, dtype: torch.dtype, m: int, n: int, k: int, cfg: GemmConfig, *, swiglu: bool = False,
           residual: bool = False, exact: bool = False, seed: int = 0, norm_dtype: torch.dtype | None = None) -> None:
    w, x, norm_w, res = _inputs(fmt, dtype, m, n, k, swiglu=swiglu, residual=residual, exact=exact, seed=seed,
                                norm_dtype=norm_dtype)
    n_out = n // 2 if swiglu else n
    out = torch.full((m, n_out), float("nan"), dtype=dtype)
    got = quant_matmul_triton(x, w, res, swiglu, out=out, config=cfg, norm=(norm_w, EPS))
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(got).all(), f"{fmt} {cfg}: unwritten or non-finite outputs"
    unfused = quant_matmul_triton(rms_norm_triton(x, norm_w, EPS)[0], w, res, swiglu, config=cfg)
    if exact:
        assert torch.equal(got, unfused), f"{fmt} {dtype} m={m} {cfg}: fused != norm-then-GEMM"
    else:  # the rstd's fp32 sum order differs: an fp16 normed value may round the other way
        err = (got.float() - unfused.float()).norm() / unfused.float().norm()
        assert err < (5e-6 if dtype == torch.float32 else 1e-3), f"{fmt} {dtype} m={m} {cfg}: {err:.2e} vs unfused"
    ref = quant_matmul_reference(x, w, res, swiglu, norm=(norm_w, EPS)).float()
    err = (got.float() - ref).norm() / ref.norm()
    assert err < TOL[dtype], f"{fmt} {dtype} m={m} n={n} k={k} {cfg}: relative error {err:.2e} vs the reference"


def _gemv(kind: str, m: int, block_n: int, block_k: int, split: int) -> GemmConfig:
    return GemmConfig(m_bucket(m), block_n, block_k, split, 4, 1, kind)


def _mma(block_n: int, block_k: int, split: int, tokens: int = 8) -> GemmConfig:
    return GemmConfig(tokens, block_n, block_k, split, 2, 2, "gemv-mma")


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_prologue(m: int, dtype: torch.dtype) -> None:
    """The byte GEMV, unsplit (ragged K: a partial last step) and split with a residual."""
    _check("int4-g64", dtype, m, 48, 576, _gemv("gemv", m, 16, 128, 1), seed=m)
    _check("int4-g64", dtype, m, 40, 512, _gemv("gemv", m, 16, 128, 3), residual=True, seed=m + 10)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_prologue_is_norm_then_gemm_to_the_bit(m: int) -> None:
    for dtype in (torch.float32, torch.float16):
        _check("int4-g64", dtype, m, 48, 576, _gemv("gemv", m, 16, 128, 1), exact=True, seed=m)
        _check("int4-g64", dtype, m, 48, 512, _gemv("gemv", m, 16, 128, 2), swiglu=True, residual=True, exact=True,
               seed=m + 1)
        if dtype == torch.float16:  # the tensor-core decode takes 16-bit activations
            _check("int4-g64", dtype, m, 64, 512, _mma(32, 128, 2), residual=True, exact=True, seed=m + 2)


@pytest.mark.parametrize("fmt", ["int8-g64", "fp8", "nvfp4", "int4-g128"])
def test_gemv_prologue_formats(fmt: str) -> None:
    k = 640 if fmt != "int4-g128" else 768
    _check(fmt, torch.float32, 3, 48, k, _gemv("gemv", 3, 16, 128 if fmt != "int4-g128" else 256, 2),
           residual=True, seed=5)


def test_norm_weight_in_another_dtype() -> None:
    """An fp32 norm weight with fp16 activations (the tensor-core path reads a weight of x's dtype as column
    pairs, any other column by column)."""
    _check("int4-g64", torch.float16, 5, 64, 512, _mma(32, 128, 2), exact=True, seed=34, norm_dtype=torch.float32)
    _check("int4-g64", torch.float16, 5, 64, 512, _gemv("gemv", 5, 16, 128, 2), exact=True, seed=35,
           norm_dtype=torch.float32)


@pytest.mark.parametrize("kind", ["gemv-prefetch", "gemv-w32"])
@pytest.mark.parametrize("m", [1, 5])
def test_gemv_variants_prologue(kind: str, m: int) -> None:
    _check("int4-g64", torch.float32, m, 48, 512, _gemv(kind, m, 32, 128, 1), seed=m)
    _check("int4-g64", torch.float16, m, 96, 768, _gemv(kind, m, 16, 128, 3), swiglu=True, residual=True,
           seed=m + 1)


@pytest.mark.parametrize("m", range(1, 9))
def test_mma_prologue(m: int) -> None:
    """The tensor-core decode (fp16: it takes 16-bit activations), unsplit and split, SwiGLU."""
    _check("int4-g64", torch.float16, m, 48, 512, _mma(32, 256, 1), seed=m)
    _check("int4-g64", torch.float16, m, 128, 512, _mma(32, 128, 3), swiglu=True, residual=True, seed=m + 20)


def test_mma_prologue_more_tokens_than_a_program() -> None:
    _check("int4-g128", torch.float16, 11, 64, 256, _mma(32, 128, 1), residual=True, seed=30)
    _check("int4-g64", torch.float16, 16, 64, 256, _mma(32, 64, 2, tokens=16), swiglu=True, seed=31)


def test_mma_prologue_separate_reduce_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from ninfer.kernels.quant_gemm import gemv as quant_gemv

    monkeypatch.setattr(quant_gemv, "_COUNTER_SLOTS", 1)
    _check("int4-g64", torch.float16, 3, 96, 512, _mma(32, 128, 4), swiglu=True, residual=True, seed=32)
    _check("int4-g64", torch.float32, 3, 96, 512, _gemv("gemv", 3, 32, 128, 4), residual=True, seed=33)


@pytest.mark.parametrize("exact", [True, False])
def test_normed_x_written_for_another_reader(exact: bool) -> None:
    """``norm_out`` receives the normed x from the fused kernels (the first column of programs, every split
    and token tile: NaN-poisoned, so a missed element shows) and from the unfused path (M > 32)."""
    cases = [(_gemv("gemv", 3, 16, 128, 3), 3, 576, torch.float32), (_gemv("gemv-w32", 5, 16, 128, 2), 5, 512,
             torch.float16), (_gemv("gemv-prefetch", 1, 16, 128, 1), 1, 576, torch.float32),
             (_mma(32, 128, 2), 11, 512, torch.float16), (None, 40, 512, torch.float16)]
    for cfg, m, k, dtype in cases:
        w, x, norm_w, res = _inputs("int4-g64", dtype, m, 48, k, swiglu=False, residual=True, exact=exact, seed=m)
        normed = torch.full((m, k), float("nan"), dtype=dtype)
        got = quant_matmul_triton(x, w, res, config=cfg, norm=(norm_w, EPS), norm_out=normed)
        expect = rms_norm_triton(x, norm_w, EPS)[0]
        if exact or cfg is None:
            assert torch.equal(normed, expect), cfg
        else:  # the rstd's sum order: a value may round the other way
            assert torch.isfinite(normed).all() and torch.allclose(normed.float(), expect.float(), rtol=2e-3, atol=0), cfg
        ref = quant_matmul_reference(x, w, res, norm=(norm_w, EPS)).float()
        assert (got.float() - ref).norm() / ref.norm() < TOL[dtype], cfg
    cpu = torch.empty_like(x)
    quant_matmul(x, w, res, norm=(norm_w, EPS), norm_out=cpu)  # CPU tensors: the reference writes it too
    assert torch.equal(cpu, rms_norm_reference(x, norm_w, EPS)[0])


def test_dispatch_fuses_at_decode_sizes_only() -> None:
    """Without a config: decode sizes take a prologue candidate, larger M (and fp32 beyond 8 tokens) the
    norm kernel then the GEMM; a config without the prologue is refused; CPU tensors take the reference."""
    assert norm_candidates("int4-g64", 8, 5120, 5120, 132, torch.bfloat16) and \
        all(c.kind in ("gemv", "gemv-prefetch", "gemv-w32", "gemv-mma") for c in
            norm_candidates("int4-g64", 8, 5120, 5120, 132, torch.bfloat16))
    assert {c.kind for c in norm_candidates("int4-g64", 16, 17408, 5120, 132, torch.bfloat16)} == {"gemv-mma"}
    assert norm_candidates("int8-g64", 16, 5120, 5120, 132, torch.bfloat16) == []
    assert norm_candidates("int4-g64", 33, 5120, 5120, 132, torch.bfloat16) == []
    for m, fused in ((4, True), (12, True), (40, False)):
        w, x, norm_w, res = _inputs("int4-g64", torch.float16, m, 64, 256, swiglu=False, residual=True, exact=False,
                                    seed=m)
        assert norm_fusable("int4-g64", x, 64, 256, False) == fused
        got = quant_matmul_triton(x, w, res, norm=(norm_w, EPS))
        ref = quant_matmul_reference(x, w, res, norm=(norm_w, EPS)).float()
        assert (got.float() - ref).norm() / ref.norm() < TOL[torch.float16]
    assert not norm_fusable("int4-g64", x[:12].float(), 64, 256, False)
    with pytest.raises(ValueError, match="RMSNorm prologue"):
        from ninfer.kernels.quant_gemm.dispatch import _launch

        _launch(x[:2], w, None, torch.empty(2, 64, dtype=x.dtype), False, GemmConfig(16, 64, 128), (norm_w, EPS))
    cpu = quant_matmul(x, w, res, norm=(norm_w, EPS))  # CPU tensors: the reference
    assert torch.equal(cpu, quant_matmul_reference(x, w, res, norm=(norm_w, EPS)))


@pytest.mark.parametrize("norm_first_wins", [True, False])
def test_the_tuner_times_the_prologue_against_norm_then_gemm(monkeypatch: pytest.MonkeyPatch,
                                                              norm_first_wins: bool) -> None:
    """A norm key's candidates end with NORM_FIRST (the norm kernel, then the GEMM with its own key's choice):
    every candidate's trial runs (writing the scratch, not the residual it may alias) and the faster is kept;
    NORM_FIRST gives the same result as the unfused call and still fills norm_out."""
    timed: list[list[GemmConfig]] = []

    def fake_timings(cands: list, launch: object, graphs: bool) -> dict:
        timed.append(list(cands))
        for c in cands:
            launch(c)
        fast = NORM_FIRST if norm_first_wins else cands[0]
        return {c: 1.0 if c == fast else 2.0 for c in cands}

    monkeypatch.setattr(quant_gemm_tune, "autotune_configs", lambda cfgs: cfgs[:3] + cfgs[-1:])
    monkeypatch.setattr(quant_gemm_tune, "time_candidates", fake_timings)
    monkeypatch.setattr(tuning, "stored_config", lambda *args: None)
    monkeypatch.setattr(tune_cache, "record", lambda *args: None)
    w, x, norm_w, res = _inputs("int4-g64", torch.float32, 2, 48, 256, swiglu=False, residual=True, exact=True,
                                seed=40)
    res_before = res.clone()
    with use_tuner(TunerState()) as tuner:
        monkeypatch.setattr(tuner, "tunable", lambda device: True)
        normed = torch.full_like(x, float("nan"))
        got = quant_matmul_triton(x, w, res, out=res, norm=(norm_w, EPS), norm_out=normed)  # in place
        chosen = {key: cfg for key, cfg in tuner.chosen("quant_gemm").items() if "rms_norm" in key}
    assert timed[0][-1] == NORM_FIRST and list(chosen.values()) == [NORM_FIRST if norm_first_wins else timed[0][0]]
    assert len(timed) == 2  # NORM_FIRST's trial tuned the plain key too
    expect = quant_matmul_triton(rms_norm_triton(x, norm_w, EPS)[0], w, res_before, config=GemmConfig(16, 64, 128))
    assert got.data_ptr() == res.data_ptr()
    assert (got - expect).abs().max() < 1e-5 and torch.equal(normed, rms_norm_triton(x, norm_w, EPS)[0])
