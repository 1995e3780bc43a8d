"""Triton RMSNorm kernels (CPU interpreter) against the PyTorch references."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import assert_close, poisoned_outputs  # noqa: F401  (fixture)
from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.norms import gated_rms_norm_reference, gated_rms_norm_triton, rms_norm_reference, rms_norm_triton

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]

TOL = {torch.float32: 1e-6, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [300, 2500])  # whole row in registers / chunked two-pass (> 2048)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype: torch.dtype, width: int, with_residual: bool) -> None:
    x = torch.randn(13, width, dtype=dtype)
    residual = torch.randn(13, width, dtype=dtype) if with_residual else None
    weight = torch.randn(width) * 0.5
    out, new_res = rms_norm_triton(x, weight, 1e-6, residual)
    ref_out, ref_res = rms_norm_reference(x, weight, 1e-6, residual)
    assert_close(out, ref_out, TOL[dtype])
    if with_residual:
        assert torch.equal(new_res, ref_res)  # the sum is rounded to the dtype exactly as torch does
    else:
        assert new_res is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_head_rms_norm_on_strided_query_view(dtype: torch.dtype) -> None:
    # The query half of an interleaved [N, heads, 2 * dh] projection: rows are 2 * dh apart.
    q = torch.randn(7, 3, 2 * 64, dtype=dtype)[..., :64]
    weight = torch.randn(64).to(dtype)
    out, _ = rms_norm_triton(q, weight, 1e-6)
    assert_close(out, rms_norm_reference(q, weight, 1e-6)[0], TOL[dtype])
    # Leading dims beyond two are flattened.
    x = torch.randn(2, 3, 4, 64, dtype=dtype)
    assert_close(rms_norm_triton(x, weight, 1e-6)[0], rms_norm_reference(x, weight, 1e-6)[0], TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weight_dtype", ["same", "fp32"])
def test_gated_rms_norm_matches_reference(dtype: torch.dtype, weight_dtype: str) -> None:
    x = torch.randn(5, 4, 2 * 32, dtype=dtype)[..., :32]  # strided rows
    z = torch.randn(5, 4, 32, dtype=dtype) * 3
    weight = torch.rand(32) + 0.5
    weight = weight.to(dtype) if weight_dtype == "same" else weight
    out = gated_rms_norm_triton(x, z, weight, 1e-6)
    assert_close(out, gated_rms_norm_reference(x, z, weight, 1e-6), TOL[dtype])


def test_empty_input() -> None:
    x = torch.randn(0, 16)
    out, res = rms_norm_triton(x, torch.zeros(16), 1e-6, torch.randn(0, 16))
    assert out.shape == (0, 16) and res.shape == (0, 16)
