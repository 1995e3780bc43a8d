"""Decode GEMV for quantized weights: ``y = x @ W^T`` for a few tokens (M <= 8), without ``tl.dot``.

At decode the weight bytes are the whole cost, so this path is built for the memory stream rather
than the MMA: the ``tl.dot`` path pads M to 16 (its MMA tile) and spends registers, shared memory
and issue slots on a tile that is mostly empty, which measured 16-47 % of copy bandwidth on an H200.

* Each program owns ``BLOCK_N`` weight rows and one K range (split-K over ``program_id(1)``, chosen
  by the tuner so that the grid has >= ~4 programs per SM) and walks it ``BLOCK_K`` columns at a
  time. A step loads a ``[BLOCK_N, BLOCK_K bytes-per-row]`` slab of packed bytes (K contiguous, so
  16-byte vector loads of whole packed words), dequantizes it in registers once, and for each of
  the BLOCK_M activation rows multiplies it by the broadcast x row and reduces along K with
  ``tl.sum`` (fp32). The dequantized slab stays in registers across the rows.
* Scales never multiply single weights: the products are summed per scale group first, and the
  group sum is scaled (``[BLOCK_N, groups]`` multiplies per row of x). int4 nibbles become
  ``v = 1 + nibble / 16`` from one shift and one bit-or (no subtraction per weight) and the group
  sum is corrected as ``16 * sum(v x) - 24 * sum(x)`` (``= sum((nibble - 8) x)``), with ``sum(x)``
  shared by all rows. e2m1 values keep their ``2^-126`` factor from the bit trick of
  :mod:`ninfer.kernels.quant_gemm.common`; ``2^63`` goes into x and ``2^63`` into the scale.
* fp8 row scales and the nvfp4 global scale multiply the accumulator once. Split-K partials go to
  an fp32 scratch ``[splits, M, N_OUT (x2 for SwiGLU)]`` that every program writes in full (no
  zeroing), and the last split of each output tile to arrive (a per-tile arrival counter) sums the
  splits in order and applies the epilogue (SwiGLU, residual) of :func:`ninfer.kernels.quant_gemm.finish`
  (deterministic: the order of the sum does not depend on which split came last); a second small
  kernel does it when the counters cannot be used. Without a split the GEMV kernel applies the
  epilogue itself. No host syncs: CUDA-graph safe.

* ``GemmConfig(kind="gemv-prefetch")`` requests the next K step's packed bytes before this step's
  arithmetic (loop-carried registers), so two steps' loads are in flight per thread: Triton's
  pipeliner stages only loads that feed a ``tl.dot``, so the plain GEMV has one step in flight
  whatever ``num_stages`` says (offline sm_90 PTX: 4 vs 8 16-byte loads per loop trip).

* ``GemmConfig(kind="gemv-w32")`` (int4 only) reads the packed codes as 32-bit words, eight nibbles
  each in K order, and builds each weight ``1 + nibble / 16`` from the word with one shift and one
  AND-OR (``lop3``), then multiply-adds it straight into a per-word accumulator: ~3 instructions per
  weight where the byte path spends ~5.5 (byte extraction and widening, two shifts, an add tree; offline
  sm_90 PTX). The 4-bit GEMV is bound by those instructions, not by the memory stream.

Activation rows beyond BLOCK_M take more programs along ``program_id(2)`` (each re-reads the weight),
so any M is correct; the tuner offers these configs only for M <= 8.

The expert GEMV of :mod:`ninfer.kernels.moe.quant_gemv` reuses the steps' pieces (``gemv_raw``,
``gemv_decode``, ``gemv_scales``, ``gemv_x``, ``gemv_dot``; ``w32_raw``, ``w32_values``,
``w32_scales``, ``w32_dot``) and the reduce kernel.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import triton
import triton.language as tl

from ninfer.kernels.counters import SLOTS, arrival_counters
from ninfer.kernels.quant_gemm.common import FMT_INT4
from ninfer.kernels.quant_gemm.gemv_steps import (
    gemv_decode,
    gemv_dot,
    gemv_epilogue,
    gemv_raw,
    gemv_scales,
    gemv_x,
    reduce_splits,
    w32_dot,
    w32_raw,
    w32_scales,
    w32_values,
)
from ninfer.kernels.quant_gemm.tune import GemmConfig
from ninfer.kernels.scoped import scoped


@triton.jit
def _w32_step(acc, raw, x_ptr, s_ptr, rows, m0, M, k0, K, stride_xm, stride_sn,
              GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr):
    """:func:`_gemv_step` for int4 codes in 32-bit words: nibble j of word w is column ``k0 + 8 w + j``."""
    scale = w32_scales(s_ptr, rows, k0, K, stride_sn, GROUP, BLOCK_K, EVEN_K)
    vs = w32_values(raw)  # decoded once, used by every activation row
    cols = tl.arange(0, BLOCK_M)
    for i in tl.static_range(BLOCK_M):
        xrow = tl.minimum(m0 + i, M - 1)  # rows past M compute a copy that the store drops
        y = w32_dot(vs, scale, gemv_x(x_ptr, xrow, k0, K, stride_xm, BLOCK_K, EVEN_K), GROUP, BLOCK_N, BLOCK_K)
        acc += tl.where(cols[None, :] == i, y[:, None], 0.0)
    return acc


@triton.jit
def _gemv_step(acc, raw, x_ptr, s_ptr, rows, m0, M, k0, K, stride_xm, stride_sn,
               FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """``acc[:, i] += W[rows, k0:k0+BLOCK_K] . x[m0 + i, k0:k0+BLOCK_K]`` for i < BLOCK_M (fp32); ``raw``
    holds the packed bytes of that weight tile (:func:`gemv_raw`). The slab is decoded once for all rows."""
    a, b = gemv_decode(raw, FMT)
    scale = gemv_scales(s_ptr, rows, k0, K, stride_sn, FMT, GROUP, ROW_BLOCK, BLOCK_K, EVEN_K)
    cols = tl.arange(0, BLOCK_M)
    for i in tl.static_range(BLOCK_M):
        xrow = tl.minimum(m0 + i, M - 1)  # rows past M compute a copy that the store drops
        y = gemv_dot(a, b, scale, gemv_x(x_ptr, xrow, k0, K, stride_xm, BLOCK_K, EVEN_K), FMT, GROUP, BLOCK_N,
                      BLOCK_K)
        acc += tl.where(cols[None, :] == i, y[:, None], 0.0)
    return acc


@triton.jit(do_not_specialize=["M", "k_per_split"])
def _quant_gemv_kernel(
    x_ptr, q_ptr, s_ptr, rs_ptr, res_ptr, out_ptr, ws_ptr,
    M, N_OUT, K, k_per_split,
    stride_xm, stride_qn, stride_sn, stride_rm, stride_om,
    FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr, ROW_SCALE: tl.constexpr,
    SWIGLU: tl.constexpr, HAS_RES: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
    WORDS: tl.constexpr = False, cnt_ptr=None, FUSED_REDUCE: tl.constexpr = False,
):
    pid_s = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m0 = tl.program_id(2) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_n, N_OUT - 1)  # clamped rows load valid memory; the store drops them
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # k_per_split is a multiple of BLOCK_K. Writing k_first as a product with BLOCK_K lets the
    # compiler prove that every k0 is too, hence the packed rows' 16-byte alignment: without it each
    # weight byte is loaded on its own (k_per_split is not specialised, so it carries no divisibility).
    k_first = pid_s * (k_per_split // BLOCK_K) * BLOCK_K
    steps = tl.cdiv(tl.minimum(k_per_split, K - k_first), BLOCK_K)
    up_rows = rows + N_OUT  # SwiGLU: the up rows of the same output columns, N_OUT rows further down
    if WORDS:  # int4 codes as 32-bit words (see the module docstring)
        for step in range(0, steps):
            k0 = k_first + step * BLOCK_K
            raw = w32_raw(q_ptr, rows, k0, K, stride_qn, BLOCK_K, EVEN_K)
            acc = _w32_step(acc, raw, x_ptr, s_ptr, rows, m0, M, k0, K, stride_xm, stride_sn,
                            GROUP, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_K)
            if SWIGLU:
                raw_up = w32_raw(q_ptr, up_rows, k0, K, stride_qn, BLOCK_K, EVEN_K)
                acc_up = _w32_step(acc_up, raw_up, x_ptr, s_ptr, up_rows, m0, M, k0, K, stride_xm, stride_sn,
                                   GROUP, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_K)
    elif PREFETCH:  # the next step's bytes are requested before this step's arithmetic: twice the loads in flight
        raw = gemv_raw(q_ptr, rows, k_first, K, stride_qn, FMT, BLOCK_K, EVEN_K)
        raw_up = raw
        if SWIGLU:
            raw_up = gemv_raw(q_ptr, up_rows, k_first, K, stride_qn, FMT, BLOCK_K, EVEN_K)
        for step in range(0, steps):
            k0 = k_first + step * BLOCK_K
            k_next = k_first + tl.minimum(step + 1, steps - 1) * BLOCK_K  # the last step reloads itself
            nxt = gemv_raw(q_ptr, rows, k_next, K, stride_qn, FMT, BLOCK_K, EVEN_K)
            acc = _gemv_step(acc, raw, x_ptr, s_ptr, rows, m0, M, k0, K, stride_xm, stride_sn,
                             FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_K)
            raw = nxt
            if SWIGLU:
                nxt_up = gemv_raw(q_ptr, up_rows, k_next, K, stride_qn, FMT, BLOCK_K, EVEN_K)
                acc_up = _gemv_step(acc_up, raw_up, x_ptr, s_ptr, up_rows, m0, M, k0, K, stride_xm, stride_sn,
                                    FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_K)
                raw_up = nxt_up
    else:
        for step in range(0, steps):
            k0 = k_first + step * BLOCK_K
            raw = gemv_raw(q_ptr, rows, k0, K, stride_qn, FMT, BLOCK_K, EVEN_K)
            acc = _gemv_step(acc, raw, x_ptr, s_ptr, rows, m0, M, k0, K, stride_xm, stride_sn,
                             FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_K)
            if SWIGLU:
                raw_up = gemv_raw(q_ptr, up_rows, k0, K, stride_qn, FMT, BLOCK_K, EVEN_K)
                acc_up = _gemv_step(acc_up, raw_up, x_ptr, s_ptr, up_rows, m0, M, k0, K, stride_xm, stride_sn,
                                    FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_K)
    n_ok = offs_n < N_OUT
    if ROW_SCALE:
        acc *= tl.load(rs_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
        if SWIGLU:
            acc_up *= tl.load(rs_ptr + N_OUT + offs_n, mask=n_ok, other=0.0)[:, None]
    mask = n_ok[:, None] & (offs_m < M)[None, :]
    gemv_epilogue(acc, acc_up, pid_s, offs_m, offs_n, mask, M, N_OUT, ws_ptr, cnt_ptr, res_ptr, stride_rm, out_ptr,
                   stride_om, SPLIT, FUSED_REDUCE, SWIGLU, HAS_RES, BLOCK_N, BLOCK_M)


# Split-K partials summed by the last program of each output tile (FUSED_REDUCE) rather than by a second
# launch: a 27B int4 decode step ran 272 reduce launches (0.34 ms of kernels, and a ~1.3 us gap before
# each in the graph). One counter per output tile (ninfer.kernels.counters); launches that do not fit them,
# or a first use inside graph capture, take the reduce kernel.
_COUNTER_SLOTS = SLOTS
# reduce_kernel_for_splits' override (a context variable: it holds only in the block and the thread that set it)
_reduce_kernel_only: ContextVar[bool] = ContextVar("ninfer_gemv_reduce_kernel_only", default=False)


@contextmanager
def reduce_kernel_for_splits() -> Iterator[None]:
    """Test hook: split-K GEMV launches inside (this module's and :mod:`gemv_mma`'s) sum their partials with
    the separate reduce kernel instead of the arrival counters, so that tests can compare the two paths."""
    with scoped(_reduce_kernel_only, True):
        yield


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's arrival counters (:mod:`ninfer.kernels.counters`) if ``tiles`` fit them, else None (and
    under :func:`reduce_kernel_for_splits`)."""
    if _reduce_kernel_only.get() or tiles > _COUNTER_SLOTS:
        return None
    return arrival_counters(device)


