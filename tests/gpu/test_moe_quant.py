"""Grouped expert GEMMs over quantized stacks on the GPU, Qwen3.5-35B-A3B shapes, vs dequantize + the fp32 reference.

Run: ``python -m pytest -m gpu tests/gpu/test_moe_quant.py``. Most tests pin each tuner to its first
config (fewer compilations; that config is also the one that must fit an RTX 5090's 99 KB of shared
memory, checked on the compiled kernels); ``test_every_config`` covers the others. Those tests pin
the ``tl.dot`` kernels (``NINFER_MOE_PATH=dot``); the ``test_expert_gemv_*`` tests
cover the decode GEMV of :mod:`ninfer.kernels.moe.quant_gemv` (every candidate, CUDA graphs) and
the measured selection between the two.
"""
from __future__ import annotations

import pytest
import torch
import triton
from kernel_testing import assert_graph_replays_eager

from ninfer.kernels.moe import gemm as moe_gemm
from ninfer.kernels.moe import quant_gemm as moe_quant_gemm
from ninfer.kernels.moe import quant_gemv as moe_quant_gemv
from ninfer.kernels.moe import (
    moe_experts,
    moe_experts_reference,
    route_topk,
    route_topk_reference,
)
from ninfer.kernels.moe.gemm import moe_experts_triton
from ninfer.kernels.tuning import TunerState, use_tuner
from ninfer.quant.formats import QuantizedTensor, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E, TOP_K, H, I = 256, 8, 2048, 512
FORMATS = ["int4-g64", "int4-g128", "int8-g32", "int8-g64", "nvfp4", "fp8", "fp8-b128"]
TOL = {torch.bfloat16: 1.5e-2, torch.float32: 1e-5}  # relative Frobenius error of the output
TUNERS = {"direct": moe_quant_gemm._gemm_direct, "skinny": moe_quant_gemm._gemm_skinny,
          "tiled": moe_quant_gemm._gemm_tiled}
RTX_5090_SHARED = 99 * 1024


@pytest.fixture(scope="module")
def float_experts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, generator=g, device="cuda") * H ** -0.5
    down = torch.randn(E, H, I, generator=g, device="cuda") * I ** -0.5
    return gate_up, down


_STACKS: dict[str, tuple[QuantizedTensor, QuantizedTensor]] = {}


def _stacks(fmt: str, float_experts: tuple[torch.Tensor, torch.Tensor]) -> tuple[QuantizedTensor, QuantizedTensor]:
    if fmt not in _STACKS:
        _STACKS.clear()  # one format resident at a time
        _STACKS[fmt] = tuple(quantize(w, fmt) for w in float_experts)
    return _STACKS[fmt]


