"""The RMSNorm prologue of the quantized decode GEMMs on the GPU at Qwen3.5-27B shapes (K = 5120: gate_up
N = 34816 with SwiGLU, in_proj_qkvz N = 16384, attention qkv_proj N = 14336), bf16: fused
(``quant_matmul_triton(x, w, norm=...)``) against the norm kernel then the same GEMM config.

Rows of +-2^j have an exact rstd whatever the summation order, so there fused and unfused must agree to the
bit for every candidate (the PTX decode and the prologue's rounding points), and so must the normed x the
kernels write for a second reader (``norm_out``, DeltaNet's in_proj_ab); random rows differ only where the
rstd's fp32 sum order flips a normed bf16 value. A whole tiny int4 model scores the same fused and not.
"""
from __future__ import annotations

import pytest
import torch
import triton

import ninfer
from ninfer.kernels.norms import rms_norm_triton
from ninfer.kernels.quant_gemm import dispatch, quant_matmul, quant_matmul_reference, quant_matmul_triton
from ninfer.kernels.quant_gemm.tune import NORM_FIRST, NORM_KINDS, m_bucket, norm_candidates, sm_count
from ninfer.kernels.tuning import default_tuner
from ninfer.quant.formats import quantize
from tiny_checkpoints import TinyCheckpoint, make_dense

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE, DTYPE = "cuda", torch.bfloat16
K = 5120
SHAPES = {"gate_up": (34816, True), "qkvz": (16384, False), "qkv": (14336, False)}  # rows, SwiGLU
EPS = 1e-6


