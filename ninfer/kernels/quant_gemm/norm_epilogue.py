"""The RMSNorm that follows a decode GEMM, in the GEMM's own launch.

A decoder layer's output projections (attention ``o_proj``, DeltaNet ``out_proj``, the MLP's ``down_proj``) are
each followed by a zero-centred RMSNorm over the new residual stream (``h = y + residual``): at decode a launch of
its own, and a gap before it, twice per layer. The norm needs whole rows of ``h`` while a GEMM program owns 16
outputs of it, so the programs count themselves in at one arrival counter (:mod:`ninfer.kernels.counters`) after
writing their part of ``h``; the last to arrive sees all of it and normalizes every row. That is serial work for
one program, cheap only for a few rows (decode: the launcher takes this path up to ``MAX_ROWS``), and it reads
``h`` back from L2, which the other programs wrote during this launch. The sum over a row runs in a fixed order:
results do not depend on which program arrives last.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # tokens up to which a GEMM applies the norm itself (the last program's serial work grows with them)
NORM_BLOCK = tl.constexpr(1024)  # columns per step of the last program's passes over a row


@dataclass(frozen=True)
class ThenNorm:
    """What a GEMM launch needs to apply the norm after it: the norm's ``weight`` (zero-centred: scales by
    ``1 + weight``) and ``eps``, and ``normed``, the buffer its output goes to (the GEMM's own output is the new
    residual stream)."""

    weight: torch.Tensor
    eps: float
    normed: torch.Tensor


@triton.jit
def norm_when_all_arrived(cnt_ptr, h_ptr, stride_hm, w_ptr, normed_ptr, stride_nm, M, N, eps):
    """Counts this program in at the counter after the output tiles' (grid axes 0 and 2 give the tiles, as in
    :func:`~ninfer.kernels.quant_gemm.gemv_steps.last_split_arrived`), after its stores of ``h`` (release). The last
    program to arrive (acquire) writes ``normed[m] = h[m] * rsqrt(mean(h[m]^2) + eps) * (1 + w)`` for rows ``m <
    M`` of ``h [M, N]`` and resets the counter. Call it once per program that finished output tiles."""
    slot = tl.num_programs(0) * tl.num_programs(2)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel")
    if arrived == slot - 1:
        tl.debug_barrier()
        cols = tl.arange(0, NORM_BLOCK)
        for m in range(M):
            row = h_ptr + m * stride_hm  # at most MAX_ROWS rows: int32 offsets
            squares = tl.zeros((NORM_BLOCK,), dtype=tl.float32)
            for c0 in range(0, N, NORM_BLOCK):
                h = tl.load(row + c0 + cols, mask=c0 + cols < N, other=0.0, cache_modifier=".cg").to(tl.float32)
                squares += h * h
            rstd = tl.rsqrt(tl.sum(squares, axis=0) / N + eps)  # as the norm kernel (norms.py)
            out = normed_ptr + m * stride_nm
            for c0 in range(0, N, NORM_BLOCK):
                mask = c0 + cols < N
                h = tl.load(row + c0 + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
                w = tl.load(w_ptr + c0 + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(out + c0 + cols, (h * rstd * (1.0 + w)).to(normed_ptr.dtype.element_ty), mask=mask)
        tl.store(cnt_ptr + slot, 0)
