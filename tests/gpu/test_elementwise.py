"""Norm, RoPE, SwiGLU and causal-conv Triton kernels at the real 27B shapes on the GPU.

Each kernel's bf16 (and fp32) output is compared with the fp32 reference (fp64 for the conv) on the
same (upcast) inputs, within bf16 rounding bounds; state slots are compared exactly with the reference's.
"""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels.activations import swiglu, swiglu_reference
from ninfer.kernels.conv import causal_conv1d, causal_conv1d_reference
from ninfer.kernels.norms import gated_rms_norm, gated_rms_norm_reference, rms_norm, rms_norm_reference
from ninfer.kernels.rope import (
    apply_rope,
    apply_rope_reference,
    mrope_cos_sin,
    mrope_cos_sin_reference,
    qk_norm_rope,
    qk_norm_rope_reference,
    rope_inv_freq,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, ROT = 5120, 17408, 24, 4, 256, 64
V_HEADS, DV, CONV_DIM, TAPS, EPS = 48, 128, 10240, 4, 1e-6
DTYPES = [torch.bfloat16, torch.float32]
TOL = {torch.bfloat16: 8e-3, torch.float32: 1e-5}
DEV = "cuda"


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < TOL[dtype], f"relative error {err:.2e}"
    worst = (out.double() - ref.double()).abs().max().item()
    assert worst <= 8 * TOL[dtype] * ref.double().abs().max().item(), f"max abs error {worst:.3e}"


def rope_tables(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 262_144, (n,), device=DEV).expand(3, n)
    return mrope_cos_sin(positions, rope_inv_freq(ROT, 1e7), [11, 11, 10], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 8, 777, 4097])
def test_rms_norm_with_residual(dtype: torch.dtype, n: int) -> None:
    x, r = torch.randn(n, HIDDEN, device=DEV, dtype=dtype), torch.randn(n, HIDDEN, device=DEV, dtype=dtype)
    w = (torch.randn(HIDDEN, device=DEV) * 0.3).to(dtype)
    out, new_res = rms_norm(x, w, EPS, r)
    assert torch.equal(new_res, x + r)
    # fp32 reference on the rounded residual sum, so only the kernel's own rounding is measured.
    assert_close(out, rms_norm_reference(new_res.float(), w.float(), EPS)[0], dtype)
    out_plain, same = rms_norm(x, w, EPS)
    assert same is x
    assert_close(out_plain, rms_norm_reference(x.float(), w.float(), EPS)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_on_q_proj_view(dtype: torch.dtype) -> None:
    n = 333
    q = torch.randn(n, HEADS * 2 * HEAD_DIM, device=DEV, dtype=dtype).view(n, HEADS, 2 * HEAD_DIM)[..., :HEAD_DIM]
    w = (torch.randn(HEAD_DIM, device=DEV) * 0.3).to(dtype)
    out, _ = rms_norm(q, w, EPS)
    assert_close(out, rms_norm_reference(q.float(), w.float(), EPS)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 8, 1000])
def test_gated_rms_norm(dtype: torch.dtype, n: int) -> None:
    x = torch.randn(n * V_HEADS, DV, device=DEV, dtype=dtype)
    z = torch.randn(n * V_HEADS, DV, device=DEV, dtype=dtype) * 2
    w = (torch.rand(DV, device=DEV) + 0.5).to(dtype)
    assert_close(gated_rms_norm(x, z, w, EPS), gated_rms_norm_reference(x.float(), z.float(), w.float(), EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 4, 4097])
@pytest.mark.parametrize("text", [True, False])
def test_mrope_tables_in_one_launch(dtype: torch.dtype, n: int, text: bool) -> None:
    """The one-launch tables against the torch reference, at positions up to 256k (large cos/sin arguments)."""
    positions = torch.randint(0, 262_144, (n,) if text else (3, n), device=DEV)
    positions = positions.expand(3, n) if text else positions
    inv_freq = rope_inv_freq(ROT, 1e7).to(DEV)
    for out, ref in zip(mrope_cos_sin(positions, inv_freq, [11, 11, 10], dtype),
                        mrope_cos_sin_reference(positions, inv_freq, [11, 11, 10], dtype), strict=True):
        assert out.dtype == dtype and out.shape == ref.shape == (n, ROT)
        # Both sides are accurate (non-approximate) fp32 cos / sin of the same fp32 product: within an ulp or two of
        # fp32, so at most one bf16 rounding step apart, and equal nearly everywhere.
        diff = (out.float() - ref.float()).abs()
        assert diff.max().item() <= (2.0 ** -8 if dtype == torch.bfloat16 else 2.4e-7), diff.max().item()
        assert diff.mean().item() <= (2e-4 if dtype == torch.bfloat16 else 3e-8), diff.mean().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 8, 1000])
def test_rope_on_q_view_and_k(dtype: torch.dtype, n: int) -> None:
    q = torch.randn(n, HEADS, 2 * HEAD_DIM, device=DEV, dtype=dtype)[..., :HEAD_DIM]
    k = torch.randn(n, KV_HEADS, HEAD_DIM, device=DEV, dtype=dtype)
    cos, sin = rope_tables(n, dtype)
    for x in (q, k):
        assert_close(apply_rope(x, cos, sin), apply_rope_reference(x.float(), cos.float(), sin.float()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 8, 1000])
