"""The float GEMV (:mod:`ninfer.kernels.float_gemv`) on the GPU at the real shapes in bf16: every candidate against
``F.linear`` in fp32 (outputs NaN-poisoned), split-K through the arrival counters and the reduce kernel, graph
replays equal to eager calls; and the tuned ``float_linear`` equal to the config it chose."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import assert_close, assert_graph_replays_eager

from ninfer.kernels.float_gemv import TABLE, float_gemv_candidates, float_linear, launch_float_gemv
from ninfer.kernels.quant_gemm.gemv import reduce_kernel_for_splits
from ninfer.kernels.quant_gemm.tune import sm_count
from ninfer.kernels.tuning import TunerState, use_tuner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")
SHAPES = {"27b_in_proj_ab": (96, 5120), "35b_router": (257, 2048), "35b_in_proj_ab": (64, 2048)}


def _inputs(m: int, n_out: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n_out, k, generator=g, device="cuda") * k ** -0.5).bfloat16()
    return x, w


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", [1, 4, 8, 16])
def test_every_candidate_matches_f_linear(shape: str, m: int) -> None:
    n_out, k = SHAPES[shape]
    x, w = _inputs(m, n_out, k, seed=m)
    ref = F.linear(x.float(), w.float())
    for cfg in float_gemv_candidates(m, n_out, k, sm_count(CUDA)):
        for separate_reduce in (False, True):
            out = torch.full((m, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
            if separate_reduce:
                with reduce_kernel_for_splits():
                    launch_float_gemv(x, w, out, cfg)
            else:
                launch_float_gemv(x, w, out, cfg)
            assert_close(out.float(), ref, 1e-2)


@pytest.mark.parametrize("m", [1, 4])
def test_graph_replays_equal_eager_calls(m: int) -> None:
    n_out, k = SHAPES["27b_in_proj_ab"]
    x, w = _inputs(m, n_out, k, seed=3)
    out = torch.empty(m, n_out, dtype=torch.bfloat16, device="cuda")
    for cfg in [c for c in float_gemv_candidates(m, n_out, k, sm_count(CUDA)) if c.split_k > 1][:2]:
        def step(cfg=cfg) -> torch.Tensor:
            launch_float_gemv(x, w, out, cfg)
            return out.clone()
        step()
        assert_graph_replays_eager(step, [x], label=cfg)


def test_the_tuned_call_times_both_paths_and_keeps_its_choice() -> None:
    n_out, k = SHAPES["35b_router"]
    x, w = _inputs(4, n_out, k, seed=5)
    with use_tuner(TunerState()) as tuner:
        y = float_linear(x, w)
        (key, cfg), = tuner.chosen(TABLE).items()
        assert len(tuner.timings(TABLE)[key]) == len(float_gemv_candidates(4, n_out, k, sm_count(CUDA)))
        out = torch.empty_like(y)
        launch_float_gemv(x, w, out, cfg)
        assert torch.equal(y, out)
        print(f"router 257 x 2048 at 4 rows: {cfg}")
