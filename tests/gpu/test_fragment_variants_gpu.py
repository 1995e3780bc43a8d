"""Two variants of the register decode on the GPU: its codes copied into shared memory by the loop's ``cp.async``
pipeline (``num_stages >= 3``: :func:`~ninfer.kernels.quant_gemm.fragment_configs.fragment_async_candidates`), and K
split over a program's warps (``kind="frag-ksplit"``: :func:`.fragment_configs.fragment_ksplit_candidates`), at
the 27B and 35B-A3B shapes, against the fp32 dequantize-then-matmul reference of the row-major weight: fresh random
inputs, NaN-poisoned outputs, every config of each at 1, 4, 8 and 29 tokens, int4 (g64 / g128), int8-g64 and nvfp4,
bf16, plain / residual / SwiGLU; a captured graph replayed bit-equal to eager, and right after new inputs are copied
in."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import fragment_laid, graph_replay_matches

from ninfer.kernels.quant_gemm import quant_matmul_reference, quant_matmul_triton
from ninfer.kernels.quant_gemm.fragment_configs import fragment_async_candidates, fragment_ksplit_candidates
from ninfer.kernels.quant_gemm.tune import sm_count
from ninfer.quant.formats import quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
BF16_TOL = 1.5e-2  # relative Frobenius error of a bf16 output (as tests/gpu/test_quant_fragments_gpu.py)
CASES = [("gate_up", 2 * 17408, 5120, True, False), ("down", 5120, 17408, False, True),
         ("35b_qkvz", 12288, 2048, False, False), ("35b_out_proj", 2048, 4096, False, True)]


def _candidates(family: str, fmt: str, m: int, n_out: int, k: int) -> list:
    if family == "async":
        return fragment_async_candidates(fmt, m, n_out, k, sm_count(CUDA))
    return fragment_ksplit_candidates(fmt, m, n_out, k)


@pytest.mark.parametrize("family", ["async", "ksplit"])
@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "int8-g64", "nvfp4"])
def test_every_candidate(family: str, fmt: str) -> None:
    for name, n, k, swiglu, residual in CASES:
        g = torch.Generator(device="cuda").manual_seed(len(name))
        rows = quantize(torch.randn(n, k, generator=g, device="cuda") * 0.02, fmt)
        frag = fragment_laid(rows)
        n_out = n // 2 if swiglu else n
        for m in (1, 4, 8, 29):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16) if residual else None
            ref = quant_matmul_reference(x.float(), rows, None if res is None else res.float(), swiglu).float()
            cands = _candidates(family, fmt, m, n_out, k)
            assert cands, (family, fmt, name, m)
            for cfg in cands:
                out = torch.full((m, n_out), float("nan"), device="cuda", dtype=torch.bfloat16)
                got = quant_matmul_triton(x, frag, res, swiglu, out=out, config=cfg).float()
                err = ((got - ref).norm() / ref.norm()).item()
                assert torch.isfinite(got).all() and err < BF16_TOL, (fmt, name, m, cfg, err)
        del rows, frag


@pytest.mark.parametrize("family", ["async", "ksplit"])
@pytest.mark.parametrize("fmt", ["int4-g64", "nvfp4"])
def test_in_cuda_graph_bit_equal_to_eager(family: str, fmt: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    frag = fragment_laid(quantize(torch.randn(5120, 17408, generator=g, device="cuda") * 0.02, fmt))
    cands = _candidates(family, fmt, 4, 5120, 17408)
    for cfg in [c for c in cands if c.split_k > 1][:1] + [c for c in cands if c.split_k == 1][:1]:
        x = torch.randn(4, 17408, device="cuda", dtype=torch.bfloat16)
        graph_replay_matches(frag, cfg, x, torch.randn(4, 5120, device="cuda", dtype=torch.bfloat16))
