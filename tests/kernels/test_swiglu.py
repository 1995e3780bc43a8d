"""Triton SwiGLU (CPU interpreter) against the PyTorch reference."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels.activations import swiglu_reference, swiglu_triton
from kernel_testing import assert_close, poisoned_outputs  # noqa: F401  (fixture)
from ninfer.kernels.dispatch import INTERPRET

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]

TOL = {torch.float32: 1e-6, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 2 * 1500), (2, 3, 2 * 40)])  # two column blocks, one tail; 3-D
def test_swiglu_matches_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gate_up = torch.randn(shape, dtype=dtype) * 3
    out, ref = swiglu_triton(gate_up), swiglu_reference(gate_up)
    assert out.shape == ref.shape and out.dtype == dtype and torch.isfinite(out).all()
    err = (out.double() - ref.double()).norm() / ref.double().norm()
    assert err < TOL[dtype], f"relative error {err:.2e}"


def test_swiglu_on_strided_rows() -> None:
    gate_up = torch.randn(4, 3 * 64)[:, :128]  # rows 192 apart
    out, ref = swiglu_triton(gate_up), swiglu_reference(gate_up)
    assert ((out - ref).norm() / ref.norm()) < 1e-6
