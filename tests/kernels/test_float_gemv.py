"""The float GEMV (:mod:`ninfer.kernels.float_gemv`) in the Triton interpreter, and its dispatch.

fp16 weights and activations against ``F.linear`` in fp32 on the same values: 1-17 tokens (a second 16-token tile
at 17), K ragged against the K step, output rows not a multiple of the row tile, split-K with the fused
reduction (arrival counters) and with the separate reduce kernel. Outputs and the split-K scratch are NaN-poisoned.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import assert_close, poisoned_outputs  # noqa: F401  (poisoned_outputs: a fixture)

from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.float_gemv import (
    CUBLAS,
    MAX_ROWS,
    float_gemv_candidates,
    float_linear,
    launch_float_gemv,
)
from ninfer.kernels.quant_gemm.gemv import reduce_kernel_for_splits
from ninfer.kernels.quant_gemm.tune import GemmConfig

interpreted = pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1")


def _cfg(block_n: int, block_k: int, split: int) -> GemmConfig:
    return GemmConfig(16, block_n, block_k, split, 4, 1, "float-gemv")


def _run(m: int, n_out: int, k: int, cfg: GemmConfig, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).half()
    w = (torch.randn(n_out, k, generator=g) * k ** -0.5).half()
    out = torch.empty(m, n_out, dtype=torch.float16)
    launch_float_gemv(x, w, out, cfg)
    assert_close(out.float(), F.linear(x.float(), w.float()), 2e-3)


@interpreted
@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("m", [1, 3, 16, 17])
@pytest.mark.parametrize("cfg", [_cfg(16, 64, 1), _cfg(32, 32, 3), _cfg(16, 32, 8)], ids=["whole-k", "split3", "split8"])
def test_matches_f_linear(m: int, cfg: GemmConfig) -> None:
    _run(m, 40, 208, cfg, seed=m)  # 40 rows: a partial row tile; K = 208: a partial K step in every config


@interpreted
@pytest.mark.usefixtures("poisoned_outputs")
def test_split_k_through_the_reduce_kernel() -> None:
    with reduce_kernel_for_splits():
        _run(5, 24, 160, _cfg(16, 32, 4), seed=1)


def test_candidates_put_cublas_first_and_split_to_fill_the_gpu() -> None:
    cands = float_gemv_candidates(1, 96, 5120, 132)
    assert cands[0] == CUBLAS and len(set(cands)) == len(cands)
    assert all(c.kind == "float-gemv" and 5120 // c.block_k >= 2 * c.split_k for c in cands[1:])
    assert max(c.split_k for c in cands[1:]) > 8  # 2-6 row tiles alone would leave most SMs idle


def test_cpu_tensors_and_large_weights_take_f_linear() -> None:
    x, w = torch.randn(3, 64), torch.randn(MAX_ROWS + 1, 64)
    assert torch.equal(float_linear(x, w), F.linear(x, w))
    assert torch.equal(float_linear(x, w[:8]), F.linear(x, w[:8]))


@interpreted
@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("cfg", [_cfg(16, 64, 1), _cfg(16, 32, 8)], ids=["whole-k", "split8"])
def test_deferred_rows_are_normalized(cfg: GemmConfig) -> None:
    """Rows whose norm was deferred (``NormedRows``): each token's product scaled by its row's factor, split or not,
    against ``F.linear`` of the norm's output; on CPU tensors the materialized rows."""
    from ninfer.kernels.norms import deferred_norm_reference, rms_norm_reference

    g = torch.Generator().manual_seed(7)
    h = (torch.randn(5, 208, generator=g) * 3).half()
    norm_w = (torch.randn(208, generator=g) * 0.3).half()
    w = (torch.randn(40, 208, generator=g) * 208 ** -0.5).half()
    normed, _ = deferred_norm_reference(h, norm_w, 1e-6, None, 13)
    out = torch.empty(5, 40, dtype=torch.float16)
    launch_float_gemv(normed.scaled, w, out, cfg, normed)
    want = F.linear(rms_norm_reference(h, norm_w, 1e-6)[0].float(), w.float())
    assert_close(out.float(), want, 4e-3)
    with pytest.raises(ValueError, match="cuBLAS"):
        launch_float_gemv(normed.scaled, w, out, CUBLAS, normed)
    assert torch.equal(float_linear(normed, w), F.linear(normed.materialize(), w))
