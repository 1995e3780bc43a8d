"""The norm after a decode GEMM left to the GEMMs that read its rows (``NINFER_DEFERRED_NORM=1``,
``quant_gemm.deferred_norm``) on the GPU, bf16, at the 27B shapes.

Producer (o_proj / out_proj 5120 x 6144, down 5120 x 17408): every fragment candidate at 1 and 8 tokens under every
split-K sum; the new residual stream bit for bit against the GEMM followed by the norm kernel, the materialized rows
within bf16 rounding of its output. Consumer (q/k/v 14336 x 5120, q/k/v/z 16384 x 5120, gate/up 34816 x 5120 with
SwiGLU, the int8 LM head's shape cut to 16384 rows, the a/b gates' float GEMV 96 x 5120): every candidate against the
same GEMM of the materialized rows and the fp32 reference. Then producer and consumer together in a CUDA graph with
new inputs."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import fragment_laid

from ninfer.kernels.float_gemv import float_gemv_candidates, launch_float_gemv
from ninfer.kernels.norms import NormedRows, deferred_norm_reference, rms_norm_reference, rms_norm_triton
from ninfer.kernels.quant_gemm import quant_matmul_reference, quant_matmul_then_norm, quant_matmul_triton
from ninfer.kernels.quant_gemm.tune import fragment_candidates, sm_count
from ninfer.quant.formats import quantize
from ninfer.runtime.graphs import capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
PRODUCERS = [("o_proj", 5120, 6144), ("down", 5120, 17408)]
READERS = [("qkv", 14336, 5120, False), ("qkvz", 16384, 5120, False), ("gate_up", 34816, 5120, True)]


@pytest.fixture(autouse=True)
def _deferred(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_DEFERRED_NORM", "1")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _weights(n: int, k: int, fmt: str, g: torch.Generator):
    w = quantize(torch.randn(n, k, generator=g, device="cuda") * 0.02, fmt)
    return w, fragment_laid(w)


@pytest.mark.parametrize("mode", ["each", "across", "tile"])
def test_every_producer_candidate(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_SPLIT_SUM", mode)
    for name, n, k in PRODUCERS:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        w, laid = _weights(n, k, "int4-g64", g)
        norm_w = (torch.randn(n, generator=g, device="cuda") * 0.3).to(torch.bfloat16)
        for m in (1, 8):
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            res = (torch.randn(m, n, generator=g, device="cuda") * 4).to(torch.bfloat16)
            for cfg in fragment_candidates("int4-g64", m, n, k, sm_count(CUDA)):
                want, want_res = rms_norm_triton(quant_matmul_triton(x, laid, config=cfg), norm_w, 1e-6, res)
                normed, new_res = quant_matmul_then_norm(x, laid, norm_w, 1e-6, res, config=cfg, defer=True)
                label = f"{name} m={m} {mode} {cfg}"
                assert isinstance(normed, NormedRows), label
                assert torch.equal(new_res, want_res), f"{label}: new residual stream"
                got = normed.materialize()
                assert torch.isfinite(got).all(), label
                assert _rel(got, want) < 4e-3, f"{label}: {_rel(got, want):.2e} from the norm kernel"


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "nvfp4", "int8-g64"])
def test_every_reader_candidate(fmt: str) -> None:
    for name, n, k, swiglu in READERS + [("lm_head rows", 16384, 5120, False)]:
        g = torch.Generator(device="cuda").manual_seed(n)
        w, laid = _weights(n, k, fmt, g)
        for m in (1, 4, 8, 32):
            h = (torch.randn(m, k, generator=g, device="cuda") * 3).to(torch.bfloat16)
            norm_w = (torch.randn(k, generator=g, device="cuda") * 0.3).to(torch.bfloat16)
            normed, _ = deferred_norm_reference(h, norm_w, 1e-6, None, 80)
            plain = normed.materialize()
            oracle = quant_matmul_reference(rms_norm_reference(h.float(), norm_w.float(), 1e-6)[0], w, swiglu=swiglu)
            for cfg in fragment_candidates(fmt, m, n // (2 if swiglu else 1), k, sm_count(CUDA), swiglu=swiglu):
                if not cfg.kind.startswith("frag") or cfg.kind.startswith("frag-tiled"):
                    continue
                got = quant_matmul_triton(normed.scaled, laid, None, swiglu, config=cfg, row_norm=normed)
                want = quant_matmul_triton(plain, laid, None, swiglu, config=cfg)
                label = f"{name} {fmt} m={m} {cfg}"
                assert torch.isfinite(got).all(), label
                assert _rel(got, want) < 1e-2, f"{label}: {_rel(got, want):.2e} from the materialized rows"
                assert _rel(got, oracle) < 2e-2, f"{label}: {_rel(got, oracle):.2e} from the fp32 reference"


def test_the_gate_projection_reads_deferred_rows() -> None:
    g = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.randn(96, 5120, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    for m in (1, 4, 8):
        h = (torch.randn(m, 5120, generator=g, device="cuda") * 3).to(torch.bfloat16)
        norm_w = (torch.randn(5120, generator=g, device="cuda") * 0.3).to(torch.bfloat16)
        normed, _ = deferred_norm_reference(h, norm_w, 1e-6, None, 80)
        want = normed.materialize().float() @ w.float().t()
        for cfg in float_gemv_candidates(m, 96, 5120, sm_count(CUDA))[1:]:  # every candidate but cuBLAS
            out = torch.full((m, 96), float("nan"), dtype=torch.bfloat16, device="cuda")
            launch_float_gemv(normed.scaled, w, out, cfg, normed)
            assert _rel(out, want) < 1e-2, f"m={m} {cfg}: {_rel(out, want):.2e}"


def test_producer_and_reader_in_a_cuda_graph() -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    _, down = _weights(5120, 17408, "int4-g64", g)
    _, gate_up = _weights(34816, 5120, "int4-g64", g)
    norm_w = (torch.randn(5120, generator=g, device="cuda") * 0.3).to(torch.bfloat16)
    x = torch.randn(1, 17408, generator=g, device="cuda").to(torch.bfloat16)
    res = (torch.randn(1, 5120, generator=g, device="cuda") * 4).to(torch.bfloat16)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        normed, new_res = quant_matmul_then_norm(x, down, norm_w, 1e-6, res, defer=True)
        return quant_matmul_triton(normed.scaled, gate_up, None, True, row_norm=normed), new_res

    eager = step()
    graph, (out, new_res) = capture(step)
    graph.replay()
    assert torch.equal(out, eager[0]) and torch.equal(new_res, eager[1])
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        res.copy_(torch.randn_like(res))
        graph.replay()
        normed, want_res = rms_norm_triton(quant_matmul_triton(x, down), norm_w, 1e-6, res)
        assert torch.equal(new_res, want_res)
        want = quant_matmul_triton(normed, gate_up, None, True)
        assert _rel(out, want) < 1e-2


@pytest.mark.parametrize("path", ["gemv", "mma", "auto"])
def test_routed_experts_read_deferred_rows(path: str) -> None:
    """The 35B-A3B expert block (H 2048, I 512, 256 int4-g64 experts, top-8) on deferred rows at 1 / 4 / 8 tokens:
    against the same block on the materialized rows."""
    from ninfer.kernels.moe import route_topk_reference
    from ninfer.kernels.moe.gemm import moe_experts_triton

    g = torch.Generator(device="cuda").manual_seed(9)
    gate_up = quantize(torch.randn(256, 1024, 2048, generator=g, device="cuda") * 2048 ** -0.5, "int4-g64")
    down = quantize(torch.randn(256, 2048, 512, generator=g, device="cuda") * 512 ** -0.5, "int4-g64")
    for m in (1, 4, 8):
        weights, ids = route_topk_reference(torch.randn(m, 256, generator=g, device="cuda"), 8)
        h = (torch.randn(m, 2048, generator=g, device="cuda") * 3).to(torch.bfloat16)
        norm_w = (torch.randn(2048, generator=g, device="cuda") * 0.3).to(torch.bfloat16)
        normed, _ = deferred_norm_reference(h, norm_w, 1e-6, None, 32)
        got = moe_experts_triton(normed, gate_up, down, weights.to(torch.bfloat16), ids, path=path)
        want = moe_experts_triton(normed.materialize(), gate_up, down, weights.to(torch.bfloat16), ids, path=path)
        assert torch.isfinite(got).all() and _rel(got, want) < 1e-2, f"m={m} {path}: {_rel(got, want):.2e}"
