"""The MoE combine applying the norm that follows the block (CPU interpreter): the normed output and the new
residual stream against the combine's own output through the reference RMSNorm."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import poisoned_outputs  # noqa: F401  (fixture)
from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.moe import moe_experts_then_norm, route_topk_reference
from ninfer.kernels.moe.gemm import moe_experts_triton
from ninfer.kernels.norms import NextNorm, rms_norm_reference

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]

E, K, H, I = 8, 2, 64, 32
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def _block(n: int, dtype: torch.dtype, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(dtype)
    weights, ids = route_topk_reference(torch.randn(n, E, generator=g).to(dtype), K)
    x = torch.randn(n, H, generator=g).to(dtype)
    shared = (torch.randn(n, H, generator=g).to(dtype), (torch.randn(n, 1, generator=g) * 3).to(dtype))
    return x, gate_up, down, weights, ids, shared


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("with_shared", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
def test_the_combine_applies_the_next_norm(dtype: torch.dtype, n: int, with_shared: bool, with_residual: bool) -> None:
    x, gate_up, down, weights, ids, shared = _block(n, dtype, seed=n)
    shared = shared if with_shared else None
    residual = torch.randn(n, H).to(dtype) * 4 if with_residual else None
    w = (torch.randn(H) * 0.3).to(dtype)
    out = moe_experts_triton(x, gate_up, down, weights, ids, shared=shared)
    norm = NextNorm(w, 1e-6, residual, torch.empty_like(x))
    normed = moe_experts_triton(x, gate_up, down, weights, ids, shared=shared, norm=norm)
    ref, ref_res = rms_norm_reference(out, w, 1e-6, residual)
    assert torch.equal(norm.new_residual, ref_res)  # the combine's sum, plus the residual, rounded once
    assert normed.dtype == dtype and torch.isfinite(normed).all()
    torch.testing.assert_close(normed, ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_the_dispatch_off_cuda_is_the_reference_norm_of_the_reference_block() -> None:
    x, gate_up, down, weights, ids, shared = _block(3, torch.float32, seed=9)
    residual, w = torch.randn(3, H), torch.randn(H) * 0.3
    from ninfer.kernels.moe import moe_experts_reference

    normed, new_res = moe_experts_then_norm(x, gate_up, down, weights, ids, shared, w, 1e-6, residual)
    ref, ref_res = rms_norm_reference(moe_experts_reference(x, gate_up, down, weights, ids, shared), w, 1e-6, residual)
    assert torch.equal(normed, ref) and torch.equal(new_res, ref_res)