def launch_gemv(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor | None,
                res: torch.Tensor | None, out: torch.Tensor, swiglu: bool, fmt_code: int, group: int,
                row_block: int, cfg: GemmConfig) -> None:
    """Launch the GEMV path with the tensors ``quant_gemm._launch`` prepared (fp8 as bytes)."""
    m, k = x.shape
    n_out = out.shape[1]
    if cfg.block_k % group:
        raise ValueError(f"gemv block_k {cfg.block_k} must be a multiple of the scale group {group}")
    if cfg.block_m & (cfg.block_m - 1) or cfg.block_n & (cfg.block_n - 1) or cfg.block_k & (cfg.block_k - 1):
        raise ValueError(f"gemv blocks must be powers of two: {cfg}")
    words = cfg.kind == "gemv-w32"
    if words:
        if fmt_code != FMT_INT4 or k % 8 or (q.stride(-2) * q.element_size()) % 4 or q.data_ptr() % 4:
            raise ValueError("gemv-w32 reads int4 codes as 32-bit words: it needs K % 8 == 0 and 4-byte aligned rows")
        q = q.view(torch.int32)
    k_steps = triton.cdiv(k, cfg.block_k)
    per_split = triton.cdiv(k_steps, cfg.split_k)
    splits = triton.cdiv(k_steps, per_split)
    n_cols = n_out * (2 if swiglu else 1)
    ws = torch.empty(splits, m, n_cols, dtype=torch.float32, device=x.device) if splits > 1 else out
    res_arg = res if res is not None else out
    grid = (triton.cdiv(n_out, cfg.block_n), splits, triton.cdiv(m, cfg.block_m))
    counters = tile_counters(x.device, grid[0] * grid[2]) if splits > 1 else None
    _quant_gemv_kernel[grid](
        x_ptr=x, q_ptr=q, s_ptr=scales, rs_ptr=row_scale if row_scale is not None else scales, res_ptr=res_arg,
        out_ptr=out, ws_ptr=ws, M=m, N_OUT=n_out, K=k, k_per_split=per_split * cfg.block_k, stride_xm=x.stride(0),
        stride_qn=q.stride(-2), stride_sn=scales.stride(-2) if scales.dim() >= 2 else 0,
        stride_rm=res_arg.stride(0), stride_om=out.stride(0), FMT=fmt_code, GROUP=group, ROW_BLOCK=row_block,
        ROW_SCALE=row_scale is not None, SWIGLU=swiglu, HAS_RES=res is not None, SPLIT=splits > 1,
        EVEN_K=k % cfg.block_k == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PREFETCH=cfg.kind == "gemv-prefetch", WORDS=words, cnt_ptr=counters, FUSED_REDUCE=counters is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1 and counters is None:
        reduce_splits(ws, res_arg, out, m, splits, swiglu, res is not None, min(cfg.block_m, 8))
