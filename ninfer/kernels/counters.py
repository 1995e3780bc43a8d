"""Arrival counters: the zeroed device buffer through which the programs of one launch find the last of them.

Kernels that finish a reduction in-launch (the split-K GEMMs' fused reduction, the DeltaNet decode's gated norm
and conv windows) count their programs in with an atomic add per group; the last to arrive does the group's
final work and resets its counter, so every launch leaves the buffer at zero. One buffer per device serves
them all: launches on one stream run one after another (concurrent streams would share it: one such launch at
a time per device). It is allocated on first use outside CUDA-graph capture and kept for the process, since
captured graphs keep its address.
"""
from __future__ import annotations

import torch

SLOTS = 1 << 16  # counters per device (256 KB): output tiles of a split GEMM, or sequences x key heads
_BUFFERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor | None:
    """The device's ``SLOTS`` zeroed int32 counters, or None on a first use inside CUDA-graph capture (nothing
    can be allocated and zeroed for the graph to keep)."""
    buf = _BUFFERS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _BUFFERS[device] = torch.zeros(SLOTS, dtype=torch.int32, device=device)
    return buf
