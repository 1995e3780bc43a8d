"""Small float projections at decode sizes: ``y = x @ W^T`` for bf16 / fp16 ``W`` of few rows and 1-16 tokens.

The router of the 35B-A3B (257 x 2048, with the shared expert's gate row) and the DeltaNet a/b gates (96 x 5120,
64 x 2048) stay in bf16 under every recipe. cuBLAS runs such a GEMM as a split-K kernel and a reduce kernel at
4 rows and up (and the 27B's a/b gates even at one row): two launches per layer for ~1 MB of weights, 96 of the
27B step's and 80 of a 35B-A3B verification round's launches. This kernel is one launch: programs of ``BLOCK_N``
rows over a K range (split-K over grid axis 1), ``tl.dot`` on 16-token tiles with fp32 accumulation, the splits
summed in split order by the last one of each tile to arrive (the arrival counters and epilogue of
:mod:`ninfer.kernels.quant_gemm.gemv_steps`; a second small kernel where the counters cannot be used).

cuBLAS stays the favourite: :func:`float_linear` times both per shape (:mod:`ninfer.kernels.tuning`, table
``"float_gemv"``, CUDA-graph replays as the engine runs them) and keeps the faster, so an untuned call, a graph
capture of an untuned key and ``NINFER_QUANT_TUNE=0`` take cuBLAS as before. Weights of more than
``MAX_ROWS`` rows, more than ``MAX_TOKENS`` tokens and fp32 always take cuBLAS. On CPU tensors, ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer.kernels.dispatch import INTERPRET, autotune_configs, float_gemv_early, pdl_enabled, use_triton
from ninfer.kernels.norms import NormedRows
from ninfer.kernels.pdl import Pdl, early_pdl, l2_prefetch_rows, pdl_enter
from ninfer.kernels.quant_gemm.deferred_norm import reader_args
from ninfer.kernels.quant_gemm.gemv import tile_counters
from ninfer.kernels.quant_gemm.gemv_steps import gemv_epilogue, reduce_splits
from ninfer.kernels.quant_gemm.timing import time_candidates
from ninfer.kernels.quant_gemm.tune import GemmConfig, m_bucket, sm_count
from ninfer.kernels.tuning import default_tuner

TABLE = "float_gemv"
MAX_ROWS = 1024  # output rows: larger weights are cuBLAS's (a GEMV there needs no split-K reduce)
MAX_TOKENS = 16
CUBLAS = GemmConfig(16, 0, 0, 1, 0, 0, "cublas")  # the favourite: F.linear


def float_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


@triton.jit(do_not_specialize=["M", "k_per_split"])
def _float_gemv_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, stats_ptr, M, N_OUT, K, k_per_split, stride_xm,
                       stride_wn, stride_om, n_parts, eps, SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr,
                       ROW_NORM: tl.constexpr, PARTS_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL_WAIT: tl.constexpr = False,
                       PDL_TRIGGER: tl.constexpr = False, W_LINES: tl.constexpr = 0):
    """Program (row tile, K split, token tile): a ``[BLOCK_N, BLOCK_M]`` tile of ``y^T`` over its K range. ROW_NORM:
    ``x`` holds rows whose norm was deferred (:mod:`~ninfer.kernels.quant_gemm.deferred_norm`): each token's sum is
    scaled by its row's factor from ``stats [n_parts, M]``, by the split that sums the tile where the splits are
    summed in this launch, else by every program. ``W_LINES``: the program's weight lines are asked of the L2 before
    the wait of a launch with ``PDL_WAIT`` (:func:`~ninfer.kernels.pdl.early_pdl`: the weights never depend on the
    kernel before)."""
    pid_s = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_n, N_OUT - 1).to(tl.int64)  # clamped loads; the stores are masked
    toks = tl.minimum(offs_m, M - 1).to(tl.int64)
    k_first = pid_s * k_per_split
    k_last = tl.minimum(k_first + k_per_split, K)
    if W_LINES > 0:
        size: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
        l2_prefetch_rows((w_ptr + rows * stride_wn).to(tl.int64), k_first * size, k_last * size, W_LINES)
    pdl_enter(PDL_WAIT, PDL_TRIGGER)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_first, k_last, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < k_last
        w = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=in_k[None, :], other=0.0)
        x = tl.load(x_ptr + toks[None, :] * stride_xm + offs_k[:, None], mask=in_k[:, None], other=0.0)
        acc = tl.dot(w, x.to(w.dtype), acc)
    mask = (offs_n < N_OUT)[:, None] & (offs_m < M)[None, :]
    gemv_epilogue(acc, acc, pid_s, offs_m, offs_n, mask, M, N_OUT, ws_ptr, cnt_ptr, out_ptr, 0, out_ptr,
                  stride_om, SPLIT, FUSED_REDUCE, False, False, BLOCK_N, BLOCK_M, stats_ptr, n_parts, K, eps,
                  ROW_NORM, PARTS_BLOCK)


def float_gemv_candidates(m: int, n_out: int, k: int, sms: int) -> list[GemmConfig]:
    """cuBLAS first, then ``(rows, K per step, warps)`` tiles, each with split-K for about one, two and four
    programs per SM (at least two K steps per split: the last split's sum reads every split's partials)."""
    out = [CUBLAS]
    for bn, bk, warps in ((16, 256, 4), (32, 128, 4), (64, 128, 4)):
        steps = triton.cdiv(k, bk)
        tiles = triton.cdiv(n_out, bn) * triton.cdiv(m, 16)
        for per_sm in (1, 2, 4):
            split = max(1, min(triton.cdiv(per_sm * sms, tiles), steps // 2, 32))
            cfg = GemmConfig(16, bn, bk, split, warps, 1, "float-gemv")
            if cfg not in out:
                out.append(cfg)
    return out


def launch_float_gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: GemmConfig,
                      row_norm: NormedRows | None = None, early: bool = False) -> None:
    """``out [M, N] = x [M, K] @ weight [N, K]^T`` by config ``cfg`` (unit strides along K); with ``row_norm``, ``x``
    is its scaled rows and each row's product is normalized (not by cuBLAS). ``early`` (the kernel, not cuBLAS):
    launched with programmatic dependent launch, it asks the L2 for its weights before it waits for the kernel
    before (:func:`~ninfer.kernels.pdl.early_pdl`)."""
    m, k = x.shape
    n_out = weight.shape[0]
    if cfg.kind == CUBLAS.kind:
        if row_norm is not None:
            raise ValueError("cuBLAS does not normalize deferred rows: materialize them first")
        torch.matmul(x, weight.t(), out=out)
        return
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(n_out, cfg.block_n), splits, triton.cdiv(m, cfg.block_m))
    ws = torch.empty(splits, m, n_out, dtype=torch.float32, device=x.device) if splits > 1 else out
    counters = tile_counters(x.device, grid[0] * grid[2]) if splits > 1 else None
    reads = reader_args(row_norm, cfg.block_m, out)
    pdl = early_pdl(x.device) if early else Pdl()
    prefetch = pdl.wait and not INTERPRET and x.is_cuda  # inline PTX: not in the interpreter
    w_lines = triton.next_power_of_2(triton.cdiv(k_per_split * weight.element_size(), 128) + 1) if prefetch else 0
    _float_gemv_kernel[grid](x, weight, out, ws, counters, reads.stats, m, n_out, k, k_per_split, x.stride(0),
                             weight.stride(0), out.stride(0), reads.parts, reads.eps, SPLIT=splits > 1,
                             FUSED_REDUCE=counters is not None, ROW_NORM=row_norm is not None,
                             PARTS_BLOCK=reads.parts_block,
                             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, W_LINES=w_lines,
                             **pdl.constexprs(), **pdl.options(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1 and counters is None:
        reduce_splits(ws, out, out, m, splits, False, False)


def float_linear(x: torch.Tensor | NormedRows, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)``, through the tuned choice between cuBLAS and the one-launch kernel where both apply
    (CUDA, bf16 / fp16, at most ``MAX_TOKENS`` tokens and ``MAX_ROWS`` rows). Rows whose norm was deferred
    (:class:`~ninfer.kernels.norms.NormedRows`) take the one-launch kernel, which normalizes them, where it applies
    (tuned apart, without cuBLAS), and are materialized elsewhere. Where the early start applies
    (:func:`~ninfer.kernels.dispatch.float_gemv_early`: from 8 tokens on unless ``NINFER_FLOAT_GEMV_EARLY`` says,
    with programmatic dependent launch on) the kernel is tuned without cuBLAS and launched early, its weights asked
    of the L2 while the kernel before runs (:func:`launch_float_gemv`)."""
    row_norm = x if isinstance(x, NormedRows) else None
    if row_norm is not None:
        x = row_norm.scaled
    n_out, k = weight.shape
    rows = x.numel() // k if k else 0
    if (not use_triton(x) or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype
            or not 0 < rows <= MAX_TOKENS or n_out > MAX_ROWS or weight.stride(1) != 1
            or (row_norm is not None and x.dim() != 2)):
        return F.linear(row_norm.materialize() if row_norm is not None else x, weight)
    x2 = x.reshape(rows, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if row_norm is not None:
        row_norm = row_norm.over(x2)
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    early = float_gemv_early(rows) and pdl_enabled(x.device)
    key = (x.dtype, m_bucket(rows), n_out, k, x.device) + (("row-norm",) if row_norm is not None else ()) \
        + (("early",) if early else ())
    sms = sm_count(x.device)

    def cands() -> list[GemmConfig]:
        found = float_gemv_candidates(rows, n_out, k, sms)
        return autotune_configs(found if row_norm is None and not early else [c for c in found if c != CUBLAS])

    def time_fn(cfgs: list[GemmConfig]) -> dict[GemmConfig, float]:
        trial = torch.empty_like(out)
        return time_candidates(cfgs, lambda cfg: launch_float_gemv(x2, weight, trial, cfg, row_norm), graphs=True)

    cfg = default_tuner().choose(TABLE, key, cands, time_fn, x.device)
    launch_float_gemv(x2, weight, out, cfg, row_norm, early=early)
    return out.view(*x.shape[:-1], n_out)
