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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sigmoid_gated_add_matches_reference(dtype: torch.dtype) -> None:
    """The MoE shared expert's ``routed + sigmoid(g) * shared``: one launch, the reference's rounding; the
    gate is a strided column (a view of the stacked router / gate GEMM's output) and 1500 columns take
    two blocks and a tail."""
    from ninfer.kernels.activations import sigmoid_gated_add_reference, sigmoid_gated_add_triton

    base, x = torch.randn(5, 1500, dtype=dtype), torch.randn(5, 1500, dtype=dtype)
    gate = (torch.randn(5, 9, dtype=dtype) * 3)[:, 8:]  # [5, 1], rows 9 apart
    out, ref = sigmoid_gated_add_triton(base, gate, x), sigmoid_gated_add_reference(base, gate, x)
    assert out.shape == ref.shape and out.dtype == dtype and torch.isfinite(out).all()
    err = (out.double() - ref.double()).norm() / ref.double().norm()
    assert err < TOL[dtype], f"relative error {err:.2e}"


def test_sigmoid_gated_add_rejects_mismatched_shapes() -> None:
    from ninfer.kernels.activations import sigmoid_gated_add_triton

    with pytest.raises(ValueError, match="want"):
        sigmoid_gated_add_triton(torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(2, 8))
