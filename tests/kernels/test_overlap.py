"""The second-stream policy of :mod:`ninfer.kernels.overlap` and the arrival counters' banks, on the CPU (the forks
themselves run in ``tests/gpu/test_overlap_gpu.py``)."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels import overlap
from ninfer.kernels.counters import BANKS, SLOTS, arrival_counters, counter_bank
from ninfer.kernels.overlap import MAX_ROWS, Overlapped, overlap_enabled, overlapped, wait_for


def test_in_place_off_cuda() -> None:
    x = torch.randn(3, 8)
    calls: list[int] = []
    out = overlapped(lambda: calls.append(1) or x * 2, x)
    assert calls == [1] and not out.forked  # ran at once, on the caller's stream
    assert torch.equal(out.wait(), x * 2) and torch.equal(wait_for(out), x * 2)
    assert wait_for(x) is x


def test_forks_only_captured_decode_sized_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(overlap, "capturing", lambda t: True)
    monkeypatch.delenv("NINFER_OVERLAP", raising=False)
    assert overlap_enabled(torch.empty(MAX_ROWS, 4))
    assert not overlap_enabled(torch.empty(MAX_ROWS + 1, 4))  # prefill chunks stay on one stream
    monkeypatch.setenv("NINFER_OVERLAP", "0")
    assert not overlap_enabled(torch.empty(1, 4))
    monkeypatch.setattr(overlap, "capturing", lambda t: False)
    monkeypatch.setenv("NINFER_OVERLAP", "1")
    assert not overlap_enabled(torch.empty(1, 4))  # eager steps: the host's launches dominate


def test_waiting_twice_waits_once() -> None:
    value = Overlapped(torch.ones(2))
    assert torch.equal(value.wait(), value.wait()) and not value.forked


def test_counter_banks_are_disjoint_zeroed_slices() -> None:
    cpu = torch.device("cpu")
    banks = []
    for bank in range(BANKS):
        with counter_bank(bank):
            banks.append(arrival_counters(cpu))
    assert all(b.shape == (SLOTS,) and b.dtype == torch.int32 and not b.any() for b in banks)
    assert banks[0].data_ptr() + SLOTS * 4 == banks[1].data_ptr()  # one buffer, the side stream's bank after
    assert arrival_counters(cpu).data_ptr() == banks[0].data_ptr()  # bank 0 outside
    with pytest.raises(ValueError, match="counter bank 2"):
        with counter_bank(BANKS):
            pass
