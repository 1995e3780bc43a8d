"""The one-launch Gated DeltaNet decode kernel (CPU interpreter) against the composed PyTorch reference:
conv + SiLU, the gated delta rule and the gated RMSNorm, with their state slots; and in fp16 against the
composed Triton path (conv, recurrent rule and gated norm kernels), whose roundings it must repeat."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import assert_close, poisoned_outputs  # noqa: F401  (fixture)
from ninfer.kernels.conv import causal_conv1d_triton
from ninfer.kernels.deltanet.decode import gated_deltanet_decode_triton
from ninfer.kernels.deltanet.mixer import GateProjection, gated_deltanet, gated_deltanet_reference
from ninfer.kernels.deltanet.recurrent import gated_delta_rule_recurrent_triton
from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.norms import NormedRows, gated_rms_norm_triton

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]

TAPS, EPS = 4, 1e-6


def _layer(hk: int, hv: int, dk: int, dv: int, slots: int, dtype: torch.dtype, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    channels = 2 * hk * dk + hv * dv
    return dict(
        conv_weight=(torch.randn(channels, 1, TAPS, generator=gen) * 0.5).to(dtype)[:, 0, :],  # the model's view
        conv_state=torch.randn(slots, channels, TAPS - 1, generator=gen).to(dtype),
        A_log=torch.empty(hv).uniform_(0.0, 2.5, generator=gen), dt_bias=torch.randn(hv, generator=gen),
        norm_weight=(1.0 + 0.1 * torch.randn(dv, generator=gen)).to(dtype),
        state=torch.randn(slots, hv, dk, dv, generator=gen),
    )


def _tokens(n: int, hv: int, dv: int, channels: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """qkv, z (one projection's column views) and a, b (another's), as the model passes them."""
    gen = torch.Generator().manual_seed(seed)
    qkvz = torch.randn(n, channels + hv * dv, generator=gen).to(dtype)
    ab = (torch.randn(n, 2 * hv, generator=gen) * torch.tensor([2.0] * hv + [1.0] * hv)).to(dtype)
    return (*qkvz.split([channels, hv * dv], dim=-1), *ab.split([hv, hv], dim=-1))


def _slots(lens: list[int], per_token: bool, seed: int) -> tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Slot count, the sequences' input slots, their per-token out slots (verification rows) and cu_seqlens."""
    batch = len(lens)
    slots = 2 * batch + batch * max(lens) + 1
    perm = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))
    out_slots = perm[batch:batch + batch * max(lens)].reshape(batch, max(lens)) if per_token else None
    return slots, perm[:batch], out_slots, torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _check(lens: list[int], hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, tol: float, seed: int,
           per_token: bool = False, steps: int = 1) -> None:
    """``steps`` consecutive calls (each reads what the previous one wrote) of kernel and reference on copies
    of the slots; outputs, every state slot and every conv slot compared (untouched ones exactly)."""
    slots, slot_ids, out_slots, cu = _slots(lens, per_token, seed)
    layer = _layer(hk, hv, dk, dv, slots, dtype, seed)
    ref_conv, ref_state = layer["conv_state"].clone(), layer["state"].clone()
    for step in range(steps):
        qkv, z, a, b = _tokens(sum(lens), hv, dv, 2 * hk * dk + hv * dv, dtype, seed + 100 * step)
        args = (qkv, z, a, b, layer["conv_weight"])
        params = (layer["A_log"], layer["dt_bias"], layer["norm_weight"], EPS)
        out = gated_deltanet_decode_triton(*args, layer["conv_state"], *params, layer["state"], cu, slot_ids,
                                           max(lens), out_slots)
        ref = gated_deltanet_reference(*args, ref_conv, *params, ref_state, cu, slot_ids, max(lens), out_slots)
        assert_close(out, ref, tol)
        assert_close(layer["state"], ref_state, tol)
        assert_close(layer["conv_state"].float(), ref_conv.float(), 1e-7)  # copies of inputs: exact
        assert torch.equal(layer["conv_state"], ref_conv)


