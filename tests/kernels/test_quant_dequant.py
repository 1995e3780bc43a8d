"""The whole-weight dequantization kernel and the dequantize-then-cuBLAS GEMM path, in the interpreter.

The kernel must reproduce ``QuantizedTensor.dequantize`` in the output dtype bit for bit (it forms the
fp32 products in the reference's order, row scales included); the GEMM path must
match ``quant_matmul_reference`` with the tolerances of test_quant_gemm. Shapes are ragged: N not a
multiple of BLOCK_N, K (a multiple of the format's group size) not a multiple of BLOCK_K.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import QUANT_FORMATS as FORMATS, QUANT_K_FOR as K_FOR, QUANT_TOL as TOL

from ninfer.kernels.quant_gemm import dequant as quant_dequant
from ninfer.kernels.quant_gemm.dequant import dequantize_triton, graph_workspace_fits, workspace, workspace_bytes
from ninfer.kernels.quant_gemm.fragments import FRAGMENTS
from ninfer.kernels.quant_gemm import quant_matmul_reference, quant_matmul_triton
from ninfer.kernels.quant_gemm.tune import (
    DEQUANT_MAX_ELEMENTS,
    GemmConfig,
    candidates,
    graph_candidates,
    kernel_params,
)
from ninfer.quant.formats import quantize

SMALL = GemmConfig(32, 16, 128, 1, 4, 1, "dequant")  # block_k 128: a partial last K tile but for int4-g128


def _assert_exact(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert not got.isnan().any(), "tiles left unwritten"
    bad = got != ref
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} values differ, e.g. {got[bad][:4]} vs {ref[bad][:4]}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cfg", [SMALL, GemmConfig(32, 32, 256, 1, 4, 1, "dequant")], ids=["16x128", "32x256"])
def test_dequant_kernel_matches_reference(fmt: str, dtype: torch.dtype, cfg: GemmConfig) -> None:
    g = torch.Generator().manual_seed(0)
    n, k = 40, K_FOR[fmt]
    w = quantize(torch.randn(n, k, generator=g) * 0.05, fmt)
    out = torch.full((n, k), float("nan"), dtype=dtype)
    got = dequantize_triton(w, out, cfg)
    assert got.data_ptr() == out.data_ptr()
    _assert_exact(got, w.dequantize(dtype))


def test_dequant_kernel_row_blocks_and_strided_out() -> None:
    """fp8-b128 with N past one 128-row scale block, into a wider buffer (row stride > K)."""
    g = torch.Generator().manual_seed(1)
    w = quantize(torch.randn(300, 200, generator=g), "fp8-b128")
    buf = torch.full((300, 256), float("nan"))
    dequantize_triton(w, buf[:, :200], GemmConfig(32, 64, 128, 1, 4, 1, "dequant"))
    _assert_exact(buf[:, :200], w.dequantize(torch.float32))
    assert buf[:, 200:].isnan().all()


def _check_gemm(fmt: str, dtype: torch.dtype, m: int, n: int, *, swiglu: bool, residual: bool, alias: bool,
                seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    k = K_FOR[fmt]
    w = quantize(torch.randn(n, k, generator=g) * 0.05, fmt)
    x = torch.randn(m, k, generator=g).to(dtype)
    n_out = n // 2 if swiglu else n
    res = torch.randn(m, n_out, generator=g).to(dtype) if residual else None
    ref = quant_matmul_reference(x, w, res, swiglu).float()
    out = res if alias else torch.full((m, n_out), float("nan"), dtype=dtype)
    got = quant_matmul_triton(x, w, res, swiglu, out=out, config=SMALL)
    assert got.data_ptr() == out.data_ptr()
    err = (got.float() - ref).norm() / ref.norm()
    assert err < TOL[dtype], f"{fmt} {dtype} swiglu={swiglu} residual={residual}: relative error {err:.2e}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequant_path_swiglu_residual_in_place(fmt: str, dtype: torch.dtype) -> None:
    _check_gemm(fmt, dtype, m=37, n=80, swiglu=True, residual=True, alias=True, seed=2)


@pytest.mark.parametrize("fmt", ["int4-g64", "nvfp4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("swiglu", "residual", "alias"),
                         [(False, False, False), (False, True, False), (False, True, True), (True, False, False),
                          (True, True, False)])
def test_dequant_path_epilogues(fmt: str, dtype: torch.dtype, swiglu: bool, residual: bool, alias: bool) -> None:
    _check_gemm(fmt, dtype, m=21, n=72, swiglu=swiglu, residual=residual, alias=alias, seed=3)


def test_dequant_path_leading_dims_and_workspace_reuse() -> None:
    quant_dequant.release_workspaces()
    g = torch.Generator().manual_seed(4)
    big = quantize(torch.randn(64, 256, generator=g), "int8-g64")
    small = quantize(torch.randn(24, 128, generator=g), "int4-g64")
    x = torch.randn(2, 9, 256, generator=g).to(torch.float16)
    got = quant_matmul_triton(x, big, swiglu=True, config=SMALL)
    assert got.shape == (2, 9, 32)
    ref = quant_matmul_reference(x, big, swiglu=True).float()
    assert (got.float() - ref).norm() / ref.norm() < TOL[torch.float16]
    buf = workspace(1, 1, torch.float16, x.device)
    got = quant_matmul_triton(x[..., :128], small, config=SMALL)  # smaller weight: same buffer, no growth
    ref = quant_matmul_reference(x[..., :128], small).float()
    assert (got.float() - ref).norm() / ref.norm() < TOL[torch.float16]
    assert workspace(64, 256, torch.float16, x.device).data_ptr() == buf.data_ptr()
    assert workspace(65, 256, torch.float16, x.device).numel() == 65 * 256  # grows
    quant_dequant.release_workspaces()


def test_a_captured_workspace_never_grows_and_outlives_growth() -> None:
    """A launch a CUDA graph captures (``captured=True``) takes the buffer only if it already holds the weight,
    and keeps it alive: a later growth or release must not free memory a graph writes."""
    quant_dequant.release_workspaces()
    cpu = torch.device("cpu")
    assert not graph_workspace_fits(8, 64, torch.float16, cpu)
    with pytest.raises(ValueError, match="may not grow"):
        workspace(8, 64, torch.float16, cpu, captured=True)
    buf = workspace(16, 64, torch.float16, cpu)
    assert graph_workspace_fits(8, 64, torch.float16, cpu) and not graph_workspace_fits(32, 64, torch.float16, cpu)
    captured = workspace(8, 64, torch.float16, cpu, captured=True)
    assert captured.data_ptr() == buf.data_ptr() and captured.shape == (8, 64)
    assert workspace(32, 64, torch.float16, cpu).data_ptr() != buf.data_ptr()  # grown: a new buffer
    quant_dequant.release_workspaces()
    assert any(kept.data_ptr() == buf.data_ptr() for kept in quant_dequant._KEPT)  # the captured one lives on
    quant_dequant._KEPT.clear()


def test_graphs_time_the_dequantization_only_where_its_workspace_holds_the_weight() -> None:
    for layout, m in (("rows", 128), (FRAGMENTS, 128), (FRAGMENTS, 4096)):
        without = graph_candidates("int4-g64", m, 5120, 17408, 132, layout=layout)
        with_ws = graph_candidates("int4-g64", m, 5120, 17408, 132, layout=layout, dequant=True)
        assert "dequant" not in {c.kind for c in without} and "dequant" in {c.kind for c in with_ws}, (layout, m)
        assert with_ws[0] == without[0] and with_ws[0].kind != "dequant"  # the untuned favourite stays
    lm_head = graph_candidates("int8-g64", 128, 248320, 5120, 132, layout=FRAGMENTS, dequant=True)
    assert "dequant" not in {c.kind for c in lm_head}  # too large for the workspace


def test_candidates_offer_dequant_last_and_only_for_prefill() -> None:
    for fmt in FORMATS:
        for m in (1, 8, 16, 17, 64, 512, 4096):
            cands = candidates(fmt, m, 5120, 17408, 132)
            kinds = [c.kind for c in cands]
            assert kinds[0] == "dot"
            assert ("dequant" in kinds) == (m > 16), (fmt, m, kinds)
            if m > 16:
                first = kinds.index("dequant")
                assert all(kind == "dequant" for kind in kinds[first:])  # after every tiled config
            assert all(kernel_params(fmt, c) for c in cands)
    # Stacked gate/up weights count both halves; the LM head stays on the tiled path.
    assert any(c.kind == "dequant" for c in candidates("int4-g64", 512, 17408, 5120, 132, swiglu=True))
    assert not any(c.kind == "dequant" for c in candidates("int4-g64", 512, 248320, 5120, 132))
    assert not any(c.kind == "dequant" for c in candidates("nvfp4", 512, 40000, 5120, 132, swiglu=True))


def test_workspace_bytes_counts_the_largest_eligible_weight() -> None:
    shapes = [(34816, 5120), (5120, 17408), (248320, 5120), (8, 2, 4)]
    assert workspace_bytes(shapes, torch.bfloat16) == 34816 * 5120 * 2
    assert workspace_bytes([(248320, 5120)], torch.bfloat16) == 0
    assert 34816 * 5120 <= DEQUANT_MAX_ELEMENTS < 248320 * 5120
