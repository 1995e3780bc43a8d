"""Shared pieces of the kernel tests: NaN-poisoned allocations, a relative-error check, the quantized GEMM
tests' formats and tolerances, quantized expert stacks and routing."""
from __future__ import annotations

import pytest
import torch

# Quantized GEMM tests: K per format, a multiple of the group size that leaves a partial last K block,
# and the relative error allowed for fp32 / fp16 activations.
QUANT_K_FOR = {"fp8": 320, "fp8-b128": 320, "int8-g32": 352, "int8-g64": 320, "int4-g64": 320, "int4-g128": 384,
               "nvfp4": 336}
QUANT_FORMATS = list(QUANT_K_FOR)
QUANT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.fixture
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launchers allocate their outputs: make fresh float allocations NaN so unwritten elements show."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Finite output of the reference's shape and dtype, within ``tol`` relative (Frobenius) error."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    err = (out.double() - ref.double()).norm() / ref.double().norm()
    assert err < tol, f"relative error {err:.2e}"


def expert_stacks(fmt: str, e: int, h: int, i: int, seed: int = 0) -> tuple:
    """Random quantized expert stacks ``gate_up [e, 2i, h]`` and ``down [e, h, i]`` in format ``fmt``."""
    from ninfer.quant.formats import quantize

    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(e, 2 * i, h, generator=g) * h ** -0.5
    down = torch.randn(e, h, i, generator=g) * i ** -0.5
    return quantize(gate_up, fmt), quantize(down, fmt)


