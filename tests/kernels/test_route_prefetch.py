"""``NINFER_ROUTE_PREFETCH=1``: the MoE routing at decode sizes asks the L2 for the chosen experts' gate/up bytes
(:mod:`ninfer.kernels.moe.routing`). On CPU: how a call shares the lines out (programs per token, lines per lane,
the regions of a quantized stack), where it does not prefetch, and that the routing is the same with a stack
given (the interpreter runs no PTX, so it never prefetches there). The GPU test checks the prefetching launch."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import repeated_expert_stack

from ninfer.kernels.moe import routing
from ninfer.kernels.moe.routing import (
    PREFETCH_MAX_TOKENS,
    _prefetch_args,
    route_topk_reference,
    route_topk_triton,
)


def test_lines_are_shared_out_over_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routing, "INTERPRET", False)
    monkeypatch.setenv("NINFER_ROUTE_PREFETCH", "1")
    stack = repeated_expert_stack(16, 64, 256)
    dummy = torch.empty(1)
    programs, args, lines = _prefetch_args(stack, 1, 4, 16, dummy)
    codes, scales = stack.tensors["qweight"], stack.tensors["scales"]
    assert args[:3] == [codes, codes.stride(0), codes[0].numel()]  # the largest region first
    assert args[3:] == [scales, scales.stride(0) * 2, scales[0].numel() * 2]
    code_lines = 4 * (64 * 128 // 128)  # 4 experts x 64 rows of 128 bytes
    assert programs == max(1, -(-code_lines // (32 * routing.PREFETCH_LINES_PER_LANE)))
    assert lines["LINES_A"] * 32 * programs >= code_lines > (lines["LINES_A"] - 1) * 32 * programs
    assert lines["LINES_B"] >= 1


@pytest.mark.parametrize("why", ["switch off", "too many tokens", "other expert count", "interpreter"])
def test_no_prefetch(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    monkeypatch.setattr(routing, "INTERPRET", why == "interpreter")
    monkeypatch.setenv("NINFER_ROUTE_PREFETCH", "0" if why == "switch off" else "1")
    n = PREFETCH_MAX_TOKENS + 1 if why == "too many tokens" else 1
    e = 8 if why == "other expert count" else 16
    programs, _, lines = _prefetch_args(repeated_expert_stack(16, 64, 256), n, 4, e, torch.empty(1))
    assert programs == 1 and not lines


def test_the_routing_is_the_same_with_a_stack_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_ROUTE_PREFETCH", "1")
    logits = torch.randn(3, 16)
    weights, ids = route_topk_triton(logits, 4, repeated_expert_stack(16, 64, 256))
    ref_w, ref_ids = route_topk_reference(logits, 4)
    assert torch.equal(ids, ref_ids) and torch.allclose(weights, ref_w, rtol=1e-6, atol=1e-7)
