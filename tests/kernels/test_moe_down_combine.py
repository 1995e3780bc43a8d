"""The routed experts' down projection and combine in one launch (:mod:`ninfer.kernels.moe.down_combine`) in the
Triton interpreter: every quantized format, fp32 and fp16 activations, 1..8 tokens, with and without the shared
expert, the norm and its residual, every candidate config, against dequantize + ``moe_experts_reference`` (and the
reference norm). H is not a multiple of the column tiles and some intermediate sizes are not of the K steps (ragged
tiles and steps); outputs are NaN-poisoned."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import EXPERT_TOL, expert_routing, expert_stacks, poisoned_outputs  # noqa: F401

from ninfer.kernels.counters import arrival_counters
from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.moe import down_combine as dc
from ninfer.kernels.moe import moe_experts_reference
from ninfer.kernels.moe.gemm import moe_experts_triton
from ninfer.kernels.norms import NextNorm, rms_norm_reference
from ninfer.kernels.quant_gemm.common import FMT_CODES

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]

E, K = 8, 4
SHAPES = {  # format: (H, I); H of 160 / 176 / 104 leaves ragged column tiles, I of 96 / 48 ragged K steps
    "int4-g64": (192, 128), "int4-g128": (256, 128), "int8-g64": (192, 64), "int8-g32": (160, 96),
    "nvfp4": (176, 48), "fp8": (104, 96), "fp8-b128": (192, 96),
}


@pytest.fixture
def switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_MOE_DOWN_COMBINE", "1")


def _block(fmt: str, n: int, dtype: torch.dtype, seed: int) -> tuple:
    h, i = SHAPES[fmt]
    gate_up, down = expert_stacks(fmt, E, h, i, seed)
    weights, ids = expert_routing(n, E, K, seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(n, h, generator=g).to(dtype)
    shared = (torch.randn(n, h, generator=g).to(dtype), (torch.randn(n, 1, generator=g) * 3).to(dtype))
    return x, gate_up, down, weights.to(dtype), ids, shared


def _reference(x, gate_up, down, weights, ids, shared) -> torch.Tensor:
    shared = (shared[0].float(), shared[1].float()) if shared is not None else None
    return moe_experts_reference(x.float(), gate_up.dequantize(), down.dequantize(), weights.float(), ids.long(),
                                 shared)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and torch.isfinite(got).all()
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < EXPERT_TOL[dtype] * (1 if dtype == torch.float32 else 2), err


@pytest.mark.usefixtures("switched_on")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_the_fused_launch_matches_the_reference_block(fmt: str, dtype: torch.dtype,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``moe_experts_triton`` (the first candidate, as the interpreter takes it): the down GEMV and the
    combine kernel must not run."""
    launched = []
    monkeypatch.setattr(dc, "_down_combine_kernel", _counting(dc._down_combine_kernel, launched))
    for n, with_shared in ((1, True), (3, False), (8, True)):
        x, gate_up, down, weights, ids, shared = _block(fmt, n, dtype, seed=n)
        shared = shared if with_shared else None
        got = moe_experts_triton(x, gate_up, down, weights, ids, shared=shared)
        _close(got, _reference(x, gate_up, down, weights, ids, shared), dtype)
    assert len(launched) == 3


def _counting(kernel, launched: list):
    class Counting:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]
    return Counting()


