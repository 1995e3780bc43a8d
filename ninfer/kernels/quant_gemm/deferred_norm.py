"""The norm after an output projection, left to the GEMMs that read its rows (:class:`.norms.NormedRows`).

At decode a decoder layer's two norms are launches of their own (and a gap before each): the norm needs whole rows of
``h = y + residual`` while a GEMM program owns a few columns of them. Run 2026-12-05.7 had the output projection's
last program normalize every row (:mod:`.norm_epilogue`): a serial pass that cost more than the launch it removed.
Here nothing is serial. The norm is linear in the row up to its one factor ``rsqrt(mean(h^2) + eps)``, so:

* the producer (an output projection's register decode, ``DEFER``) writes the new residual stream ``h``, the scaled
  rows ``h * (1 + w)`` and, from each program that finishes output tiles, its tile group's share of every row's sum of
  squares: one fp32 per (tile group, row), no atomics, no arrival counter, no zeroing between steps;
* each consumer (the register decode of the next projections, ``ROW_NORM``, the float GEMV of the DeltaNet gates and
  routers, the expert kernels) multiplies its fp32 sums by the row's factor before its epilogue (SwiGLU included: the
  factor applies to the gate and the up sums alike). With the fused split-K sum only the split that sums does, after
  the sum, its shares requested beside the partials (where a reduce kernel sums the splits, as for the expert GEMV:
  that kernel, once per sum). When every program summed the shares and picked its lanes' factors, the readers of the
  27B ran 22-37% slower than the plain GEMM (run 2026-12-05.16; some 250 instructions beside a loop of about 1,400,
  in programs of about three loop trips). Without splits every program does.

The one change in numerics: the GEMM reads ``h * (1 + w)`` rounded to the model dtype and scales the fp32 sum, where
the composed path rounds ``h * rstd * (1 + w)``; the same bound, not the same bits. The shares add up in a fixed
order (deterministic).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ninfer.kernels.norms import NormedRows

# Tokens up to which an output projection defers its norm: where its readers take the register decode and the float
# GEMV (at 17-32 tokens the tuner may pick the tiled GEMM, and the float GEMV stops at 16; both would read the
# rows materialized, a few launches more than the norm's own).
MAX_ROWS = 16
STATS_ELEMENTS = 1024  # shares x rows a consumer loads per step of its sum (8 registers a thread at 128 threads)


def parts_block(n_parts: int, rows: int) -> int:
    """The consumer's shares per load step for ``rows`` rows: all of them where they fit ``STATS_ELEMENTS``."""
    return max(1, min(triton.next_power_of_2(n_parts), STATS_ELEMENTS // triton.next_power_of_2(rows)))


class ReaderArgs(NamedTuple):
    """What a reading kernel takes for its ``ROW_NORM``: the shares (``stats [parts, M]``), their count, ``eps`` and
    the shares per load step of :func:`rows_rstd`."""

    stats: torch.Tensor
    parts: int
    eps: float
    parts_block: int


def reader_args(row_norm: NormedRows | None, rows: int, placeholder: torch.Tensor) -> ReaderArgs:
    """:class:`ReaderArgs` of ``row_norm`` for programs of ``rows`` rows; without it, ``placeholder`` stands for the
    pointer the kernel then never reads."""
    if row_norm is None:
        return ReaderArgs(placeholder, 0, 0.0, 1)
    parts = row_norm.stats.shape[0]
    return ReaderArgs(row_norm.stats, parts, row_norm.eps, parts_block(parts, rows))


@triton.jit
def first_shares(stats_ptr, n_parts, rows, M, PARTS_BLOCK: tl.constexpr):
    """The first ``PARTS_BLOCK`` shares of ``rows [R]`` in ``stats [n_parts, M]`` (0 past either), as loaded: a reader
    requests them before its loop and sums them after it (:func:`rstd_of_shares`), so no warp waits for them, or for
    the others, before its first codes. Loads bypass L1: the producer wrote them in the launch before."""
    parts = tl.arange(0, PARTS_BLOCK)[:, None]
    mask = (parts < n_parts) & (rows < M)[None, :]
    return tl.load(stats_ptr + parts * M + rows[None, :], mask=mask, other=0.0, cache_modifier=".cg")


@triton.jit
def rstd_of_shares(first, stats_ptr, n_parts, rows, M, K, eps, PARTS_BLOCK: tl.constexpr):
    """``rsqrt(sum(stats[:, rows]) / K + eps)`` from the :func:`first_shares` of ``rows`` and the rest of them (rows
    past ``M``: ``rsqrt(eps)``, read by nothing)."""
    acc = first
    for p0 in range(PARTS_BLOCK, n_parts, PARTS_BLOCK):
        parts = p0 + tl.arange(0, PARTS_BLOCK)[:, None]  # built apart from first_shares' pointers: not kept alive
        mask = (parts < n_parts) & (rows < M)[None, :]
        acc += tl.load(stats_ptr + parts * M + rows[None, :], mask=mask, other=0.0, cache_modifier=".cg")
    return tl.rsqrt(tl.sum(acc, axis=0) / K + eps)


@triton.jit
def rows_rstd(stats_ptr, n_parts, rows, M, K, eps, PARTS_BLOCK: tl.constexpr):
    """``rsqrt(sum(stats[:, rows]) / K + eps)`` for ``rows [R]`` of ``stats [n_parts, M]``, loaded and summed at once
    (for a reader that needs it after its loop anyway)."""
    first = first_shares(stats_ptr, n_parts, rows, M, PARTS_BLOCK)
    return rstd_of_shares(first, stats_ptr, n_parts, rows, M, K, eps, PARTS_BLOCK)


@triton.jit
def lane_factors(r, t, BASE: tl.constexpr, ROWS: tl.constexpr):
    """``r[BASE + 2 t]`` for every lane (``t`` in 0..3: the lane's column pair of an MMA's D fragment), ``r [ROWS]``
    the factors of a token block's rows: the four candidates are picked first, so no lane holds all ``ROWS``."""
    four = tl.arange(0, 4)
    picks = tl.arange(0, ROWS)[:, None] == BASE + 2 * four[None, :]
    r4 = tl.sum(tl.where(picks, r[:, None], 0.0), axis=0)
    return tl.sum(tl.where(four[None, :] == t[:, None], r4[None, :], 0.0), axis=1)


@triton.jit
def scaled_by_rows(acc, r, t, NB: tl.constexpr):
    """A lane's ``4 NB`` register-decode accumulators (accumulator ``i``: row ``8 (i // 4) + 2 t + i % 2`` of the
    token block) times their rows' factors ``r [8 NB]``."""
    out = ()
    for i in tl.static_range(4 * NB):
        out = out + (acc[i] * lane_factors(r, t, 8 * (i // 4) + i % 2, 8 * NB),)
    return out


@triton.jit
def finish_deferred(y, m_idx, n_idx, mask, res_ptr, stride_rm, out_ptr, stride_om, w_ptr, scaled_ptr, stride_sm,
                    HAS_RES: tl.constexpr):
    """The producer's epilogue of outputs ``(m_idx, n_idx)``: ``h = round(round(y) + residual)`` (the unfused GEMM's
    output and the norm's residual add, rounded as they round) to ``out``, ``round(h * (1 + w))`` to ``scaled``;
    returns ``h^2`` in fp32 (0 where masked)."""
    h = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    m64 = m_idx.to(tl.int64)
    if HAS_RES:
        h += tl.load(res_ptr + m64 * stride_rm + n_idx, mask=mask, other=0.0).to(tl.float32)
    h = h.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + m64 * stride_om + n_idx, h, mask=mask)
    hf = h.to(tl.float32)
    w = tl.load(w_ptr + n_idx, mask=mask, other=0.0).to(tl.float32)
    tl.store(scaled_ptr + m64 * stride_sm + n_idx, (hf * (1.0 + w)).to(scaled_ptr.dtype.element_ty), mask=mask)
    return tl.where(mask, hf * hf, 0.0)


@triton.jit
def add_lane_squares(sq_rows, sq, m_rel, ROWS: tl.constexpr):
    """``sq_rows [lanes, ROWS]`` plus each lane's ``sq`` in the column of its row ``m_rel``."""
    return sq_rows + tl.where(tl.arange(0, ROWS)[None, :] == m_rel[:, None], sq[:, None], 0.0)


@triton.jit
def store_row_stats(stats_ptr, part, rows, M, sums):
    """Share ``part`` of rows ``rows`` (``sums``, one per row) into ``stats [parts, M]``."""
    tl.store(stats_ptr + part * M + rows, sums, mask=rows < M)
