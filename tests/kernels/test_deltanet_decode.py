"""The one-launch Gated DeltaNet decode kernel (CPU interpreter) against the composed PyTorch reference:
conv + SiLU, the gated delta rule and the gated RMSNorm, with their state slots."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import assert_close, poisoned_outputs  # noqa: F401  (fixture)
from ninfer.kernels.deltanet.decode import gated_deltanet_decode_triton
from ninfer.kernels.deltanet.mixer import gated_deltanet, gated_deltanet_reference
from ninfer.kernels.dispatch import INTERPRET

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


def _check(lens: list[int], hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, tol: float, seed: int,
           per_token: bool = False, steps: int = 1) -> None:
    """``steps`` consecutive calls (each reads what the previous one wrote) of kernel and reference on copies
    of the slots; outputs, every state slot and every conv slot compared (untouched ones exactly)."""
    batch = len(lens)
    slots = 2 * batch + batch * max(lens) + 1
    layer = _layer(hk, hv, dk, dv, slots, dtype, seed)
    ref_conv, ref_state = layer["conv_state"].clone(), layer["state"].clone()
    perm = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))
    slot_ids = perm[:batch]
    out_slots = perm[batch:batch + batch * max(lens)].reshape(batch, max(lens)) if per_token else None
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
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


def test_dispatcher_composes_the_ops_off_cuda() -> None:
    """On CPU the dispatcher runs conv, rule and norm in turn: the reference's result, slots included."""
    lens, hk, hv, dk, dv = [5, 1], 1, 2, 16, 16
    layer = _layer(hk, hv, dk, dv, 4, torch.float32, 4)
    ref_conv, ref_state = layer["conv_state"].clone(), layer["state"].clone()
    qkv, z, a, b = _tokens(sum(lens), hv, dv, 2 * hk * dk + hv * dv, torch.float32, 4)
    cu, slot_ids = torch.tensor([0, 5, 6], dtype=torch.int32), torch.tensor([2, 0])
    params = (layer["A_log"], layer["dt_bias"], layer["norm_weight"], EPS)
    out = gated_deltanet(qkv, z, a, b, layer["conv_weight"], layer["conv_state"], *params, layer["state"], cu,
                         slot_ids, 5)
    ref = gated_deltanet_reference(qkv, z, a, b, layer["conv_weight"], ref_conv, *params, ref_state, cu, slot_ids, 5)
    assert torch.equal(out, ref) and torch.equal(layer["state"], ref_state)
    assert torch.equal(layer["conv_state"], ref_conv)
