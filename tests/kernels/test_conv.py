"""Triton causal depthwise conv1d + SiLU (CPU interpreter) against the PyTorch reference."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels.conv import causal_conv1d_reference, causal_conv1d_triton
from kernel_testing import assert_close, poisoned_outputs  # noqa: F401  (fixture)
from ninfer.kernels.dispatch import INTERPRET

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]

TOL = {torch.float32: 1e-6, torch.float16: 2e-3}
CHANNELS, TAPS, SLOTS = 48, 4, 8


def run_both(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, lens: list[int], slots: list[int],
             max_seqlen: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run kernel and reference on copies of ``state``; check outputs and every slot, return the kernel's."""
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slot_ids = torch.tensor(slots)
    ref_state = state.clone()
    out = causal_conv1d_triton(x, weight, state, cu, slot_ids, max_seqlen)
    ref = causal_conv1d_reference(x, weight, ref_state, cu, slot_ids)
    if x.shape[0]:
        assert_close(out, ref, TOL[x.dtype])
    assert torch.equal(state, ref_state)  # unused slots and empty sequences untouched, the rest exact
    return out, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bound", ["exact", "none"])
def test_ragged_prefill_with_initial_states(dtype: torch.dtype, bound: str) -> None:
    # Lengths: several tiles (70 = 8 * 8 + 6), below K - 1 (1, 2: old state shifts), K - 1, empty.
    lens, slots = [5, 1, 2, 70, 3, 0], [3, 0, 6, 2, 5, 1]
    x = torch.randn(sum(lens), CHANNELS, dtype=dtype)
    weight = torch.randn(CHANNELS, 1, TAPS, dtype=dtype)[:, 0, :]  # the model passes this strided view
    state = torch.randn(SLOTS, CHANNELS, TAPS - 1, dtype=dtype)
    run_both(x, weight, state, lens, slots, max(lens) if bound == "exact" else None)


def test_short_multi_token_calls_use_small_tiles() -> None:
    lens, slots = [3, 2, 1], [4, 7, 0]  # max_seqlen 3 -> BLOCK_T 4
    x = torch.randn(sum(lens), CHANNELS)
    run_both(x, torch.randn(CHANNELS, TAPS), torch.randn(SLOTS, CHANNELS, TAPS - 1), lens, slots, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_steps_update_slots_in_place(dtype: torch.dtype) -> None:
    weight = torch.randn(CHANNELS, TAPS, dtype=dtype)
    state = torch.randn(SLOTS, CHANNELS, TAPS - 1, dtype=dtype)
    for _ in range(3):  # consecutive steps read what the previous one wrote
        run_both(torch.randn(3, CHANNELS, dtype=dtype), weight, state, [1, 1, 1], [6, 1, 2], 1)


def test_mixed_dtypes_compute_in_weight_dtype() -> None:
    x = torch.randn(9, CHANNELS, dtype=torch.float16)
    run_both(x, torch.randn(CHANNELS, TAPS), torch.randn(SLOTS, CHANNELS, TAPS - 1, dtype=torch.float16),
             [4, 5], [1, 0], 5)


def test_chunks_through_the_state_equal_one_call() -> None:
    x, weight = torch.randn(20, CHANNELS), torch.randn(CHANNELS, TAPS)
    state = torch.zeros(1, CHANNELS, TAPS - 1)
    whole, _ = run_both(x, weight, state.clone(), [20], [0], 20)
    pieces = [run_both(x[a:b], weight, state, [b - a], [0], b - a)[0] for a, b in ((0, 2), (2, 3), (3, 20))]
    assert torch.allclose(torch.cat(pieces), whole, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_token_windows_match_the_reference(dtype: torch.dtype) -> None:
    """Verification: the window after each token lands in its own slot; the input slots are only read."""
    lens, slots = [4, 1, 2, 6], [0, 1, 2, 3]  # 1 and 2 tokens: windows still hold old state
    out_slots = torch.tensor([[4, 5, 6, 7, 15, 15], [8, 15, 15, 15, 15, 15], [9, 10, 15, 15, 15, 15],
                              [11, 12, 13, 14, 16, 17]], dtype=torch.int32)  # 15: never written
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(sum(lens), CHANNELS, dtype=dtype)
    weight = torch.randn(CHANNELS, TAPS, dtype=dtype)
    state = torch.randn(18, CHANNELS, TAPS - 1, dtype=dtype)
    state[4:] = float("nan")
    ref_state = state.clone()
    out = causal_conv1d_triton(x, weight, state, cu, torch.tensor(slots), max(lens), state_out_slots=out_slots)
    ref = causal_conv1d_reference(x, weight, ref_state, cu, torch.tensor(slots), state_out_slots=out_slots)
    assert_close(out, ref, TOL[dtype])
    assert torch.equal(state[:4], ref_state[:4])  # input slots untouched
    assert torch.isnan(state[15]).all()
    written = [int(s) for b, n in enumerate(lens) for s in out_slots[b, :n]]
    assert torch.equal(state[written], ref_state[written])


def test_per_token_windows_reject_long_sequences() -> None:
    x = torch.randn(9, CHANNELS)
    with pytest.raises(ValueError, match="max_seqlen <= 8"):
        causal_conv1d_triton(x, torch.randn(CHANNELS, TAPS), torch.randn(2, CHANNELS, TAPS - 1),
                             torch.tensor([0, 9], dtype=torch.int32), torch.tensor([0]), 9,
                             state_out_slots=torch.ones(1, 9, dtype=torch.int32))
