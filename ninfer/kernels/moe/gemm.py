"""Routed experts as grouped GEMMs over expert-aligned row blocks (:mod:`ninfer.kernels.moe.align`).

``moe_experts_triton`` runs four launches (three at decode):

1. alignment: (token, slot) pairs grouped by expert, each group padded to ``BLOCK_M`` rows;
   skipped up to ``DIRECT_MAX_PAIRS`` pairs (decode), where each GEMM program of an expert's
   first pair collects that expert's pairs from ``ids`` itself (see ``_direct_gemm``);
2. gate/up GEMM with fused SwiGLU: each program takes one row block (one expert) and ``BLOCK_N``
   intermediate columns, gathers the block's token rows of x, accumulates the gate rows and the up
   rows of the same columns (gate rows first in ``gate_up [E, 2I, H]``) in fp32 and writes
   ``silu(gate) * up`` to ``inter [N*k, I]`` at the pairs' rows;
3. down GEMM: the same walk over ``down [E, H, I]`` reading ``inter``, times the pair's routing
   weight, written to ``y [N*k, H]`` (x's dtype);
4. combine: ``out[t] = sum_j y[t*k + j]`` in fp32, one program per token and column block. A
   separate reduce instead of atomics keeps the result deterministic and needs no zeroed buffer. A gated
   shared expert's ``sigmoid(logit) * output`` is added here too, in fp32 (three torch launches fewer per MoE layer).

Grids are sized from the upper bound of row blocks (CUDA-graph safe); blocks past the padded
total read ``-1`` as their expert and return at once, and experts without tokens own no block,
so only the selected experts' weights are read. Programs walk groups of row blocks across the
weight tiles (L2 reuse at prefill, see ``align.aligned_tile``).

Steps 2 and 3 run these float kernels for a float stack and the kernels of
:mod:`ninfer.kernels.moe.quant_gemm` for a quantized one (``QuantizedTensor``, read packed and
dequantized in the K loop; at decode, where measured faster, the ``tl.dot``-free GEMV of
:mod:`ninfer.kernels.moe.quant_gemv`); the two GEMMs of a call may differ, the rows are found the
same way.

``BLOCK_M`` (fixed before the alignment) is 16 when experts average few rows (decode, short
prefills: a skinny MMA that wastes nothing on the weight stream, which dominates) and 64 otherwise.
The other tile sizes are autotuned per GPU and per (kernel, BLOCK_M, pair-count bucket); the
first config of each list fits the RTX 5090's 99 KB of shared memory and is the interpreter's.
Tuning runs on the first call of a key: warm up before CUDA-graph capture.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.autotune import ninfer_autotune
from ninfer.kernels.dispatch import autotune_configs, moe_down_early
from ninfer.kernels.moe.align import (
    ExpertRows,
    aligned_tile,
    expert_rows,
    pair_group,
    pair_rows,
)
from ninfer.kernels.moe.quant_gemm import launch_quant_experts
from ninfer.kernels.norms import NextNorm, NormedRows
from ninfer.kernels.overlap import Overlapped, wait_for
from ninfer.kernels.pdl import pdl_enter, small_kernel_pdl
from ninfer.kernels.quant_gemm.tune import GemmConfig
from ninfer.kernels.quant_gemm.weights import QuantizedTensor

Weight = torch.Tensor | QuantizedTensor  # an expert stack [E, N, K]

SKINNY_ROWS = 32  # average rows per expert up to which row blocks are 16 high
DIRECT_MAX_PAIRS = 64  # (token, slot) pairs up to which the GEMMs find their rows without an alignment


def _config(block_n: int, block_k: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps, num_stages=stages)


# Shared memory per stage in bf16 is (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * 2 bytes for gate/up (two
# weight tiles) and (BLOCK_M + BLOCK_N) * BLOCK_K * 2 for down; the first config of each list is
# within 99 KB for both kernels.
_SKINNY = [  # BLOCK_M = 16: a weight-streaming GEMV; enough bytes in flight per SM matters most
    _config(32, 128, 4, 4),   # gate/up 80 KB
    _config(64, 128, 4, 4),
    _config(32, 256, 4, 4),
    _config(16, 256, 2, 4),
    _config(64, 256, 8, 3),
    _config(128, 128, 8, 4),
]
_TILED = [  # BLOCK_M = 64: MMA-bound
    _config(64, 64, 4, 3),    # gate/up 72 KB
    _config(128, 64, 4, 3),
    _config(128, 64, 8, 4),
    _config(64, 64, 4, 4),
    _config(256, 64, 8, 3),
    _config(128, 128, 8, 3),
]
_KEY = ["N_OUT", "K", "SWIGLU", "ROUTE_WEIGHT", "tune_m"]


@triton.jit
def _block_gemm(a_ptr, w_ptr, out_ptr, rw_ptr, expert, pairs, pid_n, NK, N_OUT, K, a_div,
                stride_am, stride_we, stride_wn, stride_om,
                SWIGLU: tl.constexpr, ROUTE_WEIGHT: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[pair, n] = f(a[pair // a_div] @ w[expert, n]^T)`` for BLOCK_M pairs of one expert and
    BLOCK_N output columns. SWIGLU: also the up rows ``n + N_OUT``, ``f = silu(gate) * up``.
    ROUTE_WEIGHT: times ``rw[pair]``. Padding rows (pair >= NK) read row 0 and are not stored."""
    row_ok = pairs < NK
    arow = tl.where(row_ok, pairs // a_div, 0).to(tl.int64)  # int64: N*k*K passes 2^31 for long prompts
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wrow = tl.minimum(offs_n, N_OUT - 1)  # clamped instead of masked; the store drops them
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + arow[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + wrow[None, :] * stride_wn + offs_k[:, None]  # [K, N]
    up_off = N_OUT * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = _mma(a, w.to(a.dtype), acc, IEEE)
        if SWIGLU:
            if EVEN_K:
                wu = tl.load(w_ptrs + up_off)
            else:
                wu = tl.load(w_ptrs + up_off, mask=k_ok[:, None], other=0.0)
            acc_up = _mma(a, wu.to(a.dtype), acc_up, IEEE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = acc
    if SWIGLU:
        y = acc / (1.0 + tl.exp(-acc)) * acc_up
    if ROUTE_WEIGHT:
        y *= tl.load(rw_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n < N_OUT)[None, :])


@triton.jit(do_not_specialize=["NK", "num_blocks", "tune_m"])  # pair counts vary per call: no recompiles
def _aligned_gemm(
    a_ptr, w_ptr, out_ptr, rw_ptr, sorted_ptr, block_experts_ptr,
    NK, N_OUT, K, a_div, num_blocks, tune_m,
    stride_am, stride_we, stride_wn, stride_om,
    SWIGLU: tl.constexpr, ROUTE_WEIGHT: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One program per (aligned row block, column tile)."""
    pid_m, pid_n = aligned_tile(tl.program_id(0), num_blocks, N_OUT, BLOCK_N, GROUP_M)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    _block_gemm(a_ptr, w_ptr, out_ptr, rw_ptr, expert, pairs, pid_n, NK, N_OUT, K, a_div,
                stride_am, stride_we, stride_wn, stride_om, SWIGLU, ROUTE_WEIGHT, IEEE, EVEN_K,
                BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit(do_not_specialize=["NK", "tune_m"])
def _direct_gemm(
    a_ptr, w_ptr, out_ptr, rw_ptr, ids_ptr,
    NK, N_OUT, K, a_div, tune_m,
    stride_am, stride_we, stride_wn, stride_om,
    SWIGLU: tl.constexpr, ROUTE_WEIGHT: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAIRS_BLOCK: tl.constexpr,
):
    """Decode without the alignment launch: one program per (pair, column tile). The program of an
    expert's first pair gathers all of that expert's pairs from ``ids`` (a few dozen, in registers)
    into row tiles of BLOCK_M; the programs of its other pairs exit."""
    expert, match, rank, count, earlier = pair_group(ids_ptr, tl.program_id(0), NK, PAIRS_BLOCK)
    if earlier > 0:
        return
    for t0 in range(0, count, BLOCK_M):  # one trip unless an expert has more than BLOCK_M pairs
        pairs = pair_rows(match, rank, count, t0, NK, BLOCK_M, PAIRS_BLOCK)
        _block_gemm(a_ptr, w_ptr, out_ptr, rw_ptr, expert, pairs, tl.program_id(1), NK, N_OUT, K, a_div,
                    stride_am, stride_we, stride_wn, stride_om, SWIGLU, ROUTE_WEIGHT, IEEE, EVEN_K,
                    BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # fp32 activations: no silent tf32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


# Two tuners over the aligned kernel: the config lists differ with BLOCK_M (fixed by the alignment).
# Named apart in the shipped tables (ninfer.kernels.autotune): two of them tune one function.
_gemm_skinny = ninfer_autotune(configs=autotune_configs(_SKINNY), key=_KEY, name="_gemm_skinny")(_aligned_gemm)
_gemm_tiled = ninfer_autotune(configs=autotune_configs(_TILED), key=_KEY, name="_gemm_tiled")(_aligned_gemm)
_gemm_direct = ninfer_autotune(configs=autotune_configs(_SKINNY), key=_KEY, name="_gemm_direct")(_direct_gemm)


@triton.jit
def _combine_kernel(y_ptr, out_ptr, shared_ptr, logit_ptr, res_ptr, norm_w_ptr, new_res_ptr, H, stride_sm, stride_lm,
                    eps, TOPK: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK: tl.constexpr, SHARED: tl.constexpr,
                    NORM: tl.constexpr, RESIDUAL: tl.constexpr, PDL_WAIT: tl.constexpr = False,
                    PDL_TRIGGER: tl.constexpr = False):
    """``out[t, cols] = sum_j y[t * TOPK + j, cols]``; with ``SHARED``, plus ``sigmoid(logit[t]) * shared[t, cols]``;
    in fp32, rounded once (the three torch ops it replaces rounded after each: within a rounding step of them).

    ``NORM`` (``BLOCK`` covers the row): the next norm's work in the same launch, as ``rms_norm`` would do it on the
    rounded sum: ``new_res = sum + res`` (``RESIDUAL``; rounded to the stream's dtype), then the zero-centred RMSNorm
    of that into ``out``. ``PDL_TRIGGER``: the next layer's first projection may launch now and request its
    weights; ``PDL_WAIT``: launched so itself (programmatic dependent launch, :mod:`ninfer.kernels.pdl`)."""
    pdl_enter(PDL_WAIT, PDL_TRIGGER)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < H
    slots = tl.arange(0, K_BLOCK)
    mask = (slots < TOPK)[:, None] & in_row[None, :]
    y = tl.load(y_ptr + (t * TOPK + slots)[:, None] * H + cols[None, :], mask=mask, other=0.0)
    out = tl.sum(y.to(tl.float32), axis=0)
    if SHARED:
        gate = tl.sigmoid(tl.load(logit_ptr + t * stride_lm).to(tl.float32))
        out += gate * tl.load(shared_ptr + t * stride_sm + cols, mask=in_row, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if NORM:
        h = out.to(dtype).to(tl.float32)
        if RESIDUAL:
            s = (h + tl.load(res_ptr + t * H + cols, mask=in_row, other=0.0).to(tl.float32)).to(dtype)
            tl.store(new_res_ptr + t * H + cols, s, mask=in_row)
            h = s.to(tl.float32)
        else:
            tl.store(new_res_ptr + t * H + cols, h.to(dtype), mask=in_row)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / H + eps)
        w = tl.load(norm_w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        out = h * rstd * (1.0 + w)
    tl.store(out_ptr + t * H + cols, out.to(dtype), mask=in_row)


SharedExpert = tuple[torch.Tensor | Overlapped[torch.Tensor], torch.Tensor]  # (output, gate logit)


def block_m_for(pairs: int, num_experts: int) -> int:
    return 16 if pairs <= SKINNY_ROWS * num_experts else 64


def moe_experts_triton(x: torch.Tensor | NormedRows, gate_up: Weight, down: Weight, weights: torch.Tensor,
                       ids: torch.Tensor, *, path: str | GemmConfig | None = None,
                       shared: SharedExpert | None = None, norm: NextNorm | None = None) -> torch.Tensor:
    """Triton ``moe_experts_reference``: ``x [N, H]``, ``gate_up [E, 2I, H]`` (gate rows first),
    ``down [E, H, I]``, ``weights [N, k]``, ``ids [N, k]`` (int32/int64, in [0, E)). Each expert
    stack is a float tensor (fp32/fp16/bf16, converted to x's dtype in registers) or a
    :class:`QuantizedTensor` in any format of the quantized GEMM (dequantized in the K loop, see
    :mod:`ninfer.kernels.moe.quant_gemm`); returns ``[N, H]`` in x's dtype. ``path`` picks the
    quantized stacks' kernels (``launch_quant_experts``: auto, dot, gemv, mma or a config; float stacks
    ignore it). ``shared``: a gated shared expert's ``(output [N, H], gate logit [N, 1])``, added by the combine
    as ``sigmoid(logit) * output`` (:func:`ninfer.kernels.moe.dispatch.moe_experts_reference` defines it); the
    combine waits for an output still computing on another stream. ``norm``: the combine also applies the norm
    that follows the block (:func:`ninfer.kernels.moe.dispatch.moe_experts_then_norm`); its new residual stream
    is written to ``norm.new_residual``, and the normed output is returned. ``x`` may come with its norm deferred
    (:class:`~ninfer.kernels.norms.NormedRows`): quantized gate/up stacks normalize it in their kernels, float ones
    read it materialized."""
    row_norm = None
    if isinstance(x, NormedRows):
        if isinstance(gate_up, QuantizedTensor) and gate_up.format.name != "bf16":
            x, row_norm = x.scaled, x
        else:
            x = x.materialize()
    n, h = x.shape
    e, two_i, hk = gate_up.shape
    inter_size = two_i // 2
    if hk != h or tuple(down.shape) != (e, h, inter_size) or two_i % 2:
        raise ValueError(f"expert shapes gate_up {list(gate_up.shape)}, down {list(down.shape)} do not fit H = {h}")
    if weights.shape != ids.shape or ids.shape[0] != n:
        raise ValueError(f"weights {list(weights.shape)} and ids {list(ids.shape)} must both be [N = {n}, k]")
    top_k = ids.shape[1]
    out = torch.empty_like(x)
    pending, logit = shared if shared is not None else (out, out)
    s_out = pending.value if isinstance(pending, Overlapped) else pending  # its shape only, until the combine
    if shared is not None and (s_out.shape != x.shape or s_out.stride(1) != 1 or logit.shape != (n, 1)):
        raise ValueError(f"shared expert output {list(s_out.shape)} and gate logit {list(logit.shape)} must be "
                         f"[{n}, {h}] (unit stride along H) and [{n}, 1]")
    if n == 0:
        wait_for(pending)
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
        row_norm = row_norm.over(x) if row_norm is not None else None
    rw = weights.reshape(-1).contiguous()
    nk = n * top_k
    rows = expert_rows(ids, e, DIRECT_MAX_PAIRS, block_m_for(nk, e))
    inter = torch.empty(nk, inter_size, dtype=x.dtype, device=x.device)
    _launch(rows, x, gate_up, inter, rw, a_div=top_k, swiglu=True, path=path, row_norm=row_norm)
    y = torch.empty(nk, h, dtype=x.dtype, device=x.device)
    # The down projection's ids (the routing's) and weights were written before the gate/up started: with the
    # early start (on unless NINFER_MOE_DOWN_EARLY=0) it requests them while the gate/up runs (pdl.early_pdl)
    _launch(rows, inter, down, y, rw, a_div=1, swiglu=False, path=path, early=moe_down_early())
    # With the norm, one program holds a whole row (the RMS needs it): 2048 for the 35B-A3B.
    block = triton.next_power_of_2(h) if norm is not None else min(1024, triton.next_power_of_2(h))
    wait_for(pending)  # the shared expert may be computing on another stream until here
    res = out if norm is None or norm.residual is None else norm.residual
    pdl = small_kernel_pdl(out.device)
    _combine_kernel[(n, triton.cdiv(h, block))](
        y, out, s_out, logit, res, out if norm is None else norm.weight, out if norm is None else norm.new_residual,
        h, s_out.stride(0), logit.stride(0), 0.0 if norm is None else norm.eps, TOPK=top_k,
        K_BLOCK=triton.next_power_of_2(top_k), BLOCK=block, SHARED=shared is not None, NORM=norm is not None,
        RESIDUAL=norm is not None and norm.residual is not None, **pdl.constexprs(), **pdl.options(),
        num_warps=8 if block > 1024 else 4)
    return out


def _launch(rows: ExpertRows, a: torch.Tensor, w: Weight, dst: torch.Tensor, rw: torch.Tensor, *, a_div: int,
            swiglu: bool, path: str | GemmConfig | None = None, row_norm: NormedRows | None = None,
            early: bool = False) -> None:
    """``dst[pair] = f(a[pair // a_div] @ w[expert]^T)``: SwiGLU for gate/up, the routing weight for down.
    ``row_norm`` (quantized stacks only): ``a`` is its scaled rows. ``early`` (quantized stacks only): see
    :func:`~ninfer.kernels.moe.quant_gemm.launch_quant_experts`."""
    if isinstance(w, QuantizedTensor) and w.format.name == "bf16":
        w = w.tensors["weight"]
    if isinstance(w, QuantizedTensor):
        launch_quant_experts(rows, a, w, dst, rw, a_div=a_div, swiglu=swiglu, path=path, row_norm=row_norm,
                             early=early)
        return
    w = w if w.stride(-1) == 1 else w.contiguous()
    n_out, k_dim = dst.shape[1], a.shape[1]
    sizes, strides = (rows.pairs, n_out, k_dim, a_div), (a.stride(0), w.stride(0), w.stride(1), dst.stride(0))
    consts = {"SWIGLU": swiglu, "ROUTE_WEIGHT": not swiglu, "IEEE": a.dtype == torch.float32,
              "EVEN_K": k_dim % 256 == 0}  # every BLOCK_K divides 256
    if rows.direct:
        _gemm_direct[rows.grid(n_out)](a, w, dst, rw, rows.flat_ids, *sizes, rows.tune_m, *strides,
                                       BLOCK_M=16, PAIRS_BLOCK=rows.pairs_block, **consts)
    else:
        gemm = _gemm_skinny if rows.block_m == 16 else _gemm_tiled
        gemm[rows.grid(n_out)](a, w, dst, rw, rows.sorted_pairs, rows.block_experts, *sizes, rows.blocks,
                               rows.tune_m, *strides, BLOCK_M=rows.block_m, GROUP_M=8, **consts)
