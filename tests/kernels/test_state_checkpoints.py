"""Prefix-cache checkpoints inside a prefill forward, on the reference path: the DeltaNet state and the conv
window after the first ``r`` tokens of a sequence go to another slot, and equal those of the truncated run."""
from __future__ import annotations

import torch

from ninfer.kernels.conv import causal_conv1d_reference, save_conv_windows
from ninfer.kernels.deltanet import gated_delta_rule_reference

HK, HV, DK, DV = 2, 4, 16, 16
LENS = [1, 63, 64, 65, 150, 200]
OFFSETS = [1, 0, 64, 37, 150, 100]  # 0: no checkpoint; 150: the whole sequence


def _ragged(lens: list[int], seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    return dict(q=torch.randn(n, HK, DK, generator=gen), k=torch.randn(n, HK, DK, generator=gen),
                v=torch.randn(n, HV, DV, generator=gen), a=torch.randn(n, HV, generator=gen),
                b=torch.randn(n, HV, generator=gen))


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


def test_deltanet_checkpoint_is_the_state_of_the_truncated_sequence() -> None:
    x, gen = _ragged(LENS, 0), torch.Generator().manual_seed(1)
    A_log, dt_bias = torch.rand(HV, generator=gen), torch.randn(HV, generator=gen)
    b = len(LENS)
    state = torch.full((2 * b + 1, HV, DK, DV), float("nan"))
    state[:b] = torch.randn(b, HV, DK, DV, generator=gen)
    slots, ckpt_slots = torch.arange(b), torch.arange(b, 2 * b)
    plain_state = state.clone()
    plain = gated_delta_rule_reference(*x.values(), A_log, dt_bias, plain_state, _cu(LENS), slots)
    got_state = state.clone()
    got = gated_delta_rule_reference(*x.values(), A_log, dt_bias, got_state, _cu(LENS), slots,
                                     ckpt_offsets=torch.tensor(OFFSETS), ckpt_slots=ckpt_slots)
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state[:b], plain_state[:b], rtol=1e-5, atol=1e-5)
    # the truncated batch: each sequence's first r tokens (r = 0: none of it)
    keep = torch.cat([torch.arange(s, s + r) for s, r in zip(_cu(LENS)[:-1].tolist(), OFFSETS)])
    short_state = state.clone()
    gated_delta_rule_reference(*(t[keep] for t in x.values()), A_log, dt_bias, short_state, _cu(OFFSETS), slots)
    for i, r in enumerate(OFFSETS):
        if r:
            torch.testing.assert_close(got_state[b + i], short_state[i], rtol=1e-5, atol=1e-5)
        else:
            assert torch.isnan(got_state[b + i]).all()
    assert torch.isnan(got_state[-1]).all()


def test_conv_window_is_the_state_of_the_truncated_sequence() -> None:
    gen = torch.Generator().manual_seed(2)
    channels, taps, b = 8, 4, len(LENS)
    x = torch.randn(sum(LENS), channels, generator=gen)
    weight = torch.randn(channels, taps, generator=gen)
    conv = torch.full((2 * b, channels, taps - 1), float("nan"))
    conv[:b] = torch.randn(b, channels, taps - 1, generator=gen)
    starts = _cu(LENS)[:-1].tolist()
    checkpoints = tuple((starts[i], r, i, b + i) for i, r in enumerate(OFFSETS) if r)
    got = conv.clone()
    save_conv_windows(x, got, checkpoints)  # before the conv overwrites the sequences' own slots
    causal_conv1d_reference(x, weight, got, _cu(LENS), torch.arange(b))
    keep = torch.cat([torch.arange(s, s + r) for s, r in zip(starts, OFFSETS)])
    short = conv.clone()
    causal_conv1d_reference(x[keep], weight, short, _cu(OFFSETS), torch.arange(b))
    for i, r in enumerate(OFFSETS):
        if r:
            assert torch.equal(got[b + i], short[i])