@pytest.mark.parametrize("block", [16, 32, 64])
def test_every_block_width(block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Programs over value-column blocks (the interpreter runs the first config; each width here): several
    blocks per head, whose last program to arrive normalizes the group's outputs and writes its q/k windows."""
    import triton

    from ninfer.kernels.deltanet import decode

    monkeypatch.setattr(decode._decode_kernel, "configs", [triton.Config({"BV": block}, num_warps=2)])
    _check([1, 3, 0, 2], 2, 6, 16, 64, torch.float32, 2e-5, seed=block, steps=2)
    _check([2, 1], 1, 2, 32, 64, torch.float32, 2e-5, seed=block + 1, per_token=True)


def test_decode_ragged_gqa_several_steps() -> None:
    # GQA (3 value heads per key head), an empty sequence, and three steps that continue the slots.
    _check([1, 1, 0, 1], hk=2, hv=6, dk=16, dv=32, dtype=torch.float32, tol=1e-5, seed=0, steps=3)


def test_multi_token_rows_update_in_place() -> None:
    # Up to 4 tokens per sequence; lengths below K - 1 shift part of the old conv window.
    _check([3, 1, 2, 4], hk=2, hv=4, dk=32, dv=16, dtype=torch.float32, tol=1e-5, seed=1)


def test_speculative_rows_write_every_token_to_its_slot() -> None:
    # K + 1 = 4 verification rows per sequence (one shorter); input slots only read.
    _check([4, 4, 3], hk=1, hv=2, dk=16, dv=16, dtype=torch.float32, tol=1e-5, seed=2, per_token=True)


def test_fp16_inputs() -> None:
    _check([1, 2], hk=2, hv=4, dk=16, dv=32, dtype=torch.float16, tol=2e-3, seed=3, steps=2)


def _composed_triton(qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layer: dict,
                     conv_state: torch.Tensor, state: torch.Tensor, cu: torch.Tensor, slot_ids: torch.Tensor,
                     max_seqlen: int, out_slots: torch.Tensor | None) -> torch.Tensor:
    """Conv, recurrent rule and gated norm as three Triton launches: the path the one-launch kernel replaces."""
    n, (hv, dk, dv) = qkv.shape[0], state.shape[1:]
    hk = (qkv.shape[1] - hv * dv) // (2 * dk)
    mixed = causal_conv1d_triton(qkv, layer["conv_weight"], conv_state, cu, slot_ids, max_seqlen, out_slots)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    o = gated_delta_rule_recurrent_triton(q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), a, b,
                                          layer["A_log"], layer["dt_bias"], state, cu, slot_ids, out_slots)
    return gated_rms_norm_triton(o, z.view(n, hv, dv), layer["norm_weight"], EPS).reshape(n, hv * dv)


