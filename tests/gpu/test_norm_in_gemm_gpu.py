"""The RMSNorm after a decode GEMM in the register decode's own launch (``quant_matmul_then_norm``,
``NINFER_NORM_IN_GEMM=1``) on the GPU, at the 27B output projections' shapes (o_proj, out_proj, down_proj) and the
35B-A3B's, bf16: every fragment candidate at 1 and 8 tokens, against the same GEMM followed by the norm kernel
(the new residual stream bit for bit, the normed output within bf16 rounding) and the fp32 reference; then in a
CUDA graph with new inputs, and the arrival counters left at zero."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import fragment_laid

from ninfer.kernels.counters import arrival_counters
from ninfer.kernels.norms import rms_norm_reference, rms_norm_triton
from ninfer.kernels.quant_gemm import quant_matmul_reference, quant_matmul_then_norm, quant_matmul_triton
from ninfer.kernels.quant_gemm.tune import fragment_candidates, sm_count
from ninfer.quant.formats import quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
SHAPES = [("27b o_proj", 5120, 6144), ("27b out_proj", 5120, 6144), ("27b down", 5120, 17408),
          ("35b o_proj", 2048, 4096), ("35b out_proj", 2048, 4096)]


def _case(n: int, k: int, m: int, fmt: str, seed: int) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = quantize(torch.randn(n, k, generator=g, device="cuda") * 0.02, fmt)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    res = (torch.randn(m, n, generator=g, device="cuda") * 4).to(torch.bfloat16)
    norm_w = (torch.randn(n, generator=g, device="cuda") * 0.3).to(torch.bfloat16)
    return w, fragment_laid(w), x, res, norm_w


@pytest.fixture(autouse=True)
def _fused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_NORM_IN_GEMM", "1")


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "nvfp4", "int8-g64"])
def test_every_candidate_applies_the_norm(fmt: str) -> None:
    for name, n, k in SHAPES:
        for m in (1, 8):
            w, laid, x, res, norm_w = _case(n, k, m, fmt, seed=m)
            want = rms_norm_reference(quant_matmul_reference(x.float(), w), norm_w.float(), 1e-6, res.float())[0]
            for cfg in fragment_candidates(fmt, m, n, k, sm_count(CUDA)):
                y = quant_matmul_triton(x, laid, config=cfg)
                unfused, unfused_res = rms_norm_triton(y, norm_w, 1e-6, res)
                normed, new_res = quant_matmul_then_norm(x, laid, norm_w, 1e-6, res, config=cfg)
                torch.cuda.synchronize()
                label = f"{name} {fmt} m={m} {cfg}"
                assert torch.equal(new_res, unfused_res), f"{label}: new residual stream"
                assert torch.isfinite(normed).all(), label
                err = ((normed.float() - unfused.float()).norm() / unfused.float().norm()).item()
                assert err < 4e-3, f"{label}: {err:.2e} from the norm kernel"
                err = ((normed.float() - want).norm() / want.norm()).item()
                assert err < 2e-2, f"{label}: {err:.2e} from the fp32 reference"
                assert not arrival_counters(CUDA).any(), f"{label}: an arrival counter left set"


def test_in_a_cuda_graph_with_new_inputs() -> None:
    w, laid, x, res, norm_w = _case(5120, 17408, 1, "int4-g64", seed=3)
    cfg = fragment_candidates("int4-g64", 1, 5120, 17408, sm_count(CUDA))[0]
    eager = quant_matmul_then_norm(x, laid, norm_w, 1e-6, res, config=cfg)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        quant_matmul_then_norm(x, laid, norm_w, 1e-6, res, config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, new_res = quant_matmul_then_norm(x, laid, norm_w, 1e-6, res, config=cfg)
    graph.replay()
    assert torch.equal(normed, eager[0]) and torch.equal(new_res, eager[1])
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        res.copy_(torch.randn_like(res))
        graph.replay()
        want = rms_norm_triton(quant_matmul_triton(x, laid, config=cfg), norm_w, 1e-6, res)
        assert torch.equal(new_res, want[1])
        assert ((normed.float() - want[0].float()).norm() / want[0].float().norm()).item() < 4e-3
