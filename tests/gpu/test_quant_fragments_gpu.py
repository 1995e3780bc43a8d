"""The register decode of fragment-laid int4, int8 and nvfp4 weights on the GPU (its PTX: loads, bit decode, mma.sync) at
the 27B shapes, against the fp32 dequantize-then-matmul reference of the row-major weight: fresh random inputs,
NaN-poisoned outputs, every candidate config at 1..32 tokens, bf16 and fp16, plain / residual / SwiGLU, in and
out of a CUDA graph; the prefill sizes' paths (the decode at 33+ tokens, the dequantization, the tiled GEMM of
``fragment_tiled``), and a model's projections re-laid by ``use_kernel_layouts_``."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import fragment_laid, graph_replay_matches

from ninfer.kernels.quant_gemm import QuantizedTensor, quant_matmul_reference, quant_matmul_triton
from ninfer.kernels.quant_gemm.dequant import dequantize_triton
from ninfer.kernels.quant_gemm.fragments import FRAGMENTS
from ninfer.kernels.quant_gemm.tune import (
    candidates,
    fragment_candidates,
    graph_candidates,
    sm_count,
    tiled_fragment_candidates,
)
from ninfer.kernels.tuning import TunerState, use_tuner
from ninfer.quant.formats import quantize
from ninfer.quant.linear import QuantLinear, use_kernel_layouts_

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
BF16_TOL = 1.5e-2  # relative Frobenius error of a bf16 output (as tests/gpu/test_quant_gemm.py)
CASES = [("o_proj", 5120, 6144, False, False), ("down", 5120, 17408, False, True),
         ("gate_up", 2 * 17408, 5120, True, False), ("qkvz", 16384, 5120, False, False)]


def _pair(n: int, k: int, fmt: str, seed: int) -> tuple[QuantizedTensor, QuantizedTensor]:
    """A random weight quantized row-major, and the same in the fragment layout."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = quantize(torch.randn(n, k, generator=g, device="cuda") * 0.02, fmt)
    return w, fragment_laid(w)


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_candidate_at_real_shapes(fmt: str, dtype: torch.dtype) -> None:
    """bf16: every candidate at 1 and 29 tokens (8- and 32-token programs), the favourite at the other counts;
    fp16 (its own decode constants): the favourite."""
    sms = sm_count(CUDA)
    for name, n, k, swiglu, residual in CASES:
        rows, frag = _pair(n, k, fmt, 1)
        n_out = n // 2 if swiglu else n
        for m in (1, 3, 8, 13, 29, 32):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            res = torch.randn(m, n_out, device="cuda", dtype=dtype) if residual else None
            ref = quant_matmul_reference(x.float(), rows, None if res is None else res.float(), swiglu)
            cands = fragment_candidates(fmt, m, n_out, k, sms, swiglu=swiglu)
            if dtype == torch.float16 or m not in (1, 29):
                cands = cands[:1]
            for cfg in cands:
                out = torch.full((m, n_out), float("nan"), device="cuda", dtype=dtype)
                got = quant_matmul_triton(x, frag, res, swiglu, out=out, config=cfg)
                assert torch.isfinite(got).all(), (fmt, name, m, cfg)
                assert _err(got, ref) < BF16_TOL, (fmt, name, m, cfg, _err(got, ref))


