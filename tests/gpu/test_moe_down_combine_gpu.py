"""The routed experts' down projection and combine in one launch (:mod:`ninfer.kernels.moe.down_combine`) on the GPU,
Qwen3.5-35B-A3B shapes (256 experts, top-8, H = 2048, I = 512), bf16 activations.

Run: ``python -m pytest -m gpu tests/gpu/test_moe_down_combine_gpu.py``. Every candidate config of every format
against the fp32 reference block (and its norm), at 1, 2 and 8 tokens, outputs poisoned; the whole block (router,
gate/up, the fused launch) captured in a CUDA graph equals eager calls, the configs then chosen by graph timing; the
arrival counters are left at zero.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_graph_replays_eager, poisoned_outputs  # noqa: F401  (a fixture)

from ninfer.kernels.counters import arrival_counters
from ninfer.kernels.moe import down_combine as dc
from ninfer.kernels.moe import moe_experts_reference, route_topk, route_topk_reference
from ninfer.kernels.moe.gemm import moe_experts_triton
from ninfer.kernels.norms import NextNorm, rms_norm_reference
from ninfer.kernels.tuning import TunerState, use_tuner
from ninfer.quant.formats import quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("poisoned_outputs")]

E, TOP_K, H, I = 256, 8, 2048, 512
FORMATS = ["int4-g64", "int4-g128", "int8-g64", "nvfp4", "fp8"]
TOL = 1.5e-2  # relative Frobenius error against the fp32 reference (bf16 activations and outputs)


@pytest.fixture(scope="module")
def float_down() -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    return torch.randn(E, H, I, generator=g, device="cuda") * I ** -0.5


def _inputs(n: int, seed: int) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(n, E, generator=g, device="cuda")
    weights, ids = route_topk_reference(logits, TOP_K)
    inter = torch.nn.functional.silu(torch.randn(n * TOP_K, I, generator=g, device="cuda")).bfloat16()
    shared = (torch.randn(n, H, generator=g, device="cuda").bfloat16(),
              (torch.randn(n, 1, generator=g, device="cuda") * 3).bfloat16())
    residual = (torch.randn(n, H, generator=g, device="cuda") * 4).bfloat16()
    return weights.bfloat16().reshape(-1).contiguous(), ids.int().contiguous(), inter, shared, residual


def _reference(dq: torch.Tensor, rw: torch.Tensor, ids: torch.Tensor, inter: torch.Tensor, shared) -> torch.Tensor:
    rows = torch.einsum("phi,pi->ph", dq[ids.reshape(-1).long()], inter.float()) * rw.float()[:, None]
    routed = rows.view(ids.shape[0], TOP_K, H).sum(dim=1)
    return routed + torch.sigmoid(shared[1].float()) * shared[0].float()


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_candidate_at_real_shapes(float_down: torch.Tensor, fmt: str) -> None:
    down = quantize(float_down, fmt)
    dq = down.dequantize()
    w = (torch.randn(H, device="cuda") * 0.3).bfloat16()
    for n in (1, 2, 8):
        rw, ids, inter, shared, residual = _inputs(n, seed=n)
        ref = _reference(dq, rw, ids, inter, shared)
        ref_normed, ref_res = rms_norm_reference(ref, w.float(), 1e-6, residual.float())
        for cfg in dc.down_combine_candidates(fmt, I):
            plain = torch.empty(n, H, dtype=torch.bfloat16, device="cuda")
            assert dc.launch_down_combine(inter, down, rw, ids, shared, None, plain, cfg)
            assert _rel(plain, ref) < TOL, (fmt, n, cfg)
            norm = NextNorm(w, 1e-6, residual, torch.empty(n, H, dtype=torch.bfloat16, device="cuda"))
            normed = torch.empty(n, H, dtype=torch.bfloat16, device="cuda")
            assert dc.launch_down_combine(inter, down, rw, ids, shared, norm, normed, cfg)
            assert _rel(norm.new_residual, ref_res) < TOL and _rel(normed, ref_normed) < TOL, (fmt, n, cfg)
    torch.cuda.synchronize()
    assert not arrival_counters(torch.device("cuda")).any()


@pytest.mark.parametrize("fmt", ["int4-g64", "nvfp4"])
def test_the_block_in_a_cuda_graph(float_down: torch.Tensor, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """Router top-k, gate/up and the fused launch (with the norm) as a captured decode step, at 1 and 8 tokens: the
    first eager call times the candidates (graph replays), the capture reuses the choice, replays equal eager."""
    monkeypatch.setenv("NINFER_MOE_DOWN_COMBINE", "1")
    monkeypatch.setenv("NINFER_TUNE_CACHE", "off")
    g = torch.Generator(device="cuda").manual_seed(1)
    gate_up = quantize(torch.randn(E, 2 * I, H, generator=g, device="cuda") * H ** -0.5, fmt)
    down = quantize(float_down, fmt)
    w = (torch.randn(H, device="cuda") * 0.3).bfloat16()
    tuner = TunerState()
    with use_tuner(tuner):
        for n in (1, 8):
            logits = torch.randn(n, E, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
            shared = (torch.randn(n, H, device="cuda", dtype=torch.bfloat16),
                      torch.randn(n, 1, device="cuda", dtype=torch.bfloat16))

            def step() -> torch.Tensor:
                weights, ids = route_topk(logits, TOP_K)
                norm = NextNorm(w, 1e-6, residual, torch.empty_like(x))
                normed = moe_experts_triton(x, gate_up, down, weights, ids, shared=shared, norm=norm)
                return torch.cat([normed, norm.new_residual])

            first = step()
            weights, ids = route_topk_reference(logits, TOP_K)
            block = moe_experts_reference(x.float(), gate_up.dequantize(), down.dequantize(), weights.float(), ids,
                                          (shared[0].float(), shared[1].float()))
            ref, ref_res = rms_norm_reference(block, w.float(), 1e-6, residual.float())
            assert _rel(first[:n], ref) < TOL and _rel(first[n:], ref_res) < TOL, (fmt, n)
            assert_graph_replays_eager(step, [logits, x, residual, shared[0], shared[1]], (fmt, n))
    chosen = tuner.chosen(dc.TABLE)
    assert {key[2] for key in chosen} == {1, 8} and len(tuner.timings(dc.TABLE)) == 2  # token buckets
    torch.cuda.synchronize()
    assert not arrival_counters(torch.device("cuda")).any()
