"""Routed experts reading rows whose norm was deferred (:class:`~ninfer.kernels.norms.NormedRows`), in the interpreter.

The expert GEMV and the expert register decode scale each pair's gate/up sums by its token row's factor (before
SwiGLU); the ``tl.dot`` path and float stacks read the rows materialized. Against the fp32 reference of the norm's
output through the dequantized stacks, and against the same path on the materialized rows; NaN-poisoned outputs.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import EXPERT_TOL, expert_routing, expert_stacks, poisoned_outputs  # noqa: F401  (fixture)

from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.moe import moe_experts_reference
from ninfer.kernels.moe.gemm import moe_experts_triton
from ninfer.kernels.moe.mma_configs import EXPERT_KSPLIT_KIND, EXPERT_MMA_KIND
from ninfer.kernels.norms import deferred_norm_reference, rms_norm_reference
from ninfer.kernels.quant_gemm.tune import GemmConfig

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]

H, I, E, K = 256, 128, 8, 2


def _check(fmt: str, dtype: torch.dtype, n: int, path, *, seed: int = 0, parts: int = 5) -> None:
    gate_up, down = expert_stacks(fmt, E, H, I, seed)
    weights, ids = expert_routing(n, E, K, seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    h = (torch.randn(n, H, generator=g) * 3).to(dtype)
    norm_w = (torch.randn(H, generator=g) * 0.3).to(dtype)
    normed, _ = deferred_norm_reference(h, norm_w, 1e-6, None, parts)
    got = moe_experts_triton(normed, gate_up, down, weights.to(dtype), ids, path=path)
    plain = moe_experts_triton(normed.materialize(), gate_up, down, weights.to(dtype), ids, path=path)
    ref = moe_experts_reference(rms_norm_reference(h.float(), norm_w.float(), 1e-6)[0], gate_up.dequantize(),
                                down.dequantize(), weights.float(), ids.long())
    assert got.shape == (n, H) and got.dtype == dtype and torch.isfinite(got).all(), (fmt, n, path)
    for want, tol in ((plain.double(), 3 * EXPERT_TOL[dtype]), (ref.double(), 2 * EXPERT_TOL[dtype] + 2e-3)):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < tol, (fmt, dtype, n, path, err)


def _gemv(block_m: int, split: int) -> GemmConfig:
    return GemmConfig(block_m, 32, 64, split, 4, 1, "gemv")


def _mma(warps: int, split: int) -> GemmConfig:
    return GemmConfig(8, 16 * warps, 128, split, warps, 1, EXPERT_MMA_KIND)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,cfg", [(1, _gemv(1, 1)), (5, _gemv(2, 2)), (1, _mma(4, 1)), (5, _mma(2, 2)),
                                   (13, _mma(4, 2)), (5, GemmConfig(8, 16, 64, 1, 2, 1, EXPERT_KSPLIT_KIND))],
                         ids=["gemv1", "gemv5-split", "mma1", "mma5-split", "mma13", "ksplit5"])
def test_expert_kernels_normalize_deferred_rows(n: int, cfg: GemmConfig, dtype: torch.dtype) -> None:
    _check("int4-g64", dtype, n, cfg, seed=n)


@pytest.mark.parametrize("mode", ["each", "across"])
def test_the_split_that_sums_applies_the_factors(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the fused split-K sum the expert register decode scales each pair's summed gate/up by its token row's
    factor in the split that sums, under both ways of summing."""
    monkeypatch.setenv("NINFER_SPLIT_SUM", mode)
    _check("int4-g64", torch.float32, 13, _mma(4, 3), seed=21, parts=9)
    _check("int4-g64", torch.float16, 5, _mma(2, 2), seed=22)


def test_other_paths_read_the_rows_materialized() -> None:
    _check("int8-g64", torch.float32, 3, "dot", seed=3)  # the tl.dot kernels
    _check("int4-g64", torch.float32, 3, "auto", seed=4, parts=13)  # untuned: the first GEMV candidate