@pytest.fixture
def dot_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tl.dot expert kernels at every size (no measured choice of the decode GEMV)."""
    monkeypatch.setenv("NINFER_MOE_PATH", "dot")


@pytest.fixture
def first_configs(monkeypatch: pytest.MonkeyPatch, dot_path: None) -> list:
    """Each tuner runs its first config only; returns the compiled kernels launched (for their metadata)."""
    launched = []
    for tuner in TUNERS.values():
        run = tuner.run

        def spy(*args, _run=run, **kwargs):
            kernel = _run(*args, **kwargs)
            launched.append(kernel)
            return kernel

        monkeypatch.setattr(tuner, "configs", tuner.configs[:1])
        monkeypatch.setattr(tuner, "run", spy)
    return launched


def _route(n: int, seed: int, skew: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(n, E, generator=g, device="cuda")
    if skew:  # expert 7 in every token's top k, half the experts never chosen
        logits[:, 7] = 20.0
        logits[:, E // 2:] = -20.0
    return route_topk_reference(logits.to(torch.bfloat16), TOP_K)


def _check(gate_up: QuantizedTensor, down: QuantizedTensor, n: int, dtype: torch.dtype, seed: int,
           skew: bool = False, path: str | moe_quant_gemv.GemmConfig | None = None) -> None:
    weights, ids = _route(n, seed, skew)
    x = torch.randn(n, H, device="cuda").to(dtype)
    got = moe_experts_triton(x, gate_up, down, weights.to(dtype), ids, path=path)
    ref = moe_experts_reference(x.float(), gate_up.dequantize(), down.dequantize(), weights.float(), ids)
    assert got.dtype == dtype and torch.isfinite(got).all()
    err = ((got.float() - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], (gate_up.format.name, n, dtype, path, err)


# 1, 8 tokens: no alignment launch; 512 tokens (4096 pairs): 16-row blocks; 2048 (16384 pairs): 64-row blocks.
@pytest.mark.parametrize("fmt", FORMATS)
def test_real_shapes(float_experts, first_configs: list, fmt: str) -> None:
    gate_up, down = _stacks(fmt, float_experts)
    for n in (1, 8, 512, 2048):
        _check(gate_up, down, n, torch.bfloat16, seed=n)
    assert len(first_configs) == 8  # two GEMMs at each size
    for kernel in first_configs:
        assert kernel.metadata.shared <= RTX_5090_SHARED, (fmt, kernel.metadata.shared)


@pytest.mark.parametrize("fmt", ["int4-g64", "nvfp4", "fp8"])
def test_fp32_activations_and_skewed_routing(float_experts, first_configs: list, fmt: str) -> None:
    gate_up, down = _stacks(fmt, float_experts)
    _check(gate_up, down, 8, torch.float32, seed=3)
    for n in (4, 5000):
        _check(gate_up, down, n, torch.bfloat16, seed=11, skew=True)


@pytest.mark.parametrize("fmt", ["int4-g64", "int8-g32", "nvfp4", "fp8", "fp8-b128"])
@pytest.mark.parametrize("direct_max", [0, 64])
def test_unselected_experts_are_never_read(float_experts, first_configs: list, monkeypatch: pytest.MonkeyPatch,
                                           fmt: str, direct_max: int) -> None:
    """Every scale of every expert no token selected is NaN: the output stays finite and exact."""
    monkeypatch.setattr(moe_gemm, "DIRECT_MAX_PAIRS", direct_max)
    clean_gate_up, clean_down = _stacks(fmt, float_experts)
    for n in (1, 8):
        weights, ids = _route(n, 40 + n)
        unused = torch.ones(E, dtype=torch.bool, device="cuda")
        unused[ids.flatten()] = False
        poisoned = []
        for stack in (clean_gate_up, clean_down):
            tensors = {name: t.clone() for name, t in stack.tensors.items()}
            for t in tensors.values():
                if t.dtype == torch.float8_e4m3fn:  # no masked_fill for fp8: write the NaN byte (0x7F)
                    t.view(torch.uint8)[unused] = 0x7F
                elif t.is_floating_point():
                    t[unused] = float("nan")
            poisoned.append(QuantizedTensor(stack.format, stack.shape, tensors))
        x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
        got = moe_experts_triton(x, *poisoned, weights, ids)
        ref = moe_experts_triton(x, clean_gate_up, clean_down, weights, ids)
        assert torch.equal(got, ref), (fmt, n, direct_max)


@pytest.mark.usefixtures("dot_path")
@pytest.mark.parametrize("fmt", ["int4-g64", "nvfp4"])
def test_every_config(float_experts, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """Each config of each tuner alone: a config the tuner may pick must be right, whatever its speed."""
    gate_up, down = _stacks(fmt, float_experts)
    cases = {"direct": 4, "skinny": 300, "tiled": 1500}
    for path, tuner in TUNERS.items():
        for cfg in list(tuner.configs):
            monkeypatch.setattr(tuner, "configs", [cfg])
            try:
                _check(gate_up, down, cases[path], torch.bfloat16, seed=7)
            except triton.runtime.errors.OutOfResources:
                continue  # too much shared memory / too many registers on this GPU is allowed, wrong results are not


def test_dispatch_and_graph_replay(float_experts) -> None:
    """moe_experts takes the quantized kernels on CUDA; a captured decode step replays exactly."""
    gate_up, down = _stacks("int4-g64", float_experts)
    n = 4
    logits = torch.randn(n, E, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        weights, ids = route_topk(logits, TOP_K)
        return moe_experts(x, gate_up, down, weights, ids)

    first = step()  # compiles and tunes outside the graph
    weights, ids = route_topk(logits, TOP_K)
    assert torch.equal(first, moe_experts_triton(x, gate_up, down, weights, ids))
    assert_graph_replays_eager(step, [logits, x], replays=1)


@pytest.fixture
def gemv_kernels(monkeypatch: pytest.MonkeyPatch) -> list:
    """The expert GEMV's compiled kernels as they launch (for their metadata); the dot must not run."""
    launched = []
    kernel = moe_quant_gemv._moe_gemv_kernel
    run = kernel.run

    def spy(*args, **kwargs):
        compiled = run(*args, **kwargs)
        launched.append(compiled)
        return compiled

    def no_dot(*args, **kwargs) -> None:
        raise AssertionError("the tl.dot expert GEMM ran")

    monkeypatch.setattr(kernel, "run", spy)
    monkeypatch.setattr(moe_quant_gemm, "_launch_dot", no_dot)
    return launched