def _inputs(n: int, m: int, fmt: str, swiglu: bool, *, exact: bool, seed: int) -> tuple:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w = quantize(torch.randn(n, K, generator=g, device=DEVICE) * 0.02, fmt)
    if exact:  # +-2^j per row: sums of squares exact in any order
        signs = torch.randint(0, 2, (m, K), generator=g, device=DEVICE) * 2.0 - 1.0
        x = signs * 2.0 ** (torch.arange(m, device=DEVICE, dtype=torch.float32) % 8 - 2)[:, None]
    else:
        x = torch.randn(m, K, generator=g, device=DEVICE) * 3.0
    norm_w = (torch.randn(K, generator=g, device=DEVICE) * 0.3).to(DTYPE)
    res = torch.randn(m, n // 2 if swiglu else n, generator=g, device=DEVICE).to(DTYPE)
    return w, x.to(DTYPE), norm_w, res


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def _check_candidates(fmt: str, shape: str, m: int, every: bool) -> None:
    """Each candidate with the prologue (``every``; else the first two) on exact rows (bit-equal to
    norm-then-GEMM) and the first one on random rows (close to it and to the reference)."""
    n, swiglu = SHAPES[shape]
    n_out = n // 2 if swiglu else n
    cands = norm_candidates(fmt, m, n_out, K, sm_count(torch.device(DEVICE)), DTYPE, swiglu=swiglu)
    assert bool(cands) == (m <= 8 or fmt.startswith("int4")), (fmt, m)
    for exact in (True, False):
        w, x, norm_w, res = _inputs(n, m, fmt, swiglu, exact=exact, seed=m)
        x_normed = rms_norm_triton(x, norm_w, EPS)[0]
        ref = quant_matmul_reference(x, w, res, swiglu, norm=(norm_w, EPS))
        for cfg in cands if exact and every else cands[:2] if exact else cands[:1]:
            try:
                out = torch.full((m, n_out), float("nan"), device=DEVICE, dtype=DTYPE)
                kept = torch.full_like(x, float("nan")) if not swiglu else None  # DeltaNet's: for in_proj_ab
                got = quant_matmul_triton(x, w, res, swiglu, out=out, config=cfg, norm=(norm_w, EPS), norm_out=kept)
            except triton.runtime.errors.OutOfResources:
                continue  # too many registers / too much shared memory on this GPU is allowed
            unfused = quant_matmul_triton(x_normed, w, res, swiglu, config=cfg)
            assert torch.isfinite(got).all(), (fmt, shape, m, cfg)
            if exact:
                assert torch.equal(got, unfused), (fmt, shape, m, cfg, _err(got, unfused))
                assert kept is None or torch.equal(kept, x_normed), (fmt, shape, m, cfg)
            else:
                assert _err(got, unfused) < 2e-3, (fmt, shape, m, cfg, _err(got, unfused))
            assert _err(got, ref) < 1.5e-2, (fmt, shape, m, cfg, _err(got, ref))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", [1, 3, 8, 16, 32])
def test_every_int4_prologue_candidate_equals_norm_then_gemm(shape: str, m: int) -> None:
    _check_candidates("int4-g64", shape, m, every=m in (1, 8))


@pytest.mark.parametrize("fmt", ["int4-g128", "nvfp4", "int8-g64", "fp8"])
@pytest.mark.parametrize("m", [1, 8, 16])
def test_prologue_other_formats(fmt: str, m: int) -> None:
    _check_candidates(fmt, "gate_up", m, every=False)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tuned_fused_call_in_a_cuda_graph(shape: str) -> None:
    """The tuned choice of the norm key (its own key), replayed from a CUDA graph (arrival counters), equals
    the eager call, and the tuner stored a prologue kind for it."""
    n, swiglu = SHAPES[shape]
    w, x, norm_w, res = _inputs(n, 4, "int4-g64", swiglu, exact=False, seed=7)
    eager = quant_matmul(x, w, res, swiglu, norm=(norm_w, EPS))
    chosen = [cfg for key, cfg in default_tuner().chosen("quant_gemm").items()
              if "rms_norm" in key and key[3] == (n // 2 if swiglu else n)]
    assert chosen and all(c.kind in (*NORM_KINDS, NORM_FIRST.kind) for c in chosen)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        quant_matmul(x, w, res, swiglu, norm=(norm_w, EPS))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quant_matmul(x, w, res, swiglu, norm=(norm_w, EPS))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("m", [1, 8])
def test_fused_and_unfused_timings(m: int, capsys: pytest.CaptureFixture) -> None:
    """The tuner's graph timings of the norm key per shape: the best prologue config against NORM_FIRST (norm
    kernel + the plain GEMM's choice), and what it kept (printed for the record; the tuner decides)."""
    lines = []
    for shape, (n, swiglu) in SHAPES.items():
        n_out = n // 2 if swiglu else n
        w, x, norm_w, _ = _inputs(n, m, "int4-g64", swiglu, exact=False, seed=9)
        quant_matmul(x, w, None, swiglu, norm=(norm_w, EPS))  # tunes the norm key (and the plain one)
        for key, times in default_tuner().timings("quant_gemm").items():
            if "rms_norm" in key and key[3] == n_out and key[2] == m_bucket(m) and not key[6]:
                prologue = min(((t, c) for c, t in times.items() if c.kind != NORM_FIRST.kind), key=lambda tc: tc[0])
                kept = default_tuner().chosen("quant_gemm")[key]
                lines.append(f"{shape} m={m}: prologue {prologue[0] * 1e3:.1f} us ({prologue[1].kind}), norm + GEMM "
                             f"{times[NORM_FIRST] * 1e3:.1f} us; kept {kept.kind}")
    assert len(lines) == len(SHAPES)
    with capsys.disabled():
        print("\n" + "\n".join(lines))


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    return make_dense(tmp_path_factory.mktemp("norm_prologue"), seed=3,
                      overrides=dict(hidden_size=256, intermediate_size=512, head_dim=256, num_attention_heads=6,
                                     num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=6,
                                     linear_key_head_dim=128, linear_value_head_dim=128))


def test_quantized_model_scores_the_same_fused(dense: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 6-token forward (decode-sized GEMMs: norms folded into qkv_proj and gate_up_proj) against the same
    forward with the norm kernel before every GEMM."""
    llm = ninfer.load(dense.path, device="cuda", dtype=torch.bfloat16, quantize="int4", progress=False,
                      cuda_graphs=False)
    ids = list(range(3, 9))
    fused = llm.score(ids)
    monkeypatch.setattr(dispatch, "norm_fusable", lambda *args: False)
    unfused = llm.score(ids)
    # bf16: the prologue sums rstd in another order than the norm kernel, which can flip a normed value by
    # one ulp; through the layers that moved the scores by up to 0.086 (H200, run 2026-12-02.6). A wrong
    # prologue (no norm, wrong weight, wrong row) moves them by whole units.
    assert (fused - unfused).abs().max().item() < 0.15, (fused, unfused)