INT8_CASES = [("lm_head", 248320, 5120, False, False), ("o_proj", 5120, 6144, False, True),
              ("qkv", 10240, 5120, False, False), ("shared_gate_up", 1024, 2048, True, False)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_every_candidate(dtype: torch.dtype) -> None:
    """int8-g64 (the LM head of every recipe; attention, DeltaNet and shared-expert projections of the model
    recipes): every candidate at 1 and 8 tokens, the favourite at every token count."""
    sms = sm_count(CUDA)
    for name, n, k, swiglu, residual in INT8_CASES:
        rows, frag = _pair(n, k, "int8-g64", 6)
        n_out = n // 2 if swiglu else n
        for m in (1, 3, 8, 13, 29, 32):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            res = torch.randn(m, n_out, device="cuda", dtype=dtype) if residual else None
            ref = quant_matmul_reference(x.float(), rows, None if res is None else res.float(), swiglu)
            cands = fragment_candidates("int8-g64", m, n_out, k, sms, swiglu=swiglu)
            for cfg in cands if m in (1, 8) and dtype == torch.bfloat16 else cands[:1]:
                out = torch.full((m, n_out), float("nan"), device="cuda", dtype=dtype)
                got = quant_matmul_triton(x, frag, res, swiglu, out=out, config=cfg)
                assert torch.isfinite(got).all(), (name, m, cfg)
                assert _err(got, ref) < BF16_TOL, (name, m, cfg, _err(got, ref))
        del rows, frag


@pytest.mark.parametrize("fmt", ["int4-g128", "nvfp4"])
def test_fp32_activations_and_unaligned_rows(fmt: str) -> None:
    """fp32 activations take the portable (Triton) body; a bf16 view starting off a 16-byte boundary is copied."""
    rows, frag = _pair(5120, 6144, fmt, 2)
    x = torch.randn(3, 6144, device="cuda")
    assert _err(quant_matmul_triton(x, frag), quant_matmul_reference(x, rows)) < 1e-5
    base = torch.randn(2, 6145, device="cuda", dtype=torch.bfloat16)
    x = base[:, 1:]
    assert _err(quant_matmul_triton(x, frag), quant_matmul_reference(x.float(), rows)) < BF16_TOL


@pytest.mark.parametrize("fmt", ["int4-g128", "int8-g64", "nvfp4"])
def test_in_cuda_graph_bit_equal_to_eager(fmt: str) -> None:
    """Split-K with the fused, ordered reduction (and programmatic dependent launch where the GPU has it)."""
    _, frag = _pair(5120, 17408, fmt, 3)
    cfg = next(c for c in fragment_candidates(fmt, 4, 5120, 17408, sm_count(CUDA)) if c.split_k > 1)
    x = torch.randn(4, 17408, device="cuda", dtype=torch.bfloat16)
    graph_replay_matches(frag, cfg, x, torch.randn(4, 5120, device="cuda", dtype=torch.bfloat16))


def test_prefill_sizes_and_tuned_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """33+ tokens: every candidate (the decode over token blocks, the dequantization + cuBLAS) and the tuner's
    timed choice; the dequantized workspace equals ``dequantize`` bit for bit."""
    monkeypatch.setenv("NINFER_TUNE_CACHE", "off")
    rows, frag = _pair(2 * 17408, 5120, "int4-g64", 4)
    ws = torch.full((2 * 17408, 5120), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert torch.equal(dequantize_triton(frag, ws), rows.dequantize(torch.bfloat16))
    for m in (33, 300):
        x = torch.randn(m, 5120, device="cuda", dtype=torch.bfloat16)
        ref = quant_matmul_reference(x.float(), rows, None, True)
        for cfg in candidates("int4-g64", m, 17408, 5120, sm_count(CUDA), swiglu=True, layout=FRAGMENTS):
            got = quant_matmul_triton(x, frag, None, True, config=cfg)
            assert _err(got, ref) < BF16_TOL, (m, cfg)
        with use_tuner(TunerState(enabled=True)):
            assert _err(quant_matmul_triton(x, frag, None, True), ref) < BF16_TOL


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "int8-g64", "nvfp4"])
def test_prefill_sizes_without_swiglu_take_the_64_token_decode(fmt: str) -> None:
    """Without SwiGLU the prefill sizes also offer the register decode with 64 tokens per program
    (``wide_fragment_candidate``): every candidate at the 27B down shape (with a residual) and at 33, 64, 100
    and 300 tokens, against the reference."""
    rows, frag = _pair(5120, 17408, fmt, 5)
    ws = torch.full((5120, 17408), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert torch.equal(dequantize_triton(frag, ws), rows.dequantize(torch.bfloat16))
    for m in (33, 64, 100, 300):
        x = torch.randn(m, 17408, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(m, 5120, device="cuda", dtype=torch.bfloat16)
        ref = quant_matmul_reference(x.float(), rows, res.float(), False)
        cands = candidates(fmt, m, 5120, 17408, sm_count(CUDA), layout=FRAGMENTS)
        assert any(c.kind == "frag" and c.block_m == 64 for c in cands), cands
        for cfg in cands:
            out = torch.full((m, 5120), float("nan"), device="cuda", dtype=torch.bfloat16)
            got = quant_matmul_triton(x, frag, res, False, out=out, config=cfg)
            assert torch.isfinite(got).all() and _err(got, ref) < BF16_TOL, (fmt, m, cfg, _err(got, ref))


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "int8-g64"])
def test_tiled_every_candidate_at_real_shapes(fmt: str) -> None:
    """The tiled GEMM over the fragment layout (``fragment_tiled``): every candidate at the 27B shapes (plain,
    residual, SwiGLU) at 33, 64, 128 and 300 tokens in bf16, the first at 128 tokens in fp16, NaN-poisoned."""
    sms = sm_count(CUDA)
    for name, n, k, swiglu, residual in CASES:
        rows, frag = _pair(n, k, fmt, 7)
        n_out = n // 2 if swiglu else n
        for m, dtype in ((33, torch.bfloat16), (64, torch.bfloat16), (128, torch.bfloat16), (300, torch.bfloat16),
                         (128, torch.float16)):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            res = torch.randn(m, n_out, device="cuda", dtype=dtype) if residual else None
            ref = quant_matmul_reference(x.float(), rows, None if res is None else res.float(), swiglu)
            cands = tiled_fragment_candidates(fmt, m, n_out, k, sms, swiglu=swiglu)
            assert cands, (fmt, name, m)
            for cfg in cands if dtype == torch.bfloat16 else cands[:1]:
                out = torch.full((m, n_out), float("nan"), device="cuda", dtype=dtype)
                got = quant_matmul_triton(x, frag, res, swiglu, out=out, config=cfg)
                assert torch.isfinite(got).all(), (fmt, name, m, cfg)
                assert _err(got, ref) < BF16_TOL, (fmt, name, m, cfg, _err(got, ref))
        del rows, frag


