"""Quantized GEMMs on the GPU at Qwen3.5-27B shapes vs the fp32 dequantize-then-matmul reference."""
from __future__ import annotations

import pytest
import torch
import triton
from kernel_testing import graph_replay_matches

from ninfer.kernels.quant_gemm import dequant as quant_dequant
from ninfer.kernels.quant_gemm import timing as quant_gemm_timing
from ninfer.kernels.quant_gemm import tune as quant_gemm_tune
from ninfer.kernels.quant_gemm.dequant import dequantize_triton
from ninfer.kernels.quant_gemm import (
    quant_matmul,
    quant_matmul_reference,
    quant_matmul_triton,
)
from ninfer.kernels.quant_gemm.tune import (
    candidates,
    dequant_candidates,
    gemv_candidates,
    mma_candidates,
    sm_count,
)
from ninfer.kernels.tuning import TunerState, default_tuner, use_tuner
from ninfer.quant.formats import quantize
from ninfer.quant.linear import QuantEmbedding, QuantLinear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FORMATS = ["fp8", "fp8-b128", "int8-g32", "int8-g64", "int4-g64", "int4-g128", "nvfp4"]
SHAPES = {"down": (5120, 17408), "kv_proj": (1024, 5120), "o_proj": (5120, 6144), "in_proj_ab": (96, 5120)}
TOL = {torch.bfloat16: 1.5e-2, torch.float32: 1e-5}  # relative Frobenius error of the output


