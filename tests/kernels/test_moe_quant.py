"""Grouped expert GEMMs over quantized expert stacks (CPU interpreter) vs dequantize + the reference.

Every format of the dense quantized GEMM, each through the three ways programs find their rows:
alignment-free decode, aligned 16-row blocks (scales on the partial products) and aligned 64-row
blocks (scales on the dequantized tile). H and I are multiples of each format's group size but
mostly not of the K step, so ragged K steps run; routing leaves experts 0 and 5 without tokens and
sends most tokens to expert 3.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import expert_routing, expert_stacks, nan_experts

from ninfer.kernels.moe import gemm as moe_gemm
from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.moe import moe_experts, moe_experts_reference
from ninfer.kernels.moe.gemm import moe_experts_triton
from ninfer.quant.formats import QuantizedTensor

pytestmark = pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1")

E, K = 8, 2
SHAPES = {  # format: (H, I), multiples of the group size; int4-g128 takes the unmasked K loop
    "fp8": (192, 96), "fp8-b128": (192, 96), "int8-g32": (160, 96), "int8-g64": (192, 64),
    "int4-g64": (192, 64), "int4-g128": (256, 128), "nvfp4": (176, 48),
}
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
PATHS = {"direct": (3, {}), "aligned_16": (3, {"DIRECT_MAX_PAIRS": 0}),
         "aligned_64": (20, {"DIRECT_MAX_PAIRS": 0, "SKINNY_ROWS": 0})}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh float allocations are NaN and int ones -7, so anything read before it is written shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))




def _oracle(x: torch.Tensor, gate_up: QuantizedTensor, down: QuantizedTensor, weights: torch.Tensor,
            ids: torch.Tensor) -> torch.Tensor:
    """Dequantize the whole stacks, then the float reference in fp32."""
    return moe_experts_reference(x.float(), gate_up.dequantize(), down.dequantize(), weights.float(), ids.long())


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


# fp16 where the tile code differs (16- and 64-row tiles); aligned 16-row blocks only change where rows come from.
@pytest.mark.parametrize("path,dtype", [("direct", torch.float32), ("direct", torch.float16),
                                        ("aligned_16", torch.float32), ("aligned_64", torch.float32),
                                        ("aligned_64", torch.float16)])
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_quantized_experts_match_dequantized_reference(monkeypatch: pytest.MonkeyPatch, fmt: str, path: str,
                                                       dtype: torch.dtype) -> None:
    n, patches = PATHS[path]
    for name, value in patches.items():
        monkeypatch.setattr(moe_gemm, name, value)
    h, i = SHAPES[fmt]
    gate_up, down = expert_stacks(fmt, E, h, i)
    weights, ids = expert_routing(n, E, K)
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = moe_experts_triton(x, gate_up, down, weights.to(dtype), ids)
    assert got.shape == (n, h) and got.dtype == dtype and torch.isfinite(got).all()
    assert _err(got, _oracle(x, gate_up, down, weights, ids)) < TOL[dtype], (fmt, path, dtype)


@pytest.mark.parametrize("fmt", ["int4-g64", "nvfp4", "fp8-b128"])
@pytest.mark.parametrize("n", [5, 12, 40])  # 9, 23 (two 16-row tiles without alignment), 79 pairs on expert 6
def test_repeated_experts(fmt: str, n: int) -> None:
    """All tokens on one expert, and a token listing the same expert in both slots (hand-made int32 ids)."""
    h, i = SHAPES[fmt]
    gate_up, down = expert_stacks(fmt, E, h, i, seed=3)
    ids = torch.full((n, K), 6, dtype=torch.int32)
    ids[0, 1] = 2
    weights = torch.rand(n, K)
    x = torch.randn(n, h)
    got = moe_experts_triton(x, gate_up, down, weights, ids)
    assert _err(got, _oracle(x, gate_up, down, weights, ids)) < TOL[torch.float32]


@pytest.mark.parametrize("n", [3, 40])
def test_mixed_stacks_(n: int) -> None:
    """gate/up and down in different formats, and a quantized stack beside a float one."""
    h, i = 192, 64
    gate_up, _ = expert_stacks("int4-g64", E, h, i, seed=4)
    _, down = expert_stacks("nvfp4", E, h, i, seed=5)
    weights, ids = expert_routing(n, E, K, seed=6)
    x = torch.randn(n, h)
    got = moe_experts_triton(x, gate_up, down, weights, ids)
    assert _err(got, _oracle(x, gate_up, down, weights, ids)) < TOL[torch.float32]
    dense_down = down.dequantize()
    got = moe_experts_triton(x, gate_up, dense_down, weights, ids)
    ref = moe_experts_reference(x, gate_up.dequantize(), dense_down, weights, ids)
    assert _err(got, ref) < TOL[torch.float32]


@pytest.mark.parametrize("fmt", ["int8-g32", "nvfp4", "fp8", "fp8-b128"])
@pytest.mark.parametrize("path", list(PATHS))
def test_experts_without_tokens_are_never_read(monkeypatch: pytest.MonkeyPatch, fmt: str, path: str) -> None:
    """NaN in every scale of experts 0 and 5 (no tokens): the output is exactly the clean one."""
    n, patches = PATHS[path]
    for name, value in patches.items():
        monkeypatch.setattr(moe_gemm, name, value)
    h, i = SHAPES[fmt]
    stacks = expert_stacks(fmt, E, h, i, seed=9)
    weights, ids = expert_routing(n, E, K)
    assert not ((ids == 0) | (ids == 5)).any()
    poisoned = nan_experts(stacks, [0, 5])
    x = torch.randn(n, h)
    assert torch.equal(moe_experts_triton(x, *poisoned, weights, ids), moe_experts_triton(x, *stacks, weights, ids))


def test_reference_and_cpu_dispatch_dequantize_only_used_experts() -> None:
    """The quantized reference equals the reference on dequantized stacks, and is the CPU path."""
    gate_up, down = expert_stacks("int8-g32", E, 64, 32, seed=7)
    weights, ids = expert_routing(4, E, K, seed=8)
    x = torch.randn(4, 64)
    ref = moe_experts_reference(x, gate_up.dequantize(), down.dequantize(), weights, ids)
    assert torch.equal(moe_experts_reference(x, gate_up, down, weights, ids), ref)
    assert torch.equal(moe_experts(x, gate_up, down, weights, ids), ref)


def test_shape_errors() -> None:
    gate_up, down = expert_stacks("int8-g64", E, 128, 64)
    weights, ids = expert_routing(2, E, K)
    with pytest.raises(ValueError, match="do not fit H"):
        moe_experts_triton(torch.randn(2, 64), gate_up, down, weights, ids)