def expert_routing(n: int, e: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``n`` tokens over ``e`` experts in which experts 0 and 5 get no token and expert 3
    gets two thirds of them (empty experts and a crowded one in every test)."""
    from ninfer.kernels.moe import route_topk_reference

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, e, generator=g)
    logits[:, [0, 5]] = -30.0
    logits[: max(1, 2 * n // 3), 3] = 30.0
    return route_topk_reference(logits, k)


EXPERT_TOL = {torch.float32: 1e-5, torch.float16: 3e-3}  # relative error of a quantized expert block's output


def check_quant_experts(fmt: str, h: int, i: int, dtype: torch.dtype, n: int, path, *, seed: int = 0,
                        ids: torch.Tensor | None = None, e: int = 8, k: int = 2) -> None:
    """``moe_experts_triton`` over random ``fmt`` stacks (``e`` experts, H = ``h``, I = ``i``) on ``n`` tokens
    routed top-``k`` (or by ``ids``), through ``path``, against the fp32 reference of the dequantized stacks."""
    from ninfer.kernels.moe import moe_experts_reference
    from ninfer.kernels.moe.gemm import moe_experts_triton

    gate_up, down = expert_stacks(fmt, e, h, i, seed)
    weights, routed = expert_routing(n, e, k, seed + 1)
    ids = routed if ids is None else ids
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    got = moe_experts_triton(x, gate_up, down, weights.to(dtype), ids, path=path)
    ref = moe_experts_reference(x.float(), gate_up.dequantize(), down.dequantize(), weights.float(), ids.long())
    assert got.shape == (n, h) and got.dtype == dtype and torch.isfinite(got).all(), (fmt, n, path)
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < EXPERT_TOL[dtype], (fmt, dtype, n, path, err)


def nan_experts(stacks: tuple, experts: list[int]) -> list:
    """Copies of quantized expert stacks with NaN in every float tensor (scales) of ``experts``: a kernel
    that reads those experts produces NaN, one that skips them is unchanged."""
    from ninfer.quant.formats import QuantizedTensor

    poisoned = []
    for stack in stacks:
        tensors = {name: t.clone() for name, t in stack.tensors.items()}
        for t in tensors.values():
            if t.is_floating_point():
                t[experts] = float("nan")
        poisoned.append(QuantizedTensor(stack.format, stack.shape, tensors))
    return poisoned


def graph_replay_matches(w, cfg, x: torch.Tensor, res: torch.Tensor, tol: float = 1.5e-2) -> None:
    """A quantized GEMM with config ``cfg`` captured in a CUDA graph: bit-equal to eager (scratch and an ordered
    split-K sum: deterministic), and right (relative error under ``tol``) after new inputs are copied in."""
    from ninfer.kernels.quant_gemm import quant_matmul_reference, quant_matmul_triton

    eager = quant_matmul_triton(x, w, res, config=cfg)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        quant_matmul_triton(x, w, res, config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quant_matmul_triton(x, w, res, config=cfg)
    graph.replay()
    assert torch.equal(out, eager)
    x.copy_(torch.randn_like(x))
    graph.replay()
    ref = quant_matmul_reference(x.float(), w, res.float()).float()
    assert ((out.float() - ref).norm() / ref.norm()).item() < tol


def assert_graph_replays_eager(step, inputs: list[torch.Tensor], label: object = None, replays: int = 2) -> None:
    """Capture ``step`` (a warmed-up call of static ``inputs``) in a CUDA graph, then ``replays`` times: fresh
    random inputs, one replay, and the graph's output equal to an eager call's."""
    from ninfer.runtime.graphs import capture

    graph, out = capture(step)
    for _ in range(replays):
        for t in inputs:
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step()), label


def fragment_laid(w):
    """A row-major int4 / int8-g64 / nvfp4 ``QuantizedTensor`` re-laid in the register decode's fragment layout."""
    from ninfer.kernels.quant_gemm import QuantizedTensor
    from ninfer.kernels.quant_gemm.fragments import FRAGMENTS, to_fragments

    q, s = to_fragments(w.tensors["qweight"], w.tensors["scales"])
    return QuantizedTensor(w.format, w.shape, {**w.tensors, "qweight": q, "scales": s}, layout=FRAGMENTS)


def frag_config(tokens: int, warps: int, unroll: int, split: int, stages: int = 1, kind: str = "frag"):
    """A register-decode ``GemmConfig``: ``tokens`` per program, ``warps`` warps of one 16-row tile (a pair: two),
    ``unroll`` 64-column chunks per loop trip, ``split`` splits of K."""
    from ninfer.kernels.quant_gemm.tune import GemmConfig

    rows = 32 if kind == "frag-pair" else 16
    tiles = 1 if kind == "frag-ksplit" else warps  # warps splitting K share one tile
    return GemmConfig(tokens, rows * tiles, 64 * unroll, split, warps, stages, kind)


def check_fragment_decode(fmt: str, m: int, n: int, k: int, cfg, *, swiglu: bool = False, residual: bool = False,
                          dtype: torch.dtype = torch.float16, seed: int = 0) -> None:
    """The register decode of a fragment-laid random weight with ``cfg`` (NaN-poisoned output) within ``QUANT_TOL``
    of the reference GEMM of the row-major weight."""
    from ninfer.kernels.quant_gemm import quant_matmul_reference, quant_matmul_triton
    from ninfer.quant.formats import quantize

    w = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, fmt)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    n_out = n // 2 if swiglu else n
    res = torch.randn(m, n_out, generator=g).to(dtype) if residual else None
    out = torch.full((m, n_out), float("nan"), dtype=dtype)
    got = quant_matmul_triton(x, fragment_laid(w), res, swiglu, out=out, config=cfg)
    assert torch.isfinite(got).all(), f"{fmt} {cfg}: unwritten or non-finite outputs"
    ref = quant_matmul_reference(x, w, res, swiglu).float()
    err = (got.float() - ref).norm() / ref.norm()
    assert err < QUANT_TOL[dtype], f"{fmt} m={m} n={n} k={k} {cfg}: relative error {err:.2e}"


def repeated_expert_stack(e: int, rows: int, k: int, device: str = "cpu"):
    """An int4-g64 expert stack ``[E, rows, K]`` (codes ``[E, rows, K / 2]`` uint8, scales ``[E, rows, K / 64]``) of
    one random expert repeated: for tests where only the stack's addresses and sizes matter."""
    from ninfer.kernels.quant_gemm import QuantizedTensor
    from ninfer.quant.formats import quantize

    w = quantize(torch.randn(rows, k, device=device) * 0.02, "int4-g64")
    tensors = {name: t.unsqueeze(0).expand(e, *t.shape).contiguous() for name, t in w.tensors.items()}
    return QuantizedTensor(w.format, (e, rows, k), tensors, layout=w.layout)
