"""The expert register decode (:mod:`ninfer.kernels.moe.quant_mma`) on the GPU: its PTX at the 35B-A3B shapes.

Run: ``python -m pytest -m gpu tests/gpu/test_moe_quant_mma.py``. Every candidate the selection may pick, pinned
for both GEMMs, at 1, 4 and 8 tokens (8, 32, 64 routed pairs), bf16 and fp16 activations, a skewed routing (one
expert in every token's top k: a block of eight pairs; top-2 routing with 20 pairs on one expert: three blocks),
against dequantize + the fp32 reference; experts without tokens never read (NaN scales); a captured step replays
exactly what eager calls compute; and past the alignment-free limit, rows aligned in blocks of 16 (9 and 32 tokens).
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_graph_replays_eager, nan_experts

from ninfer.kernels.moe import moe_experts_reference, route_topk, route_topk_reference
from ninfer.kernels.moe import quant_gemm as moe_quant_gemm
from ninfer.kernels.moe.gemm import moe_experts_triton
from ninfer.kernels.moe.mma_configs import expert_mma_candidates
from ninfer.quant.formats import QuantizedTensor, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E, TOP_K, H, I = 128, 8, 2048, 512
TOL = 1.5e-2  # relative Frobenius error of the 16-bit output against the fp32 reference


@pytest.fixture(autouse=True)
def no_other_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("an expert kernel other than the register decode ran")

    monkeypatch.setattr(moe_quant_gemm, "_launch_dot", fail)
    monkeypatch.setattr(moe_quant_gemm, "launch_expert_gemv", fail)


@pytest.fixture(scope="module", params=["int4-g64", "int4-g128"])
def stacks(request) -> tuple[QuantizedTensor, QuantizedTensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, generator=g, device="cuda") * H ** -0.5
    down = torch.randn(E, H, I, generator=g, device="cuda") * I ** -0.5
    return quantize(gate_up, request.param), quantize(down, request.param)


def _route(n: int, seed: int, skew: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(n, E, generator=g, device="cuda")
    if skew:
        logits[:, 7] = 20.0
    return route_topk_reference(logits.to(torch.bfloat16), TOP_K)


def _configs(n: int) -> list:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gate_up = expert_mma_candidates("int4-g64", n * TOP_K, I, H, sms)
    down = expert_mma_candidates("int4-g64", n * TOP_K, H, I, sms)
    return gate_up + [c for c in down if c not in gate_up]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_candidate(stacks, dtype: torch.dtype) -> None:
    gate_up, down = stacks
    for n, skew in ((1, False), (4, False), (8, False), (8, True)):
        weights, ids = _route(n, n, skew)
        x = torch.randn(n, H, device="cuda").to(dtype)
        ref = moe_experts_reference(x.float(), gate_up.dequantize(), down.dequantize(), weights.float(), ids)
        for cfg in _configs(n):
            got = moe_experts_triton(x, gate_up, down, weights.to(dtype), ids, path=cfg)
            assert got.dtype == dtype and torch.isfinite(got).all(), (n, cfg)
            err = ((got.float() - ref).norm() / ref.norm()).item()
            assert err < TOL, (gate_up.format.name, n, skew, dtype, cfg, err)


def test_blocks_of_eight_pairs(stacks) -> None:
    """Top-2 routing of 20 tokens with one expert in every token's pair: 20 pairs of one expert, served by three
    programs (blocks of eight), beside experts with one or two pairs."""
    gate_up, down = stacks
    g = torch.Generator(device="cuda").manual_seed(11)
    logits = torch.randn(20, E, generator=g, device="cuda")
    logits[:, 7] = 20.0
    weights, ids = route_topk_reference(logits.to(torch.bfloat16), 2)
    x = torch.randn(20, H, device="cuda", dtype=torch.bfloat16)
    ref = moe_experts_reference(x.float(), gate_up.dequantize(), down.dequantize(), weights.float(), ids)
    for cfg in _configs(5)[:2]:
        got = moe_experts_triton(x, gate_up, down, weights.to(torch.bfloat16), ids, path=cfg)
        assert ((got.float() - ref).norm() / ref.norm()).item() < TOL, cfg


def test_unselected_experts_are_never_read(stacks) -> None:
    for n in (1, 8):
        weights, ids = _route(n, 50 + n)
        unused = torch.ones(E, dtype=torch.bool, device="cuda")
        unused[ids.flatten()] = False
        poisoned = nan_experts(stacks, unused.nonzero().flatten().tolist())
        x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
        cfg = _configs(n)[0]
        got = moe_experts_triton(x, *poisoned, weights, ids, path=cfg)
        assert torch.equal(got, moe_experts_triton(x, *stacks, weights, ids, path=cfg)), n


def _assert_step_replays(stacks, n: int, cfg) -> None:
    """Routing and both expert GEMMs of ``n`` tokens (``cfg`` pinned) captured: replays equal eager calls."""
    gate_up, down = stacks
    logits = torch.randn(n, E, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        weights, ids = route_topk(logits, TOP_K)
        return moe_experts_triton(x, gate_up, down, weights, ids, path=cfg)

    step()
    assert_graph_replays_eager(step, [logits, x], n)


def test_graph_replay(stacks) -> None:
    for n in (1, 8):
        _assert_step_replays(stacks, n, _configs(n)[0])


@pytest.mark.parametrize("n", [9, 32])
def test_aligned_verification_rows(stacks, n: int) -> None:
    """Past the 64 alignment-free pairs (9 tokens; 32: eight lanes verifying four tokens each), the rows come in
    aligned blocks of 16: the first candidates against the reference, unselected experts never read, a captured
    step equal to eager calls."""
    gate_up, down = stacks
    weights, ids = _route(n, 70 + n)
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    ref = moe_experts_reference(x.float(), gate_up.dequantize(), down.dequantize(), weights.float(), ids)
    for cfg in _configs(n)[:3]:
        got = moe_experts_triton(x, gate_up, down, weights.to(torch.bfloat16), ids, path=cfg)
        assert torch.isfinite(got).all() and ((got.float() - ref).norm() / ref.norm()).item() < TOL, (n, cfg)
    cfg = _configs(n)[0]
    unused = torch.ones(E, dtype=torch.bool, device="cuda")
    unused[ids.flatten()] = False
    if unused.any():
        poisoned = nan_experts(stacks, unused.nonzero().flatten().tolist())
        assert torch.equal(moe_experts_triton(x, *poisoned, weights, ids, path=cfg),
                           moe_experts_triton(x, *stacks, weights, ids, path=cfg))
    _assert_step_replays(stacks, n, cfg)
