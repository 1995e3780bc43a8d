"""The one-launch Gated DeltaNet decode kernel on the GPU at 27B and 35B-A3B shapes, bf16 inputs with fp32
state, against the composed PyTorch reference (conv, rule, gated norm) and the composed Triton path, in and
out of a CUDA graph; outputs are NaN-poisoned before every run.

The reference gets ``b`` in fp32: the kernels keep ``beta = sigmoid(b)`` in fp32, while the reference computes it
in ``b``'s dtype as transformers does; that rounding alone moves the state by ~1e-3 relative (the bound below)
at these shapes, in the composed Triton path as much as in the fused one (both emulated in PyTorch on CPU)."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import poisoned_outputs  # noqa: F401  (fixture)
from ninfer.kernels.conv import causal_conv1d_triton
from ninfer.kernels.deltanet.decode import gated_deltanet_decode_triton
from ninfer.kernels.deltanet.mixer import (
    GateProjection,
    fused_decode_applies,
    gated_deltanet,
    gated_deltanet_reference,
)
from ninfer.kernels.deltanet.recurrent import gated_delta_rule_recurrent_triton
from ninfer.kernels.norms import NormedRows, gated_rms_norm_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("poisoned_outputs")]

SHAPES = {"27B": (16, 48, 128, 128), "35B-A3B": (16, 32, 128, 128)}  # (Hk, Hv, dk, dv), perf/random_model.py
TINY = {"tiny-16": (2, 4, 16, 16), "tiny-64": (2, 4, 64, 64)}  # the test checkpoints' heads: small dv rows
TAPS, EPS = 4, 1e-6
# Relative Frobenius errors: the output is bf16 (its rounding alone ~2e-3) and the rule runs in fp32 on
# both sides, so a flipped bf16 rounding of a conv output is the largest difference the state sees.
OUT_TOL, STATE_TOL = 1e-2, 1e-3
# Against the composed Triton path, which rounds at the same points (the fp16 interpreter test in
# tests/kernels/test_deltanet_decode.py finds them bit-equal), only fp32 summation orders differ and flip a bf16
# rounding now and then: emulated in PyTorch with one conv output and one rule output in 1e4 off by an ulp (about
# 10x what fp32 reordering causes), that moves outputs by <= 7e-4 and states by <= 1.5e-4 (the 16-wide heads).
FUSED_OUT_TOL, FUSED_STATE_TOL = 2e-3, 2e-4


@pytest.fixture(autouse=True)
def _fused_decode_default(monkeypatch) -> None:
    monkeypatch.delenv("NINFER_FUSED_DELTANET_DECODE", raising=False)  # the default: on


def _layer(dims: tuple[int, int, int, int], slots: int, seed: int) -> dict:
    hk, hv, dk, dv = dims
    gen = torch.Generator(device="cuda").manual_seed(seed)
    channels = 2 * hk * dk + hv * dv

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    return dict(
        conv_weight=(0.5 * randn(channels, 1, TAPS)).bfloat16()[:, 0, :],  # the model passes this view
        conv_state=randn(slots, channels, TAPS - 1).bfloat16(),
        A_log=torch.empty(hv, device="cuda").uniform_(0, 16, generator=gen).clamp_min(0.5).log(),
        dt_bias=randn(hv), norm_weight=(1.0 + 0.1 * randn(dv)).bfloat16(), state=0.1 * randn(slots, hv, dk, dv),
    )


def _tokens(dims: tuple[int, int, int, int], n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """qkv, z (column views of one projection) and a, b (of another), bf16, as the model passes them."""
    hk, hv, dk, dv = dims
    gen = torch.Generator(device="cuda").manual_seed(seed)
    channels = 2 * hk * dk + hv * dv
    qkvz = torch.randn(n, channels + hv * dv, generator=gen, device="cuda").bfloat16()
    ab = torch.randn(n, 2 * hv, generator=gen, device="cuda").bfloat16()
    return (*qkvz.split([channels, hv * dv], dim=-1), *ab.split([hv, hv], dim=-1))


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _reference(qkv, z, a, b, *rest) -> torch.Tensor:
    """:func:`gated_deltanet_reference` with ``b`` in fp32, the kernels' beta (see the module docstring)."""
    return gated_deltanet_reference(qkv, z, a, b.float(), *rest)


def _composed_triton(qkv, z, a, b, layer, conv_state, state, cu, slot_ids, max_seqlen, out_slots):
    """conv, recurrent rule and gated norm as three launches: the path the fused kernel replaces."""
    hv, dk, dv = state.shape[1:]
    hk = (qkv.shape[1] - hv * dv) // (2 * dk)
    n = qkv.shape[0]
    mixed = causal_conv1d_triton(qkv, layer["conv_weight"], conv_state, cu, slot_ids, max_seqlen, out_slots)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    o = gated_delta_rule_recurrent_triton(q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), a, b,
                                          layer["A_log"], layer["dt_bias"], state, cu, slot_ids, out_slots)
    return gated_rms_norm_triton(o, z.view(n, hv, dv), layer["norm_weight"], EPS).reshape(n, hv * dv)


