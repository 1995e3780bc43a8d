"""``NINFER_MOE_DOWN_EARLY=1`` on the GPU: the MoE down projection launched with programmatic dependent launch,
reading its expert ids and asking the L2 for its weights before it waits for the gate/up.

Run: ``python -m pytest -m gpu tests/gpu/test_moe_down_early_gpu.py``. At the 35B-A3B's expert shapes (256
experts, H = 2048, I = 512), int4-g64, int8-g64 and nvfp4 stacks, 1, 2 and 8 tokens: every GEMV and register-decode
candidate of the down projection, pinned, gives the plain launch's output to the bit; and a captured step in which
the routing kernel writes the ids two launches before the early down (as in the model), replayed with new router
logits and activations, equals eager calls without the switch (ids read before they were written would not).
"""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels.moe import route_topk
from ninfer.kernels.moe.gemm import moe_experts_triton
from ninfer.kernels.moe.quant_gemv import expert_gemv_candidates
from ninfer.kernels.moe.mma_configs import FORMATS as MMA_FORMATS
from ninfer.kernels.moe.mma_configs import expert_mma_candidates
from ninfer.quant.formats import QuantizedTensor, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E, TOP_K, H, I = 256, 8, 2048, 512


@pytest.fixture(scope="module", params=["int4-g64", "int8-g64", "nvfp4"])
def stacks(request) -> tuple[QuantizedTensor, QuantizedTensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, generator=g, device="cuda") * H ** -0.5
    down = torch.randn(E, H, I, generator=g, device="cuda") * I ** -0.5
    return quantize(gate_up, request.param), quantize(down, request.param)


def _down_configs(fmt: str, n: int) -> list:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mma = expert_mma_candidates(fmt, n * TOP_K, H, I, sms) if fmt in MMA_FORMATS else []
    return expert_gemv_candidates(fmt, n * TOP_K, H, I, sms) + mma


def _run(monkeypatch: pytest.MonkeyPatch, early: bool, *args, **kwargs) -> torch.Tensor:
    monkeypatch.setenv("NINFER_MOE_DOWN_EARLY", "1" if early else "0")
    return moe_experts_triton(*args, **kwargs)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_every_down_candidate_equals_the_plain_launch(monkeypatch: pytest.MonkeyPatch, stacks, n: int) -> None:
    gate_up, down = stacks
    g = torch.Generator(device="cuda").manual_seed(n)
    weights, ids = route_topk(torch.randn(n, E, generator=g, device="cuda").to(torch.bfloat16), TOP_K)
    x = torch.randn(n, H, generator=g, device="cuda").to(torch.bfloat16)
    for cfg in _down_configs(gate_up.format.name, n):
        plain = _run(monkeypatch, False, x, gate_up, down, weights, ids, path=cfg)
        early = torch.full_like(plain, float("nan"))
        early.copy_(_run(monkeypatch, True, x, gate_up, down, weights, ids, path=cfg))
        torch.cuda.synchronize()
        assert torch.isfinite(plain).all() and torch.equal(plain, early), (gate_up.format.name, n, cfg)


@pytest.mark.parametrize("n", [1, 8])
def test_captured_step_with_the_routing_inside(monkeypatch: pytest.MonkeyPatch, stacks, n: int) -> None:
    from ninfer.runtime.graphs import capture

    gate_up, down = stacks
    logits = torch.randn(n, E, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    for cfg in _down_configs(gate_up.format.name, n)[:2]:
        def step() -> torch.Tensor:
            weights, ids = route_topk(logits, TOP_K)
            return moe_experts_triton(x, gate_up, down, weights, ids, path=cfg)

        monkeypatch.setenv("NINFER_MOE_DOWN_EARLY", "1")
        step()
        graph, out = capture(step)
        for _ in range(3):
            logits.copy_(torch.randn_like(logits))
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            monkeypatch.setenv("NINFER_MOE_DOWN_EARLY", "0")
            assert torch.equal(out, step()), (gate_up.format.name, n, cfg)
            monkeypatch.setenv("NINFER_MOE_DOWN_EARLY", "1")
