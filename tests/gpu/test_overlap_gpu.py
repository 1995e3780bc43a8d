"""Launches on the side stream of :mod:`ninfer.kernels.overlap` inside a CUDA graph: two split-K register decodes
that finish their reductions through arrival counters, one on each stream, so that the graph may run them at
once; the graph's replays must equal an eager run in place (fresh random inputs each replay)."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_graph_replays_eager, fragment_laid

from ninfer.kernels.overlap import overlapped, wait_for
from ninfer.kernels.quant_gemm import QuantizedTensor, quant_matmul_triton
from ninfer.kernels.quant_gemm.tune import GemmConfig, fragment_candidates, sm_count
from ninfer.quant.formats import quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _fragment_weight(n: int, k: int, seed: int) -> QuantizedTensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return fragment_laid(quantize(torch.randn(n, k, generator=g, device="cuda") * 0.02, "int8-g64"))


def _split_config(m: int, n_out: int, k: int, swiglu: bool) -> GemmConfig:
    split = [c for c in fragment_candidates("int8-g64", m, n_out, k, sm_count(torch.device("cuda")), swiglu=swiglu)
             if c.split_k > 1]
    assert split, (m, n_out, k)
    return split[0]


@pytest.mark.parametrize("m", [1, 4, 8])
def test_split_k_decodes_on_two_streams_in_one_graph(m: int) -> None:
    """The 35B-A3B shared expert's gate/up (SwiGLU) on the side stream beside an 8 MB projection on the current
    one, both split over K; then a down projection of the side's output on the side stream again."""
    hidden, inter = 2048, 512
    gate_up, down, proj = (_fragment_weight(2 * inter, hidden, 1), _fragment_weight(hidden, inter, 2),
                           _fragment_weight(4096, hidden, 3))
    cfg_gate_up, cfg_down = _split_config(m, inter, hidden, True), _split_config(m, hidden, inter, False)
    cfg_proj = _split_config(m, 4096, hidden, False)
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    forked: list[bool] = []

    def shared_expert() -> torch.Tensor:
        h = quant_matmul_triton(x, gate_up, None, True, config=cfg_gate_up)
        return quant_matmul_triton(h, down, config=cfg_down)

    def step() -> torch.Tensor:
        side = overlapped(shared_expert, x)
        forked.append(side.forked)
        main = quant_matmul_triton(x, proj, config=cfg_proj)
        return torch.cat([main, wait_for(side)], dim=1)

    step()
    assert forked == [False]  # eager: in place
    assert_graph_replays_eager(step, [x], label=m, replays=3)
    assert forked[1:3] == [True, True]  # the capture's warm-up run and the capture itself forked