# 1 token (8 pairs, one per expert) and 8 tokens (64 pairs: experts shared); bf16 and fp32 activations.
@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_gemv_real_shapes(float_experts, gemv_kernels: list, fmt: str) -> None:
    gate_up, down = _stacks(fmt, float_experts)
    for n in (1, 8):
        _check(gate_up, down, n, torch.bfloat16, seed=n, path="gemv")
    _check(gate_up, down, 8, torch.float32, seed=5, path="gemv")
    _check(gate_up, down, 6, torch.bfloat16, seed=6, skew=True, path="gemv")  # expert 7: six pairs
    assert len(gemv_kernels) == 8
    for kernel in gemv_kernels:
        assert kernel.metadata.shared <= RTX_5090_SHARED, (fmt, kernel.metadata.shared)


@pytest.mark.parametrize("fmt", ["int4-g64", "nvfp4", "int8-g64", "fp8-b128"])
def test_expert_gemv_every_candidate(float_experts, gemv_kernels: list, fmt: str) -> None:
    """Every candidate the selection may pick, pinned for both GEMMs (split-K as sized for gate/up)."""
    gate_up, down = _stacks(fmt, float_experts)
    for n in (1, 8):
        for cfg in moe_quant_gemv.expert_gemv_candidates(fmt, n * TOP_K, I, H, torch.cuda.get_device_properties(0)
                                                         .multi_processor_count):
            _check(gate_up, down, n, torch.bfloat16, seed=7, path=cfg)
    for kernel in gemv_kernels:
        assert kernel.metadata.shared <= RTX_5090_SHARED, (fmt, kernel.metadata.shared)


@pytest.mark.parametrize("fmt", ["int4-g64", "nvfp4", "fp8"])
def test_expert_gemv_unselected_experts_are_never_read(float_experts, gemv_kernels: list, fmt: str) -> None:
    clean = _stacks(fmt, float_experts)
    for n in (1, 8):
        weights, ids = _route(n, 50 + n)
        unused = torch.ones(E, dtype=torch.bool, device="cuda")
        unused[ids.flatten()] = False
        poisoned = []
        for stack in clean:
            tensors = {name: t.clone() for name, t in stack.tensors.items()}
            for t in tensors.values():
                if t.dtype == torch.float8_e4m3fn:
                    t.view(torch.uint8)[unused] = 0x7F
                elif t.is_floating_point():
                    t[unused] = float("nan")
            poisoned.append(QuantizedTensor(stack.format, stack.shape, tensors))
        x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
        got = moe_experts_triton(x, *poisoned, weights, ids, path="gemv")
        assert torch.equal(got, moe_experts_triton(x, *clean, weights, ids, path="gemv")), (fmt, n)


@pytest.mark.parametrize("path", ["gemv", None])  # None: auto, measured on the eager call before capture
@pytest.mark.parametrize("fmt", ["int4-g64", "nvfp4"])
def test_expert_gemv_in_cuda_graph(float_experts, monkeypatch: pytest.MonkeyPatch, fmt: str,
                                   path: str | None) -> None:
    """A captured decode step (router + experts) replays exactly what eager calls compute, at 1 and 8
    tokens; auto: the first (eager) call measured both paths per GEMM, the capture reuses the choice."""
    monkeypatch.setenv("NINFER_TUNE_CACHE", "off")  # the timings below come from this run
    tuner = TunerState()  # a fresh state: the choices and timings below come from this test
    with use_tuner(tuner):
        gate_up, down = _stacks(fmt, float_experts)
        for n in (1, 8):
            logits = torch.randn(n, E, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)

            def step() -> torch.Tensor:
                weights, ids = route_topk(logits, TOP_K)
                return moe_experts_triton(x, gate_up, down, weights, ids, path=path)

            first = step()
            weights, ids = route_topk_reference(logits, TOP_K)
            ref = moe_experts_reference(x.float(), gate_up.dequantize(), down.dequantize(), weights.float(), ids)
            assert ((first.float() - ref).norm() / ref.norm()).item() < TOL[torch.bfloat16], (fmt, n, path)
            assert_graph_replays_eager(step, [logits, x], (fmt, n, path))
    if path is None:
        chosen, timings = tuner.chosen("moe_gemv"), tuner.timings("moe_gemv")
        want = {(fmt, torch.bfloat16, p, n_out, k, sw, x.device) for p in (8, 64)
                for n_out, k, sw in ((I, H, True), (H, I, False))}
        assert set(chosen) == want
        for key, cfg in chosen.items():
            assert moe_quant_gemv.GROUPED_DOT in timings[key] and len(timings[key]) >= 6
            assert cfg == min(timings[key], key=timings[key].__getitem__)
