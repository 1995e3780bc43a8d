"""L2 prefetch of a weight the step will read soon, launched beside the latency-bound kernels before it.

At batch 1 the small projections after a mixer (attention's o_proj, DeltaNet's out_proj: 8-16 MB) take two to
three times their bytes' time on the H200, most of it the latency of their first loads from memory. While the
attention or DeltaNet decode kernel runs, memory is nearly idle: ``prefetch_l2`` asks the L2 for the weight's
128-byte lines then (``prefetch.global.L2::evict_last``: no registers, no data into the SMs), from the second
stream of a captured step (:func:`prefetched`), so that the projection finds its bytes in the L2.

It is a hint: nothing reads its result, so off CUDA and in the interpreter it does nothing. Off by default
until measured (``NINFER_PREFETCH=1``, read at graph capture). A different placement was measured before: the
decode GEMMs' own first lines prefetched in their prologue under programmatic dependent launch, which made the
27B C = 8 step 6-9% slower (docs/performance.md, run 2026-12-01.3); here the whole weight is asked for from the
other stream while the mixer's decode kernel leaves memory idle.
"""
from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.overlap import Overlapped, overlap_enabled, overlapped

LINE = 128  # bytes per prefetched L2 line
LINES_PER_PROGRAM = 128  # one line per thread of a 4-warp program


@triton.jit
def _prefetch_kernel(ptr, n_lines, LINES: tl.constexpr):
    lines = tl.program_id(0) * LINES + tl.arange(0, LINES)
    addr = ptr + tl.minimum(lines, n_lines - 1).to(tl.int64) * 128
    # not pure: a side effect, so the unused result does not remove it
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr],
                              dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(tensors: Iterable[torch.Tensor]) -> int:
    """Ask the L2 for every byte of ``tensors`` (CUDA, contiguous); returns the bytes asked for (0 elsewhere)."""
    asked = 0
    for t in tensors:
        if not t.is_cuda or INTERPRET or t.numel() == 0 or not t.is_contiguous():
            continue
        nbytes = t.numel() * t.element_size()
        n_lines = triton.cdiv(nbytes, LINE)
        _prefetch_kernel[(triton.cdiv(n_lines, LINES_PER_PROGRAM),)](t.view(torch.uint8).view(-1), n_lines,
                                                                   LINES=LINES_PER_PROGRAM, num_warps=4)
        asked += nbytes
    return asked


def prefetch_enabled() -> bool:
    return os.environ.get("NINFER_PREFETCH", "0") == "1"


def prefetched(tensors: Iterable[torch.Tensor], like: torch.Tensor) -> Overlapped[int]:
    """:func:`prefetch_l2` of ``tensors`` on the second stream of a captured decode step (where
    :func:`~ninfer.kernels.overlap.overlapped` forks) with ``NINFER_PREFETCH=1``, else nothing (a prefetch right
    before the read is no use); wait for it (:func:`~ninfer.kernels.overlap.wait_for`) before the launch that
    reads them."""
    if not (prefetch_enabled() and overlap_enabled(like)):
        return Overlapped(0)
    tensors = list(tensors)
    return overlapped(lambda: prefetch_l2(tensors), like)