def _ulps(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place of same-signed fp16 values (their bit patterns are ordered)."""
    return (x.view(torch.int16).int() - ref.view(torch.int16).int()).abs()


@pytest.mark.parametrize("case", [
    ([1, 3, 0, 4], 2, 6, 16, 32, False),  # GQA, ragged, an empty sequence, in place
    ([4, 2], 1, 2, 32, 16, True),  # verification rows: per-token state and conv slots
    ([1, 4], 1, 1, 128, 128, False),  # the models' head dims
], ids=["gqa-ragged", "per-token", "dk128"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_repeats_the_composed_triton_roundings(case: tuple, dtype: torch.dtype) -> None:
    """fp16 (the interpreter computes it right, unlike bf16): both paths round at the same points (conv sum and
    SiLU output to the weight / input dtype, the rule's output before the norm, the normed value and its product
    with the weight), so they agree to the bit; only fp32 summation order may differ, which can flip a rounding
    rarely. One rounding point more or less in either path flips 10-50% of the outputs by an ulp or more, far
    over the bound of at most 1% one ulp off; tests/gpu/test_deltanet_decode_gpu.py checks the same in bf16."""
    lens, hk, hv, dk, dv, per_token = case
    slots, slot_ids, out_slots, cu = _slots(lens, per_token, 5)
    layer = _layer(hk, hv, dk, dv, slots, dtype, seed=5)
    tri_conv, tri_state = layer["conv_state"].clone(), layer["state"].clone()
    for step in range(2):  # the second call reads the slots the first one wrote
        qkv, z, a, b = _tokens(sum(lens), hv, dv, 2 * hk * dk + hv * dv, dtype, 50 + step)
        params = (layer["A_log"], layer["dt_bias"], layer["norm_weight"], EPS)
        out = gated_deltanet_decode_triton(qkv, z, a, b, layer["conv_weight"], layer["conv_state"], *params,
                                           layer["state"], cu, slot_ids, max(lens), out_slots)
        tri = _composed_triton(qkv, z, a, b, layer, tri_conv, tri_state, cu, slot_ids, max(lens), out_slots)
        assert torch.isfinite(out).all() and torch.isfinite(tri).all()
        if dtype == torch.float16:
            off = _ulps(out, tri)
            assert off.max() <= 1 and (off > 0).float().mean() <= 1e-2, f"{(off > 0).sum()} of {off.numel()} differ"
        else:
            assert_close(out, tri, 1e-6)
        assert torch.equal(layer["conv_state"], tri_conv)
        state_err = ((layer["state"] - tri_state).norm() / tri_state.norm()).item()
        assert state_err < 1e-7, f"state relative error {state_err:.2e}"


@pytest.mark.parametrize("per_token", [False, True], ids=["in-place", "per-token"])
def test_conv_weight_narrower_than_the_activations(per_token: bool) -> None:
    """fp32 activations and slots, an fp16 conv weight: the conv reads its window in the weight's dtype, so the
    windows it writes back are rounded through it too (the reference's and the conv kernel's), while the rule and
    the norm stay in fp32."""
    lens, hk, hv, dk, dv = [3, 1], 1, 2, 16, 16
    slots, slot_ids, out_slots, cu = _slots(lens, per_token, 6)
    layer = _layer(hk, hv, dk, dv, slots, torch.float32, seed=6)
    layer["conv_weight"] = layer["conv_weight"].half()
    ref_conv, ref_state = layer["conv_state"].clone(), layer["state"].clone()
    qkv, z, a, b = _tokens(sum(lens), hv, dv, 2 * hk * dk + hv * dv, torch.float32, 6)
    params = (layer["A_log"], layer["dt_bias"], layer["norm_weight"], EPS)
    out = gated_deltanet_decode_triton(qkv, z, a, b, layer["conv_weight"], layer["conv_state"], *params,
                                       layer["state"], cu, slot_ids, max(lens), out_slots)
    ref = gated_deltanet_reference(qkv, z, a, b, layer["conv_weight"], ref_conv, *params, ref_state, cu, slot_ids,
                                   max(lens), out_slots)
    assert_close(out, ref, 1e-5)
    assert_close(layer["state"], ref_state, 1e-5)
    assert torch.equal(layer["conv_state"], ref_conv)


def test_dispatcher_composes_the_ops_off_cuda() -> None:
    """On CPU the dispatcher runs conv, rule and norm in turn: the reference's result, slots included."""
    lens, hk, hv, dk, dv = [5, 1], 1, 2, 16, 16
    layer = _layer(hk, hv, dk, dv, 4, torch.float32, 4)
    ref_conv, ref_state = layer["conv_state"].clone(), layer["state"].clone()
    qkv, z, a, b = _tokens(sum(lens), hv, dv, 2 * hk * dk + hv * dv, torch.float32, 4)
    cu, slot_ids = torch.tensor([0, 5, 6], dtype=torch.int32), torch.tensor([2, 0])
    params = (layer["A_log"], layer["dt_bias"], layer["norm_weight"], EPS)
    out = gated_deltanet(qkv, z, (a, b), layer["conv_weight"], layer["conv_state"], *params, layer["state"], cu,
                         slot_ids, 5)
    ref = gated_deltanet_reference(qkv, z, a, b, layer["conv_weight"], ref_conv, *params, ref_state, cu, slot_ids, 5)
    assert torch.equal(out, ref) and torch.equal(layer["state"], ref_state)
    assert torch.equal(layer["conv_state"], ref_conv)


def _gate_inputs(n: int, hidden: int, hv: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    return x, (torch.randn(2 * hv, hidden, generator=gen) * hidden ** -0.5 * 2).to(dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("per_token", [False, True], ids=["in-place", "per-token"])
@pytest.mark.parametrize("deferred", [False, True], ids=["rows", "deferred-rows"])
def test_gates_projected_in_the_kernel(dtype: torch.dtype, tol: float, per_token: bool, deferred: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The a/b projection applied by each program (x and the float weight instead of a and b): the result of the
    kernel fed ``F.linear``'s gates; several unrolled K blocks, the last one partial. Deferred rows
    (:class:`NormedRows`, five shares per row): each token's sums times its row's factor, as the float GEMV applies
    it."""
    from ninfer.kernels.deltanet import decode

    monkeypatch.setattr(decode, "GATE_BLOCK", 32)
    lens, hk, hv, dk, dv, hidden = [1, 3, 0, 2], 2, 6, 16, 32, 80
    slots, slot_ids, out_slots, cu = _slots(lens, per_token, 8)
    layer = _layer(hk, hv, dk, dv, slots, dtype, seed=8)
    ab_conv, ab_state = layer["conv_state"].clone(), layer["state"].clone()
    params = (layer["A_log"], layer["dt_bias"], layer["norm_weight"], EPS)
    for step in range(2):
        qkv, z, _, _ = _tokens(sum(lens), hv, dv, 2 * hk * dk + hv * dv, dtype, 80 + step)
        x, w = _gate_inputs(sum(lens), hidden, hv, dtype, 90 + step)
        gate_x, factor = x, torch.ones(sum(lens), 1)
        if deferred:
            stats = torch.rand(5, sum(lens), generator=torch.Generator().manual_seed(step)) * hidden * 0.6
            gate_x = NormedRows(x, stats, 1e-6)
            factor = gate_x.rstd()[:, None]
        a, b = (torch.nn.functional.linear(x.float(), w.float()) * factor).to(dtype).split(hv, dim=-1)
        fused = gated_deltanet_decode_triton(qkv, z, None, None, layer["conv_weight"], layer["conv_state"], *params,
                                             layer["state"], cu, slot_ids, max(lens), out_slots, gate_x=gate_x,
                                             gate_weight=w)
        given = gated_deltanet_decode_triton(qkv, z, a, b, layer["conv_weight"], ab_conv, *params, ab_state, cu,
                                             slot_ids, max(lens), out_slots)
        assert torch.isfinite(fused).all()
        assert_close(fused, given, tol)
        assert_close(layer["state"], ab_state, tol)
        assert torch.equal(layer["conv_state"], ab_conv)


def test_dispatcher_projects_the_gates_where_the_kernel_does_not() -> None:
    """Off CUDA (and wherever the one-launch decode does not run) a GateProjection is called: the same result as
    its (a, b)."""
    lens, hk, hv, dk, dv = [5, 1], 1, 2, 16, 16
    layer = _layer(hk, hv, dk, dv, 4, torch.float32, 9)
    ref_conv, ref_state = layer["conv_state"].clone(), layer["state"].clone()
    qkv, z, _, _ = _tokens(sum(lens), hv, dv, 2 * hk * dk + hv * dv, torch.float32, 9)
    x, w = _gate_inputs(sum(lens), 24, hv, torch.float32, 9)
    project = lambda t: torch.nn.functional.linear(t, w)  # noqa: E731
    a, b = project(x).split(hv, dim=-1)
    cu, slot_ids = torch.tensor([0, 5, 6], dtype=torch.int32), torch.tensor([2, 0])
    params = (layer["A_log"], layer["dt_bias"], layer["norm_weight"], EPS)
    out = gated_deltanet(qkv, z, GateProjection(x, project, w), layer["conv_weight"], layer["conv_state"], *params,
                         layer["state"], cu, slot_ids, 5)
    ref = gated_deltanet_reference(qkv, z, a, b, layer["conv_weight"], ref_conv, *params, ref_state, cu, slot_ids, 5)
    assert torch.equal(out, ref) and torch.equal(layer["state"], ref_state)
