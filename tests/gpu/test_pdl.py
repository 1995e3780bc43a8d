"""Programmatic dependent launch (ninfer.kernels.pdl) on the GPU: chains of decode GEMMs and norms whose
every input is the previous kernel's output, so a GEMM that read its activations (or wrote its split-K
scratch and counters) before its predecessor finished would give wrong numbers."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels import pdl
from ninfer.kernels.norms import rms_norm_reference, rms_norm_triton
from ninfer.kernels.quant_gemm import quant_matmul_reference, quant_matmul_triton
from ninfer.kernels.quant_gemm_tune import gemv_candidates, mma_candidates, sm_count
from ninfer.quant.formats import quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, FF = 5120, 17408


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, k, generator=g, device="cuda") * 0.02


def _layers(fmt: str, m: int) -> list:
    """(norm weight, gate/up weight and config, down weight and config) x 3, split-K configs included."""
    sms = sm_count(torch.device("cuda"))
    out = []
    for i in range(3):
        gate_up, down = quantize(_weight(2 * FF, H, 10 * i), fmt), quantize(_weight(H, FF, 10 * i + 1), fmt)
        pick = mma_candidates if (i % 2 and fmt.startswith("int4")) else gemv_candidates
        cfg_up = pick(fmt, m, FF, H, sms)[0]
        cfg_down = next((c for c in pick(fmt, m, H, FF, sms) if c.split_k > 1), pick(fmt, m, H, FF, sms)[0])
        out.append((torch.randn(H, device="cuda") * 0.1, gate_up, cfg_up, down, cfg_down))
    return out


def _chain(x: torch.Tensor, layers: list, triton_ops: bool) -> torch.Tensor:
    h = x.clone()
    for norm_w, gate_up, cfg_up, down, cfg_down in layers:
        if triton_ops:
            normed, _ = rms_norm_triton(h, norm_w, 1e-6)
            act = quant_matmul_triton(normed, gate_up, swiglu=True, config=cfg_up)
            h = quant_matmul_triton(act, down, h, config=cfg_down)
        else:
            normed, _ = rms_norm_reference(h, norm_w, 1e-6)
            gate, up = quant_matmul_reference(normed, gate_up).float().chunk(2, dim=-1)
            act = (torch.nn.functional.silu(gate) * up).to(h.dtype)
            h = quant_matmul_reference(act, down, h)
    return h


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "nvfp4"])
@pytest.mark.parametrize("m", [1, 8])
def test_dependent_chain_in_cuda_graph(fmt: str, m: int) -> None:
    assert pdl.pdl_enabled(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    layers = _layers(fmt, m)
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    eager = _chain(x, layers, True)
    ref = _chain(x, layers, False)
    err = ((eager.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 3e-2, err
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _chain(x, layers, True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    with torch.cuda.graph(graph):
        out = _chain(static_x, layers, True)
    for seed in range(3):  # fresh inputs each replay, the output poisoned before it
        static_x.copy_(torch.randn(m, H, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(
            device="cuda").manual_seed(seed)))
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, _chain(static_x, layers, True))  # replay = eager, bit for bit (deterministic)