def test_qk_norm_rope(dtype: torch.dtype, n: int) -> None:
    q = torch.randn(n, HEADS, 2 * HEAD_DIM, device=DEV, dtype=dtype)[..., :HEAD_DIM]
    k = torch.randn(n, KV_HEADS, HEAD_DIM, device=DEV, dtype=dtype)
    q_w = (torch.randn(HEAD_DIM, device=DEV) * 0.3).to(dtype)
    k_w = (torch.randn(HEAD_DIM, device=DEV) * 0.3).to(dtype)
    cos, sin = rope_tables(n, dtype)
    q_out, k_out = qk_norm_rope(q, k, q_w, k_w, cos, sin, EPS)
    q_ref, k_ref = qk_norm_rope_reference(q.float(), k.float(), q_w.float(), k_w.float(), cos.float(), sin.float(), EPS)
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 8, 1000])
def test_swiglu(dtype: torch.dtype, n: int) -> None:
    gate_up = torch.randn(n, 2 * INTER, device=DEV, dtype=dtype) * 2
    assert_close(swiglu(gate_up), swiglu_reference(gate_up.float()), dtype)


def conv_case(lens: list[int], dtype: torch.dtype, max_seqlen: int | None, state: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Run the kernel on a ragged batch with non-zero states; check outputs and all slots."""
    slots = torch.randperm(2 * len(lens), device=DEV)[: len(lens)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    x = torch.randn(sum(lens), CONV_DIM, device=DEV, dtype=dtype)
    w = (torch.randn(CONV_DIM, 1, TAPS, device=DEV) * 0.5).to(dtype)[:, 0, :]
    if state is None:
        state = torch.randn(2 * len(lens), CONV_DIM, TAPS - 1, device=DEV, dtype=dtype)
    # fp64 reference on copies: ``state.float()`` would alias an fp32 state that the kernel updates
    # in place, and cuDNN runs fp32 conv1d in TF32 (errors far above the fp32 tolerance).
    ref_state = state.double()
    out = causal_conv1d(x, w, state, cu, slots, max_seqlen)
    ref = causal_conv1d_reference(x.double(), w.double(), ref_state, cu, slots)
    assert_close(out, ref, dtype)
    assert torch.equal(state, ref_state.to(dtype))  # the slots hold copies of inputs: exact
    return state


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_ragged_prefill(dtype: torch.dtype) -> None:
    # Lengths below K - 1 (old state shifts), equal to it, several 8-token tiles (not multiples of 8), and long.
    conv_case([1, 2, 3, 4, 100, 1000, 4097, 65], dtype, 4097)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_decode_steps(dtype: torch.dtype) -> None:
    for batch in (1, 8):
        state = None
        for _ in range(3):  # each step reads the slots the previous one wrote
            state = conv_case([1] * batch, dtype, 1, state)


def test_conv_short_multi_token_and_unbounded() -> None:
    conv_case([3, 2, 1, 4], torch.bfloat16, 4)
    conv_case([5, 70, 1], torch.bfloat16, None)


def test_decode_ops_replay_in_a_cuda_graph() -> None:
    """All launchers are capturable: replaying the graph on new inputs matches eager calls."""
    batch, dtype = 8, torch.bfloat16
    x = torch.randn(batch, HIDDEN, device=DEV, dtype=dtype)
    r = torch.randn(batch, HIDDEN, device=DEV, dtype=dtype)
    w = torch.randn(HIDDEN, device=DEV, dtype=dtype) * 0.3
    mixed = torch.randn(batch, CONV_DIM, device=DEV, dtype=dtype)
    cw = torch.randn(CONV_DIM, TAPS, device=DEV, dtype=dtype)
    state = torch.randn(batch, CONV_DIM, TAPS - 1, device=DEV, dtype=dtype)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    slots = torch.arange(batch, device=DEV)
    gate_up = torch.randn(batch, 2 * INTER, device=DEV, dtype=dtype)

    def step() -> tuple[torch.Tensor, ...]:
        normed, res = rms_norm(x, w, EPS, r)
        return normed, res, causal_conv1d(mixed, cw, state, cu, slots, 1), swiglu(gate_up)

    start_state = state.clone()
    step()  # compile outside the capture
    state.copy_(start_state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    state.copy_(start_state)
    for t in (x, r, mixed, gate_up):
        t.copy_(torch.randn_like(t))
    graph.replay()
    graph_state = state.clone()
    state.copy_(start_state)
    eager = step()
    for a, b in zip(outs, eager):
        assert torch.equal(a, b)
    assert torch.equal(graph_state, state)


def test_offsets_past_2_pow_31_elements() -> None:
    """Row offsets are 64-bit: a sequence starting beyond 2**31 elements is still correct."""
    first, second = 210_000, 300  # 210000 * 10240 > 2**31
    x = torch.randn(first + second, CONV_DIM, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(CONV_DIM, TAPS, device=DEV, dtype=torch.bfloat16)
    state = torch.randn(2, CONV_DIM, TAPS - 1, device=DEV, dtype=torch.bfloat16)
    one = state[1:].clone()
    cu = torch.tensor([0, first, first + second], dtype=torch.int32, device=DEV)
    out = causal_conv1d(x, w, state, cu, torch.tensor([0, 1], device=DEV), first)
    ref = causal_conv1d_reference(x[first:].float(), w.float(), one.float(),
                                  torch.tensor([0, second], dtype=torch.int32, device=DEV), torch.tensor([0], device=DEV))
    assert_close(out[first:], ref, torch.bfloat16)
    assert torch.equal(state[0], x[first - TAPS + 1: first].t())
    del x, out
    rows = 420_000  # 420000 * 5120 > 2**31
    h = torch.randn(rows, HIDDEN, device=DEV, dtype=torch.bfloat16)
    nw = torch.randn(HIDDEN, device=DEV, dtype=torch.bfloat16) * 0.3
    normed, _ = rms_norm(h, nw, EPS)
    assert_close(normed[-50:], rms_norm_reference(h[-50:].float(), nw.float(), EPS)[0], torch.bfloat16)