def test_tiled_in_cuda_graph_bit_equal_to_eager() -> None:
    """The tiled GEMM with split-K (scratch, ordered sum) captured at a prompt chunk's size: bit-equal to eager,
    right after new inputs; and a graph key at 128 tokens is tuned among captured-safe configs only."""
    _, frag = _pair(5120, 17408, "int4-g64", 8)
    cfg = next(c for c in tiled_fragment_candidates("int4-g64", 128, 5120, 17408, sm_count(CUDA)) if c.split_k > 1)
    x = torch.randn(128, 17408, device="cuda", dtype=torch.bfloat16)
    graph_replay_matches(frag, cfg, x, torch.randn(128, 5120, device="cuda", dtype=torch.bfloat16))
    graph = graph_candidates("int4-g64", 128, 5120, 17408, sm_count(CUDA), layout=FRAGMENTS)
    assert "dequant" not in {c.kind for c in graph} and "frag-tiled" in {c.kind for c in graph}


def test_dequantization_path_in_cuda_graph() -> None:
    """The dequantization path captured once its workspace holds the weight (the prompt-chunk graphs' case):
    bit-equal to eager, right after new inputs, its buffer kept alive past a release."""
    from ninfer.kernels.quant_gemm import dequant as quant_dequant

    _, frag = _pair(5120, 17408, "int4-g64", 9)
    cfg = candidates("int4-g64", 128, 5120, 17408, sm_count(CUDA), layout=FRAGMENTS)[0]
    assert cfg.kind == "dequant"
    x = torch.randn(128, 17408, device="cuda", dtype=torch.bfloat16)
    graph_replay_matches(frag, cfg, x, torch.randn(128, 5120, device="cuda", dtype=torch.bfloat16))
    assert quant_dequant._KEPT and quant_dequant.graph_workspace_fits(5120, 17408, torch.bfloat16, CUDA)


def test_model_projections_re_laid_in_place() -> None:
    """``use_kernel_layouts_`` re-lays what fits (same parameters, new order) and leaves the rest; the layer's
    output and ``dequantize`` are unchanged."""
    g = torch.Generator(device="cuda").manual_seed(5)
    fits = QuantLinear.from_float(torch.randn(1024, 2048, generator=g, device="cuda") * 0.02, "int4-g128")
    fits8 = QuantLinear.from_float(torch.randn(1024, 2048, generator=g, device="cuda") * 0.02, "int8-g64")
    odd = QuantLinear.from_float(torch.randn(257, 2048, generator=g, device="cuda") * 0.02, "int4-g128")
    fp4 = QuantLinear.from_float(torch.randn(1024, 2048, generator=g, device="cuda") * 0.02, "nvfp4")
    x = torch.randn(2, 2048, device="cuda", dtype=torch.bfloat16)
    before = [fits(x), odd(x), fits.dequantize(torch.float32), fits8(x), fits8.dequantize(torch.float32), fp4(x),
              fp4.dequantize(torch.float32)]
    param = fits.qweight
    assert use_kernel_layouts_(torch.nn.ModuleList([fits, odd, fits8, fp4])) == 3
    assert fits.layout == FRAGMENTS and fits.qweight is param and odd.layout == "rows" and fits8.layout == FRAGMENTS
    assert _err(fits(x), before[0]) < 1e-2 and torch.equal(odd(x), before[1]) and _err(fits8(x), before[3]) < 1e-2
    assert torch.equal(fits.dequantize(torch.float32), before[2])
    assert torch.equal(fits8.dequantize(torch.float32), before[4])
    assert fp4.layout == FRAGMENTS and _err(fp4(x), before[5]) < 1e-2
    assert torch.equal(fp4.dequantize(torch.float32), before[6])