@pytest.mark.parametrize("fmt", list(SHAPES))
def test_every_candidate_with_the_norm(fmt: str) -> None:
    """Each candidate config pinned, the norm with and without a residual: the new residual stream and the normed
    output against the reference block through the reference norm; the arrival counters are left at zero."""
    n = 3
    x, gate_up, down, weights, ids, shared = _block(fmt, n, torch.float32, seed=7)
    ref_block = _reference(x, gate_up, down, weights, ids, shared)
    h, i = SHAPES[fmt]
    inter = torch.nn.functional.silu(torch.randn(n * K, i))  # any SwiGLU rows: the reference takes them too
    rw = weights.reshape(-1).contiguous()
    ref_down = torch.zeros(n, h)
    dq = down.dequantize()
    for t in range(n):
        for j in range(K):
            ref_down[t] += rw[t * K + j] * (dq[ids[t, j]] @ inter[t * K + j])
    ref_down += torch.sigmoid(shared[1]) * shared[0]
    assert ref_block.shape == ref_down.shape
    w = torch.randn(h) * 0.3
    for cfg in dc.down_combine_candidates(fmt, i):
        for residual in (torch.randn(n, h) * 4, None):
            norm = NextNorm(w, 1e-6, residual, torch.empty(n, h))
            out = torch.empty(n, h)
            assert dc.launch_down_combine(inter, down, rw, ids.contiguous(), shared, norm, out, cfg)
            ref, ref_res = rms_norm_reference(ref_down, w, 1e-6, residual)
            torch.testing.assert_close(norm.new_residual, ref_res, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        plain = torch.empty(n, h)
        assert dc.launch_down_combine(inter, down, rw, ids.contiguous(), shared, None, plain, cfg)
        torch.testing.assert_close(plain, ref_down, atol=1e-4, rtol=1e-4)
    assert not arrival_counters(torch.device("cpu")).any()


@pytest.mark.usefixtures("switched_on")
def test_the_block_then_norm_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from ninfer.kernels.moe import moe_experts_then_norm

    x, gate_up, down, weights, ids, shared = _block("int4-g64", 2, torch.float16, seed=3)
    residual, w = torch.randn(2, x.shape[1]).half(), (torch.randn(x.shape[1]) * 0.3).half()
    normed, new_res = moe_experts_then_norm(x, gate_up, down, weights, ids, shared, w, 1e-6, residual)
    ref, ref_res = rms_norm_reference(_reference(x, gate_up, down, weights, ids, shared), w.float(), 1e-6,
                                      residual.float())
    _close(new_res, ref_res, torch.float16)
    _close(normed, ref, torch.float16)


def test_off_by_default_and_its_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    x, gate_up, down, weights, ids, shared = _block("int4-g64", 2, torch.float32, seed=4)
    monkeypatch.delenv("NINFER_MOE_DOWN_COMBINE", raising=False)
    assert not dc.down_combine_applies(down, 2, torch.float32)
    monkeypatch.setenv("NINFER_MOE_DOWN_COMBINE", "1")
    assert dc.down_combine_applies(down, 2, torch.float32)
    assert not dc.down_combine_applies(down, dc.MAX_TOKENS + 1, torch.float32)
    assert not dc.down_combine_applies(down.dequantize(), 2, torch.float32)
    assert not dc.down_combine_applies(down, 2, torch.int32)
    monkeypatch.setenv("NINFER_MOE_DOWN_COMBINE", "maybe")
    with pytest.raises(ValueError, match="NINFER_MOE_DOWN_COMBINE"):
        dc.down_combine_applies(down, 2, torch.float32)


@pytest.mark.usefixtures("switched_on")
def test_a_pinned_path_keeps_the_two_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """``path`` pins the expert GEMMs (tests, benchmarks): the fused launch would bypass the pinned down GEMM."""
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fused down-combine ran")

    monkeypatch.setattr("ninfer.kernels.moe.gemm.down_combine", fail)
    x, gate_up, down, weights, ids, shared = _block("int8-g64", 2, torch.float32, seed=5)
    got = moe_experts_triton(x, gate_up, down, weights, ids, shared=shared, path="gemv")
    _close(got, _reference(x, gate_up, down, weights, ids, shared), torch.float32)


def test_candidates_cover_every_format() -> None:
    for fmt in FMT_CODES:
        cands = dc.down_combine_candidates(fmt, 512)
        assert cands and len(set(cands)) == len(cands)
        assert all(c.block_n <= 32 and c.num_warps <= 8 for c in cands)
        assert any(c.kind == dc.WORDS_KIND for c in cands) == fmt.startswith("int4")
