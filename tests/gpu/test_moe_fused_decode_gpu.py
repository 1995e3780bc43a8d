"""The MoE block after its router in one launch (:mod:`ninfer.kernels.moe.fused_decode`) on the GPU, Qwen3.5-35B-A3B
shapes (256 experts, top-8, H = 2048, I = 512, an int8-g64 shared expert of 512), bf16 activations.

Run: ``python -m pytest -m gpu tests/gpu/test_moe_fused_decode_gpu.py``. Here the B items really wait for their token's
A items on other SMs: every candidate of every format against the fp32 reference block and its norm at 1, 2 and 8
tokens (outputs poisoned); a captured step (router logits in, the fused launch with its graph-timed config) replays
what eager calls compute, again and again from the same counters; 200 launches back to back in one graph finish
(no wait left hanging) and agree; the arrival counters are left at zero.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_graph_replays_eager, poisoned_outputs  # noqa: F401  (a fixture)

from ninfer.kernels.counters import arrival_counters
from ninfer.kernels.moe import fused_decode as fd
from ninfer.kernels.norms import NextNorm
from ninfer.kernels.tuning import TunerState, use_tuner
from ninfer.quant.formats import quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("poisoned_outputs")]

E, TOP_K, H, I, SI = 256, 8, 2048, 512, 512
FORMATS = ["int4-g64", "int4-g128", "int8-g64", "nvfp4"]
TOL = 1.5e-2  # relative Frobenius error against the fp32 reference (bf16 activations, rows and outputs)


@pytest.fixture(scope="module")
def float_weights() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    return dict(gate_up=torch.randn(E, 2 * I, H, generator=g, device="cuda") * H ** -0.5,
                down=torch.randn(E, H, I, generator=g, device="cuda") * I ** -0.5,
                shared_gate_up=torch.randn(2 * SI, H, generator=g, device="cuda") * H ** -0.5,
                shared_down=torch.randn(H, SI, generator=g, device="cuda") * SI ** -0.5)


_QUANTIZED: dict[str, dict] = {}


def _weights(fmt: str, float_weights: dict) -> dict:
    if fmt not in _QUANTIZED:
        _QUANTIZED.clear()  # one format resident at a time
        _QUANTIZED[fmt] = {"gate_up": quantize(float_weights["gate_up"], fmt),
                           "down": quantize(float_weights["down"], fmt),
                           "shared_gate_up": quantize(float_weights["shared_gate_up"], "int8-g64"),
                           "shared_down": quantize(float_weights["shared_down"], "int8-g64")}
    return _QUANTIZED[fmt]


def _inputs(n: int, seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(n, E + 1, generator=g, device="cuda").bfloat16()
    return dict(x=torch.randn(n, H, generator=g, device="cuda").bfloat16(), router_logits=logits[:, :E],
                shared_logit=logits[:, E:], residual=(torch.randn(n, H, generator=g, device="cuda") * 3).bfloat16(),
                w=(torch.randn(H, generator=g, device="cuda") * 0.3).bfloat16())


def _reference(w: dict, b: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return fd.moe_block_reference(b["x"], b["router_logits"], b["shared_logit"], w["gate_up"], w["down"],
                                  w["shared_gate_up"], w["shared_down"], TOP_K, b["w"], 1e-6, b["residual"])


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.float() - ref).norm() / ref.norm()).item()


def _launch(w: dict, b: dict, cfg: fd.FusedConfig) -> tuple[torch.Tensor, torch.Tensor]:
    norm = NextNorm(b["w"], 1e-6, b["residual"], torch.empty_like(b["x"]))
    out = torch.empty_like(b["x"])
    assert fd.launch_fused(b["x"], b["router_logits"], b["shared_logit"], w["gate_up"], w["down"],
                           w["shared_gate_up"], w["shared_down"], TOP_K, norm, out, cfg)
    return out, norm.new_residual


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_candidate_at_real_shapes(float_weights: dict, fmt: str) -> None:
    w = _weights(fmt, float_weights)
    for n in (1, 2, 8):
        b = _inputs(n, seed=n)
        ref, ref_res = _reference(w, b)
        for cfg in fd.fused_candidates(fmt, "int8-g64", I, SI):
            out, new_res = _launch(w, b, cfg)
            assert _rel(new_res, ref_res) < TOL and _rel(out, ref) < TOL, (fmt, n, cfg)
    torch.cuda.synchronize()
    assert not arrival_counters(torch.device("cuda")).any()


@pytest.mark.parametrize("fmt", ["int4-g64", "nvfp4"])
def test_the_block_in_a_cuda_graph(float_weights: dict, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """The tuned call (the first eager call times the candidates from graph replays) captured, then replayed on
    fresh inputs: equal to eager calls every time, at 1 and 8 tokens."""
    monkeypatch.setenv("NINFER_MOE_FUSED_DECODE", "1")
    monkeypatch.setenv("NINFER_TUNE_CACHE", "off")
    w = _weights(fmt, float_weights)
    args = [w[k] for k in ("gate_up", "down", "shared_gate_up", "shared_down")]
    tuner = TunerState()
    with use_tuner(tuner):
        for n in (1, 8):
            b = _inputs(n, seed=10 + n)
            assert fd.fused_decode_applies(b["x"], *args[:2]) and fd.shared_expert_fits(*args[2:])

            def step() -> torch.Tensor:
                out, new_res = fd.moe_block_fused_then_norm(b["x"], b["router_logits"], b["shared_logit"], *args, TOP_K,
                                                            b["w"], 1e-6, b["residual"])
                return torch.cat([out, new_res])

            first = step()
            ref, ref_res = _reference(w, b)
            assert _rel(first[:n], ref) < TOL and _rel(first[n:], ref_res) < TOL, (fmt, n)
            assert_graph_replays_eager(step, [b["x"], b["router_logits"], b["shared_logit"], b["residual"]], (fmt, n),
                                       replays=4)
    assert {key[3] for key in tuner.chosen(fd.TABLE)} == {1, 8}  # token buckets
    torch.cuda.synchronize()
    assert not arrival_counters(torch.device("cuda")).any()


def test_many_launches_back_to_back(float_weights: dict) -> None:
    """200 launches in one graph replay: none waits forever (each leaves its counters at zero for the next), and each
    computes what the first did."""
    w = _weights("int4-g64", float_weights)
    b = _inputs(1, seed=3)
    cfg = fd.fused_candidates("int4-g64", "int8-g64", I, SI)[0]
    want, want_res = _launch(w, b, cfg)
    outs = []
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(200):
            outs.append(_launch(w, b, cfg))
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(out, want) and torch.equal(res, want_res) for out, res in outs)
    assert not arrival_counters(torch.device("cuda")).any()
