"""Arrival counters: the zeroed device buffer through which the programs of one launch find the last of them.

Kernels that finish a reduction in-launch (the split-K GEMMs' fused reduction, the DeltaNet decode's gated norm
and conv windows) count their programs in with an atomic add per group; the last to arrive does the group's
final work and resets its counter, so every launch leaves the buffer at zero. Launches on one stream run one
after another, so they share a bank of counters; launches on the second stream that
:mod:`ninfer.kernels.overlap` runs beside the first may run at the same time, so they take the other bank
(:func:`counter_bank`). The buffer is allocated on first use outside CUDA-graph capture and kept for the
process, since captured graphs keep its address.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ninfer.kernels.scoped import scoped

SLOTS = 1 << 16  # counters per bank (256 KB): output tiles of a split GEMM, or sequences x key heads
BANKS = 2  # the current stream's and the overlapped side stream's
_BANKS: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # per device: views of one buffer, one per bank
_bank: ContextVar[int] = ContextVar("ninfer_counter_bank", default=0)


@contextmanager
def counter_bank(bank: int) -> Iterator[None]:
    """Inside, :func:`arrival_counters` hands out bank ``bank`` (0: the default; 1: launches that may run beside
    bank 0's on another stream). Holds in this block and thread only (a context variable)."""
    if not 0 <= bank < BANKS:
        raise ValueError(f"counter bank {bank} is not in [0, {BANKS})")
    with scoped(_bank, bank):
        yield


def arrival_counters(device: torch.device) -> torch.Tensor | None:
    """The current bank's ``SLOTS`` zeroed int32 counters on ``device``, or None on a first use inside CUDA-graph
    capture (nothing can be allocated and zeroed for the graph to keep)."""
    banks = _BANKS.get(device)
    if banks is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(BANKS * SLOTS, dtype=torch.int32, device=device)
        banks = _BANKS[device] = tuple(buf[b * SLOTS:(b + 1) * SLOTS] for b in range(BANKS))
    return banks[_bank.get()]