def _setup(dims, batch: int, tokens: int, per_token: bool, seed: int):
    slots = 2 * batch + batch * tokens + 1
    layer = _layer(dims, slots, seed)
    perm = torch.randperm(slots, generator=torch.Generator().manual_seed(seed)).cuda()
    slot_ids = perm[:batch]
    out_slots = perm[batch:batch + batch * tokens].reshape(batch, tokens) if per_token else None
    cu = torch.arange(0, batch * tokens + 1, tokens, device="cuda", dtype=torch.int32)
    return layer, slot_ids, out_slots, cu


def _check_slots(layer: dict, conv_state: torch.Tensor, state: torch.Tensor) -> None:
    assert torch.equal(layer["conv_state"], conv_state)  # the windows are copies of inputs: exact
    assert _rel(layer["state"], state) < STATE_TOL


def _force_block(monkeypatch: pytest.MonkeyPatch, block: int | None) -> None:
    """Every config of the kernel (value columns per program, warps) in turn; None: the autotuner's pick."""
    import triton

    from ninfer.kernels.deltanet import decode

    if block is not None:
        warps = dict(decode._CONFIGS)[block]
        monkeypatch.setattr(decode._decode_kernel, "configs", [triton.Config({"BV": block}, num_warps=warps)])


@pytest.mark.parametrize("per_token", [False, True], ids=["in-place", "per-token-slots"])
@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("batch", [1, 4, 8])
@pytest.mark.parametrize("shape", list(SHAPES) + list(TINY))
@pytest.mark.parametrize("block", [None, 16, 32, 64, 128], ids=lambda b: f"bv{b or 'tuned'}")
def test_fused_decode_matches_composed_paths(shape: str, batch: int, tokens: int, per_token: bool,
                                             block: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if per_token and tokens == 1:
        pytest.skip("per-token slots are for verification rows (K + 1 > 1 tokens)")
    if block is not None and (batch == 4 or shape == "35B-A3B"):
        pytest.skip("each block width: the 27B and tiny heads at batch 1 and 8")
    _force_block(monkeypatch, block)
    dims = {**SHAPES, **TINY}[shape]
    layer, slot_ids, out_slots, cu = _setup(dims, batch, tokens, per_token, seed=batch * 10 + tokens)
    ref_conv, ref_state = layer["conv_state"].clone(), layer["state"].clone()
    tri_conv, tri_state = layer["conv_state"].clone(), layer["state"].clone()
    for step in range(2):  # the second step reads the slots the first one wrote (in place)
        qkv, z, a, b = _tokens(dims, batch * tokens, seed=1000 * step + batch)
        params = (layer["A_log"], layer["dt_bias"], layer["norm_weight"], EPS)
        assert fused_decode_applies(qkv, layer["state"], tokens, out_slots, None)
        out = gated_deltanet(qkv, z, (a, b), layer["conv_weight"], layer["conv_state"], *params, layer["state"],
                             cu, slot_ids, tokens, out_slots)
        ref = _reference(qkv, z, a, b, layer["conv_weight"], ref_conv, *params, ref_state, cu, slot_ids, tokens,
                         out_slots)
        tri = _composed_triton(qkv, z, a, b, layer, tri_conv, tri_state, cu, slot_ids, tokens, out_slots)
        assert torch.isfinite(out).all()
        assert _rel(out, tri) < FUSED_OUT_TOL and _rel(tri, ref) < OUT_TOL and _rel(out, ref) < OUT_TOL
        assert torch.equal(layer["conv_state"], tri_conv) and _rel(layer["state"], tri_state) < FUSED_STATE_TOL
        _check_slots(layer, ref_conv, ref_state)
        assert _rel(tri_state, ref_state) < STATE_TOL


@pytest.mark.parametrize("per_token", [False, True], ids=["in-place", "per-token-slots"])
@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_decode_replays_in_a_cuda_graph(shape: str, tokens: int, per_token: bool) -> None:
    """Captured once, replayed on new inputs copied into the static buffers: each replay equals the reference
    advancing its own copies of the slots; the output buffer is NaN-filled before every replay."""
    if per_token and tokens == 1:
        pytest.skip("per-token slots are for verification rows (K + 1 > 1 tokens)")
    dims, batch = SHAPES[shape], 4
    layer, slot_ids, out_slots, cu = _setup(dims, batch, tokens, per_token, seed=7 + tokens)
    static = [t.clone() for t in _tokens(dims, batch * tokens, seed=0)]
    params = (layer["A_log"], layer["dt_bias"], layer["norm_weight"], EPS)

    def step() -> torch.Tensor:
        return gated_deltanet_decode_triton(*static, layer["conv_weight"], layer["conv_state"], *params,
                                            layer["state"], cu, slot_ids, tokens, out_slots)

    saved = layer["conv_state"].clone(), layer["state"].clone()
    step()  # compile and autotune outside the graph, then undo the step's writes
    layer["conv_state"].copy_(saved[0])
    layer["state"].copy_(saved[1])
    ref_conv, ref_state = layer["conv_state"].clone(), layer["state"].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for replay in range(3):
        inputs = _tokens(dims, batch * tokens, seed=100 + replay)
        for buf, new in zip(static, inputs):
            buf.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        ref = _reference(*inputs, layer["conv_weight"], ref_conv, *params, ref_state, cu, slot_ids, tokens, out_slots)
        assert torch.isfinite(out).all() and _rel(out, ref) < OUT_TOL
        _check_slots(layer, ref_conv, ref_state)


def test_dispatcher_keeps_prefill_and_checkpoints_on_the_composed_path() -> None:
    dims = SHAPES["27B"]
    layer, _, _, _ = _setup(dims, 1, 1, False, seed=3)
    qkv = _tokens(dims, 1, seed=3)[0]
    assert not fused_decode_applies(qkv, layer["state"], 64, None, None)  # prefill: chunked kernels
    assert not fused_decode_applies(qkv, layer["state"], None, None, None)  # no host bound on the lengths
    ckpt = torch.ones(1, device="cuda", dtype=torch.int32)
    assert not fused_decode_applies(qkv, layer["state"], 4, None, ckpt)  # checkpoints: written by the chunked kernel


HIDDEN = {"27B": 5120, "35B-A3B": 2048, "tiny-64": 64}


@pytest.mark.parametrize("deferred", [False, True], ids=["rows", "deferred-rows"])
@pytest.mark.parametrize("per_token", [False, True], ids=["in-place", "per-token-slots"])
@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("shape", list(HIDDEN))
def test_gates_projected_in_the_kernel(shape: str, batch: int, tokens: int, per_token: bool, deferred: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's path: a GateProjection with the bf16 in_proj_ab weight, applied by the decode kernel's programs,
    against the same kernel fed cuBLAS's a and b (only the projections' summation order differs: a flipped bf16
    rounding of a gate now and then, well inside the fused kernel's bound against the composed path). Deferred rows
    (``NormedRows``, 80 shares a row as the 27B's output projection leaves them): fp32 sums times each row's factor,
    rounded once, as the kernel and the float GEMV reading such rows round them. (cuBLAS's bf16 sums times the factor
    round twice: a quarter of the gates an ulp apart, which moved the state by 5e-4 on an H100, run 2026-12-06.3, and
    by 0.8-1.4e-3 emulated on CPU.)"""
    if per_token and tokens == 1:
        pytest.skip("per-token slots are for verification rows (K + 1 > 1 tokens)")
    monkeypatch.setenv("NINFER_GATES_IN_DECODE", "1")
    dims, hidden = {**SHAPES, **TINY}[shape], HIDDEN[shape]
    hv = dims[1]
    layer, slot_ids, out_slots, cu = _setup(dims, batch, tokens, per_token, seed=batch + tokens)
    ab_conv, ab_state = layer["conv_state"].clone(), layer["state"].clone()
    gen = torch.Generator(device="cuda").manual_seed(batch)
    weight = (torch.randn(2 * hv, hidden, generator=gen, device="cuda") * hidden ** -0.5).bfloat16()
    for step in range(2):
        qkv, z, _, _ = _tokens(dims, batch * tokens, seed=1000 * step + batch)
        x = torch.randn(batch * tokens, hidden, generator=gen, device="cuda").bfloat16()
        project = lambda t: torch.nn.functional.linear(t, weight)  # noqa: E731
        params = (layer["A_log"], layer["dt_bias"], layer["norm_weight"], EPS)
        calls = []
        gate_x, factor = x, torch.ones(batch * tokens, 1, device="cuda")
        if deferred:
            stats = torch.rand(80, batch * tokens, generator=gen, device="cuda") * hidden / 40
            gate_x = NormedRows(x, stats, 1e-6)
            factor = gate_x.rstd()[:, None]
        gates = GateProjection(gate_x, lambda t: calls.append(t) or project(t), weight)
        out = gated_deltanet(qkv, z, gates, layer["conv_weight"], layer["conv_state"],
                             *params, layer["state"], cu, slot_ids, tokens, out_slots)
        sums = torch.nn.functional.linear(x.float(), weight.float()) * factor if deferred else project(x)
        ab = sums.bfloat16()
        given = gated_deltanet(qkv, z, ab.split(hv, dim=-1), layer["conv_weight"], ab_conv, *params, ab_state,
                               cu, slot_ids, tokens, out_slots)
        assert not calls and torch.isfinite(out).all()  # the kernel projected the gates
        assert _rel(out, given) < FUSED_OUT_TOL and _rel(layer["state"], ab_state) < FUSED_STATE_TOL
        assert torch.equal(layer["conv_state"], ab_conv)