@pytest.fixture
def heuristic_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The favourite config per key instead of a tuning pass (fewer compilations; every candidate is
    checked by test_every_candidate_config, and the tuner by test_cuda_graph_replay_matches_eager)."""
    monkeypatch.setattr(default_tuner(), "enabled", False)


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, k, generator=g, device="cuda") * 0.02


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.usefixtures("heuristic_configs")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_real_shapes_ragged_batches(fmt: str, shape: str) -> None:
    n, k = SHAPES[shape]
    w = quantize(_weight(n, k, 0), fmt)
    for dtype in (torch.bfloat16, torch.float32):
        for m in (1, 3, 16, 17, 300):
            x = torch.randn(m, k, device="cuda").to(dtype)
            out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
            got = quant_matmul_triton(x, w, out=out)
            ref = quant_matmul_reference(x, w)
            assert _err(got, ref) < TOL[dtype], (fmt, shape, dtype, m)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_candidate_config(fmt: str) -> None:
    n, k = 1024, 5120
    w = quantize(_weight(n, k, 1), fmt)
    for m in (4, 200):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = quant_matmul_reference(x, w)
        for cfg in candidates(fmt, m, n, k, sm_count(x.device), mma=True):
            try:
                got = quant_matmul_triton(x, w, config=cfg)
            except triton.runtime.errors.OutOfResources:
                continue  # too much shared memory / too many registers on this GPU is allowed, wrong results are not
            assert _err(got, ref) < TOL[torch.bfloat16], (fmt, m, cfg)


@pytest.mark.usefixtures("heuristic_configs")
@pytest.mark.parametrize("fmt", ["int4-g64", "nvfp4", "fp8", "int8-g64"])
def test_gate_up_swiglu_and_residual_epilogues(fmt: str) -> None:
    gate = QuantLinear.from_float(_weight(17408, 5120, 2), fmt)
    up = QuantLinear.from_float(_weight(17408, 5120, 3) * 2, fmt)
    fused = QuantLinear.stacked([gate, up])
    down = QuantLinear.from_float(_weight(5120, 17408, 4), fmt)
    for m in (1, 7, 129):
        x = torch.randn(m, 5120, device="cuda", dtype=torch.bfloat16)
        h = fused(x, swiglu=True)
        ref_h = quant_matmul_reference(x, fused.packed(), swiglu=True)
        assert _err(h, ref_h) < TOL[torch.bfloat16], (fmt, m)
        res = torch.randn(m, 5120, device="cuda", dtype=torch.bfloat16)
        y = down(h, residual=res)
        assert _err(y, quant_matmul_reference(h, down.packed(), res)) < TOL[torch.bfloat16], (fmt, m)


@pytest.mark.usefixtures("heuristic_configs")
def test_lm_head_shape_and_embedding_lookup() -> None:
    w = _weight(248320, 5120, 5).to(torch.bfloat16)
    emb = QuantEmbedding.from_float(w, "fp8")
    ids = torch.tensor([0, 248319, 77], device="cuda")
    assert torch.equal(emb(ids), emb.format.dequantize_rows(dict(emb.named_parameters()), ids, torch.bfloat16))
    head = emb.as_linear()
    x = torch.randn(3, 5120, device="cuda", dtype=torch.bfloat16)
    assert _err(head(x), quant_matmul_reference(x, head.packed())) < TOL[torch.bfloat16]


def test_cuda_graph_replay_matches_eager() -> None:
    w = quantize(_weight(5120, 17408, 6), "int4-g64")  # down_proj: split-K favourite at decode
    x = torch.randn(2, 17408, device="cuda", dtype=torch.bfloat16)
    eager = quant_matmul(x, w)  # tunes outside the graph
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        quant_matmul(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quant_matmul(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert _err(out, quant_matmul_reference(x, w)) < TOL[torch.bfloat16]
    assert eager.shape == out.shape


@pytest.mark.usefixtures("heuristic_configs")
@pytest.mark.parametrize("fmt", ["int4-g64", "nvfp4", "fp8-b128"])
def test_expert_slices_of_stacked_weights(fmt: str) -> None:
    from ninfer.quant.linear import QuantWeight

    experts = QuantWeight.from_float(_weight(4 * 1024, 2048, 7).view(4, 1024, 2048), fmt)
    for m in (1, 9, 70):
        x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
        for e in (0, 3):
            w = experts.select(e)
            assert _err(quant_matmul_triton(x, w), quant_matmul_reference(x, w)) < TOL[torch.bfloat16], (fmt, m, e)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_configs_at_real_shapes(fmt: str) -> None:
    """Every GEMV candidate (split-K or not, per the shape) in bf16 at decode batch sizes, with the
    residual epilogue on down_proj and SwiGLU on a stacked gate/up weight (N_OUT = 17408)."""
    sms = sm_count(torch.device("cuda"))
    cases = [("kv_proj", 1024, 5120, False, False), ("down", 5120, 17408, False, True),
             ("gate_up", 2 * 17408, 5120, True, False)]
    for name, n, k, swiglu, residual in cases:
        w = quantize(_weight(n, k, 8), fmt)
        n_out = n // 2 if swiglu else n
        for m in (1, 3, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16) if residual else None
            ref = quant_matmul_reference(x, w, res, swiglu)
            for cfg in gemv_candidates(fmt, m, n_out, k, sms):
                out = torch.full((m, n_out), float("nan"), device="cuda", dtype=torch.bfloat16)
                got = quant_matmul_triton(x, w, res, swiglu, out=out, config=cfg)
                assert torch.isfinite(got).all(), (fmt, name, m, cfg)
                assert _err(got, ref) < TOL[torch.bfloat16], (fmt, name, m, cfg)


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_core_decode_at_real_shapes(fmt: str, dtype: torch.dtype) -> None:
    """Every ``gemv-mma`` candidate (the PTX nibble decode, mma.sync) at 1..29 tokens: plain, residual on
    down_proj, SwiGLU on the stacked gate/up weight; fp16 too (its own decode constants)."""
    sms = sm_count(torch.device("cuda"))
    cases = [("o_proj", 5120, 6144, False, False), ("down", 5120, 17408, False, True),
             ("gate_up", 2 * 17408, 5120, True, False)]
    for name, n, k, swiglu, residual in cases:
        w = quantize(_weight(n, k, 12), fmt)
        n_out = n // 2 if swiglu else n
        for m in (1, 3, 8, 13, 29):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            res = torch.randn(m, n_out, device="cuda", dtype=dtype) if residual else None
            ref = quant_matmul_reference(x.float(), w, None if res is None else res.float(), swiglu)
            cands = mma_candidates(fmt, m, n_out, k, sms, swiglu=swiglu)
            assert cands, (fmt, name, m)
            for cfg in cands:
                out = torch.full((m, n_out), float("nan"), device="cuda", dtype=dtype)
                got = quant_matmul_triton(x, w, res, swiglu, out=out, config=cfg)
                assert torch.isfinite(got).all(), (fmt, name, m, cfg)
                assert _err(got, ref) < TOL[torch.bfloat16], (fmt, name, m, cfg, _err(got, ref))


def test_tensor_core_decode_in_cuda_graph() -> None:
    w = quantize(_weight(5120, 17408, 13), "int4-g64")
    cfg = next(c for c in mma_candidates("int4-g64", 4, 5120, 17408, sm_count(torch.device("cuda")))
               if c.split_k > 1)
    x = torch.randn(4, 17408, device="cuda", dtype=torch.bfloat16)
    graph_replay_matches(w, cfg, x, torch.randn(4, 5120, device="cuda", dtype=torch.bfloat16))


def test_gemv_split_k_in_cuda_graph() -> None:
    w = quantize(_weight(1024, 5120, 9), "int4-g64")
    cfg = gemv_candidates("int4-g64", 2, 1024, 5120, sm_count(torch.device("cuda")))[0]
    assert cfg.kind == "gemv" and cfg.split_k > 1
    x = torch.randn(2, 5120, device="cuda", dtype=torch.bfloat16)
    graph_replay_matches(w, cfg, x, torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16))


def test_decode_tuning_times_graphs_and_keeps_a_working_config(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tuner times decode-sized keys from graph replays (quant_gemm_timing.graph_ms); the winner must
    # compute the right product, also when the output aliases the residual.
    tuner = TunerState(enabled=True)  # a fresh state: nothing chosen yet
    monkeypatch.setenv("NINFER_TUNE_CACHE", "off")  # time it here, not from an earlier run's choice
    # every candidate, also under NINFER_AUTOTUNE=off (which keeps one and so never times anything)
    monkeypatch.setattr(quant_gemm_tune, "autotune_configs", lambda configs: configs)
    used = []
    real = quant_gemm_timing.graph_ms
    monkeypatch.setattr(quant_gemm_timing, "graph_ms", lambda fn, cold=None: used.append(1) or real(fn, cold=cold))
    w = quantize(_weight(5120, 6144, 11), "int4-g64")
    x = torch.randn(1, 6144, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(1, 5120, device="cuda", dtype=torch.bfloat16)
    ref = quant_matmul_reference(x, w, res)
    with use_tuner(tuner):
        got = quant_matmul_triton(x, w, res, out=res)
    assert used and len(tuner.chosen("quant_gemm")) == 1
    assert _err(got, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequant_path_at_real_shapes(fmt: str) -> None:
    """The dequantize-then-cuBLAS prefill path in bf16 (test_every_candidate_config covers its plain
    GEMM): a bit-exact workspace for every dequant config, SwiGLU on the stacked gate/up weight, the
    residual added in place (``out`` is the residual: cuBLAS ``addmm_``)."""
    gate_up = quantize(_weight(2 * 17408, 5120, 10), fmt)
    down = quantize(_weight(5120, 17408, 11), fmt)
    ref_w = gate_up.dequantize(torch.bfloat16)
    for cfg in dequant_candidates(fmt, 128):
        buf = torch.full(ref_w.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        assert torch.equal(dequantize_triton(gate_up, buf, cfg), ref_w), (fmt, cfg)
    del ref_w, buf
    cfg = dequant_candidates(fmt, 128)[0]
    for m in (17, 300):
        x = torch.randn(m, 5120, device="cuda", dtype=torch.bfloat16)
        h = quant_matmul_triton(x, gate_up, swiglu=True, config=cfg)
        assert _err(h, quant_matmul_reference(x, gate_up, swiglu=True)) < TOL[torch.bfloat16], (fmt, m)
        res = torch.randn(m, 5120, device="cuda", dtype=torch.bfloat16)
        ref = quant_matmul_reference(h, down, res)
        y = quant_matmul_triton(h, down, res, out=res, config=cfg)
        assert y.data_ptr() == res.data_ptr()
        assert _err(y, ref) < TOL[torch.bfloat16], (fmt, m)
    quant_dequant.release_workspaces()


def test_dequant_config_in_cuda_graph_takes_the_tiled_kernel() -> None:
    """Capture must not record the shared workspace (a later, larger weight reallocates it): a dequant
    config captures the tiled favourite instead, and replays correctly after the buffer moved."""
    w = quantize(_weight(1024, 5120, 12), "int4-g64")
    cfg = dequant_candidates("int4-g64", 32)[0]
    x = torch.randn(32, 5120, device="cuda", dtype=torch.bfloat16)
    quant_matmul_triton(x, w, config=candidates("int4-g64", 32, 1024, 5120, sm_count(x.device))[0])  # compile it
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        quant_matmul_triton(x, w, config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quant_matmul_triton(x, w, config=cfg)
    quant_dequant.release_workspaces()
    quant_dequant.workspace(4096, 8192, torch.bfloat16, x.device).fill_(float("nan"))
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert _err(out, quant_matmul_reference(x, w)) < TOL[torch.bfloat16]
    quant_dequant.release_workspaces()
