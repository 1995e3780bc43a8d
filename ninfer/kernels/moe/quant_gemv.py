"""Decode GEMV over routed (token, expert) pairs for quantized expert stacks, without ``tl.dot``.

The expert counterpart of :mod:`ninfer.kernels.quant_gemm.gemv`. At decode (<= ``MAX_PAIRS`` pairs) the
expert GEMMs move only the selected experts' packed bytes, and the ``tl.dot`` kernels of
:mod:`ninfer.kernels.moe.quant_gemm` pad each expert's one or two pairs to a 16-row MMA tile: they
measured 10-24 % of copy bandwidth at 1-8 tokens on an H200, where the dense GEMV reached 37-47 %
(4-bit) and 69-94 % (8-bit) against 16-47 % for its ``tl.dot`` path.

* Rows come from ``ids`` as in the alignment-free ``tl.dot`` path (:func:`ninfer.kernels.moe.align.pair_group`):
  grid ``(pairs, column tiles, K splits)``; the program of an expert's first pair serves all pairs
  of that expert (BLOCK_M at a time) and the others exit, so each selected expert's rows are read
  once per column tile and no other expert is read.
* A K step loads a ``[BLOCK_N, BLOCK_K]`` slab of packed rows (16-byte vectors), decodes it in
  registers once (:func:`quant_gemm.gemv_steps.gemv_decode`, group scales from ``gemv_scales``; int4 codes
  as 32-bit words for ``kind="gemv-w32"``: ``w32_values``) and reduces it against each of the
  group's activation rows ``a[pair // a_div]`` (``gemv_dot`` / ``w32_dot``: ``tl.sum`` per scale
  group, fp32). Rows of a BLOCK_M tile past the group's count are skipped at run time
  (most experts have one pair at decode), not computed and dropped.
* Epilogues as the ``tl.dot`` expert kernels: per-row scales (fp8 rows, nvfp4 global scale) on the
  accumulator, then the routing weight ``rw[pair]`` (down) or SwiGLU over the stacked ``[E, 2I, K]``
  weight (gate rows first; ``dst`` has I columns). Split-K writes fp32 partials (the routing weight
  already applied: it is linear) to a scratch ``[splits, pairs, N (x2 for SwiGLU)]`` that every
  program writes in full, and gemv_steps' reduce kernel sums the splits in order, then SwiGLU:
  deterministic, no atomics, no host syncs, nothing sized by data (CUDA-graph safe).

Selection (:func:`choose_config`): never blind. The first call of a key ``(format, dtype,
pair-count bucket, N, K, swiglu)`` on CUDA, outside graph capture and the interpreter, times the
``tl.dot`` path (``GROUPED_DOT``), the GEMV candidates and, for int4 stacks under 16-bit activations, the
register decode of :mod:`ninfer.kernels.moe.quant_mma` from CUDA-graph replays, each launch after the L2 was
evicted (the dense tuner's ``time_candidates``, L2-cold: a token's experts would sit in L2 through a warm timing,
as they never do in a model's step; ``NINFER_TUNE_L2_COLD``) and keeps the fastest in the process's tuner state
(:mod:`ninfer.kernels.tuning`), also on disk (:mod:`ninfer.kernels.tune_cache`): a later process takes the stored
choice while it is still a candidate. During capture, or with tuning off, a key takes what was chosen for it, else
the ``tl.dot`` path: warm decode shapes before capturing.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.moe.align import ExpertRows, pair_group, pair_rows
from ninfer.kernels.moe.mma_configs import FORMATS as MMA_FORMATS
from ninfer.kernels.moe.mma_configs import expert_mma_candidates
from ninfer.kernels.moe.quant_mma import ALIGNED_MAX_PAIRS, takes_rows
from ninfer.kernels.norms import NormedRows
from ninfer.kernels.pdl import early_pdl, l2_prefetch_rows, pdl_enter, small_kernel_pdl
from ninfer.kernels.quant_gemm import tune as quant_gemm_tune
from ninfer.kernels.quant_gemm.common import FMT_CODES, finish, kernel_tensors
from ninfer.kernels.quant_gemm.deferred_norm import reader_args, rows_rstd
from ninfer.kernels.quant_gemm.gemv_steps import (
    gemv_decode,
    gemv_dot,
    gemv_raw,
    gemv_scales,
    gemv_x,
    reduce_splits,
    store_partials,
    w32_dot,
    w32_raw,
    w32_scales,
    w32_values,
)
from ninfer.kernels.quant_gemm.timing import l2_cold
from ninfer.kernels.quant_gemm.tune import GemmConfig, kernel_params, sm_count
from ninfer.kernels.quant_gemm.weights import QuantizedTensor
from ninfer.kernels.tuning import default_tuner

MAX_PAIRS = 64  # routed pairs up to which the GEMV is a candidate (8 tokens at top-8)
# The tl.dot grouped GEMM of moe.quant_gemm; its tile sizes come from its own triton.autotune.
GROUPED_DOT = GemmConfig(16, 0, 0, kind="dot")


@triton.jit
def _raw(q_ptr, rows, k0, K, stride_qn, FMT: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
         WORDS: tl.constexpr):
    """The packed slab of a K step: bytes (:func:`gemv_raw`) or, WORDS, int4 32-bit words (``w32_raw``)."""
    if WORDS:
        raw = w32_raw(q_ptr, rows, k0, K, stride_qn, BLOCK_K, EVEN_K)
    else:
        raw = gemv_raw(q_ptr, rows, k0, K, stride_qn, FMT, BLOCK_K, EVEN_K)
    return raw


@triton.jit
def _pair_row(acc, dec, scale, x_ptr, xrows, i: tl.constexpr, k0, K, stride_xm, FMT: tl.constexpr,
              GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, WORDS: tl.constexpr):
    """``acc[:, i] +=`` the decoded slab ``dec`` times activation row ``xrows[i]``."""
    cols = tl.arange(0, BLOCK_M)
    xrow = tl.sum(tl.where(cols == i, xrows, 0), axis=0)  # element i of the gathered rows
    xt = gemv_x(x_ptr, xrow, k0, K, stride_xm, BLOCK_K, EVEN_K)
    if WORDS:
        y = w32_dot(dec, scale, xt, GROUP, BLOCK_N, BLOCK_K)
    else:
        y = gemv_dot(dec[0], dec[1], scale, xt, FMT, GROUP, BLOCK_N, BLOCK_K)
    return acc + tl.where(cols[None, :] == i, y[:, None], 0.0)


@triton.jit
def _pairs_step(acc, raw, x_ptr, xrows, n_rows, s_ptr, rows, k0, K, stride_xm, stride_sn,
                FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, WORDS: tl.constexpr):
    """``acc[:, i] += W[rows, k0:k0+BLOCK_K] . x[xrows[i], k0:k0+BLOCK_K]`` for i < n_rows; ``raw``: the
    packed slab (:func:`_raw`), decoded once for all rows."""
    if WORDS:
        dec = w32_values(raw)
        scale = w32_scales(s_ptr, rows, k0, K, stride_sn, GROUP, BLOCK_K, EVEN_K)
    else:
        dec = gemv_decode(raw, FMT)
        scale = gemv_scales(s_ptr, rows, k0, K, stride_sn, FMT, GROUP, ROW_BLOCK, BLOCK_K, EVEN_K)
    for i in tl.static_range(BLOCK_M):
        # Row 0 always exists (a program only runs for a group with pairs); later rows only when the
        # expert has that many pairs left: a run-time branch, so lone pairs cost one row of arithmetic.
        if i == 0:
            acc = _pair_row(acc, dec, scale, x_ptr, xrows, i, k0, K, stride_xm, FMT, GROUP, BLOCK_N, BLOCK_M,
                            BLOCK_K, EVEN_K, WORDS)
        elif i < n_rows:
            acc = _pair_row(acc, dec, scale, x_ptr, xrows, i, k0, K, stride_xm, FMT, GROUP, BLOCK_N, BLOCK_M,
                            BLOCK_K, EVEN_K, WORDS)
    return acc


@triton.jit
def _k_range(acc, acc_up, x_ptr, xrows, n_rows, q_ptr, s_ptr, rows, k_first, steps, N_OUT, K, stride_xm,
             stride_qn, stride_sn, FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr,
             SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
             EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, WORDS: tl.constexpr):
    """``steps`` K steps from ``k_first``; SWIGLU: the up rows (N_OUT further down) into ``acc_up``."""
    up_rows = rows + N_OUT
    if PREFETCH:  # the next step's bytes are requested before this step's arithmetic (see quant_gemm.gemv)
        raw = _raw(q_ptr, rows, k_first, K, stride_qn, FMT, BLOCK_K, EVEN_K, WORDS)
        raw_up = raw
        if SWIGLU:
            raw_up = _raw(q_ptr, up_rows, k_first, K, stride_qn, FMT, BLOCK_K, EVEN_K, WORDS)
        for step in range(0, steps):
            k0 = k_first + step * BLOCK_K
            k_next = k_first + tl.minimum(step + 1, steps - 1) * BLOCK_K  # the last step reloads itself
            nxt = _raw(q_ptr, rows, k_next, K, stride_qn, FMT, BLOCK_K, EVEN_K, WORDS)
            acc = _pairs_step(acc, raw, x_ptr, xrows, n_rows, s_ptr, rows, k0, K, stride_xm, stride_sn,
                              FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_K, WORDS)
            raw = nxt
            if SWIGLU:
                nxt_up = _raw(q_ptr, up_rows, k_next, K, stride_qn, FMT, BLOCK_K, EVEN_K, WORDS)
                acc_up = _pairs_step(acc_up, raw_up, x_ptr, xrows, n_rows, s_ptr, up_rows, k0, K, stride_xm,
                                     stride_sn, FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_K, WORDS)
                raw_up = nxt_up
    else:
        for step in range(0, steps):
            k0 = k_first + step * BLOCK_K
            raw = _raw(q_ptr, rows, k0, K, stride_qn, FMT, BLOCK_K, EVEN_K, WORDS)
            acc = _pairs_step(acc, raw, x_ptr, xrows, n_rows, s_ptr, rows, k0, K, stride_xm, stride_sn,
                              FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_K, WORDS)
            if SWIGLU:
                raw_up = _raw(q_ptr, up_rows, k0, K, stride_qn, FMT, BLOCK_K, EVEN_K, WORDS)
                acc_up = _pairs_step(acc_up, raw_up, x_ptr, xrows, n_rows, s_ptr, up_rows, k0, K, stride_xm,
                                     stride_sn, FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_K, WORDS)
    return acc, acc_up


@triton.jit(do_not_specialize=["NK", "k_per_split", "M_TOK"])  # pair / token counts, split lengths vary
def _moe_gemv_kernel(
    x_ptr, q_ptr, s_ptr, rs_ptr, out_ptr, rw_ptr, ws_ptr, ids_ptr, stats_ptr,
    NK, N_OUT, K, a_div, k_per_split, M_TOK, n_parts, eps, q_row_bytes, s_row_bytes,
    stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_re, stride_om,
    ROW_NORM: tl.constexpr, PARTS_BLOCK: tl.constexpr,
    FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr, ROW_SCALE: tl.constexpr,
    SWIGLU: tl.constexpr, ROUTE_WEIGHT: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAIRS_BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr, WORDS: tl.constexpr, PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
    EARLY: tl.constexpr = False, Q_LINES: tl.constexpr = 0, S_LINES: tl.constexpr = 0,
):
    """``out[pair, n] = f(x[pair // a_div] . W[expert(pair), n])`` for BLOCK_N columns and one K range
    of every pair whose expert is that of pair ``program_id(0)``, if that pair is the expert's first. ROW_NORM: ``x``
    holds rows whose norm was deferred (:mod:`~ninfer.kernels.quant_gemm.deferred_norm`), each pair's sums are scaled
    by its token row's factor from ``stats [n_parts, M_TOK]``. ``PDL_WAIT`` / ``PDL_TRIGGER``:
    :mod:`ninfer.kernels.pdl`; the gate/up's expert ids come from the kernel before, so it waits first. ``EARLY``
    (the down projection, whose ids were written before the kernel before it started): the ids are read and, with
    ``Q_LINES`` / ``S_LINES``, the program's code and scale lines asked of the L2 (``q_row_bytes`` /
    ``s_row_bytes``: bytes of a whole row) before the wait."""
    if not EARLY:
        pdl_enter(PDL_WAIT, PDL_TRIGGER)
    expert, match, rank, count, earlier = pair_group(ids_ptr, tl.program_id(0), NK, PAIRS_BLOCK)
    if earlier > 0:
        return
    pid_s = tl.program_id(2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N_OUT - 1)  # clamped rows load valid memory; the store drops them
    n_ok = offs_n < N_OUT
    e64 = expert.to(tl.int64)
    q_ptr += e64 * stride_qe
    s_ptr += e64 * stride_se
    rs_ptr += e64 * stride_re
    # k_per_split is a multiple of BLOCK_K; written as a product with BLOCK_K, every k0 provably is too,
    # which keeps the packed loads 16-byte vectors (as in quant_gemm.gemv).
    k_first = pid_s * (k_per_split // BLOCK_K) * BLOCK_K
    steps = tl.cdiv(tl.minimum(k_per_split, K - k_first), BLOCK_K)
    if EARLY:
        k_end = tl.minimum(k_first + k_per_split, K)
        if Q_LINES > 0:
            l2_prefetch_rows((q_ptr + rows * stride_qn).to(tl.int64), k_first * q_row_bytes // K,
                             tl.cdiv(k_end * q_row_bytes, K), Q_LINES)
        if S_LINES > 0:
            l2_prefetch_rows((s_ptr + rows * stride_sn).to(tl.int64), k_first * s_row_bytes // K,
                             tl.cdiv(k_end * s_row_bytes, K), S_LINES)
        pdl_enter(PDL_WAIT, PDL_TRIGGER)
    for t0 in range(0, count, BLOCK_M):  # one trip unless the expert has more than BLOCK_M pairs
        pairs = pair_rows(match, rank, count, t0, NK, BLOCK_M, PAIRS_BLOCK)
        row_ok = pairs < NK
        xrows = tl.where(row_ok, pairs // a_div, 0)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc, acc_up = _k_range(acc, acc_up, x_ptr, xrows, count - t0, q_ptr, s_ptr, rows, k_first, steps, N_OUT,
                               K, stride_xm, stride_qn, stride_sn, FMT, GROUP, ROW_BLOCK, SWIGLU, BLOCK_N, BLOCK_M,
                               BLOCK_K, EVEN_K, PREFETCH, WORDS)
        if ROW_NORM:  # before SwiGLU, for the gate and the up sums alike
            factor = rows_rstd(stats_ptr, n_parts, xrows, M_TOK, K, eps, PARTS_BLOCK)[None, :]
            acc *= factor
            acc_up *= factor
        if ROW_SCALE:
            acc *= tl.load(rs_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
            if SWIGLU:
                acc_up *= tl.load(rs_ptr + N_OUT + offs_n, mask=n_ok, other=0.0)[:, None]
        if ROUTE_WEIGHT:  # before the split-K sum: it is linear, so the reduce needs no pair indexing
            acc *= tl.load(rw_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        mask = n_ok[:, None] & row_ok[None, :]
        if SPLIT:  # rows are pairs: scratch [splits, NK, ...]
            store_partials(ws_ptr, acc, acc_up, pid_s, NK, pairs, offs_n, mask, N_OUT, SWIGLU)
        else:
            finish(acc, acc_up, pairs, offs_n, mask, out_ptr, 0, out_ptr, stride_om, SWIGLU, False)


def launch_expert_gemv(rows: ExpertRows, a: torch.Tensor, w: QuantizedTensor, dst: torch.Tensor, rw: torch.Tensor,
                       *, a_div: int, swiglu: bool, cfg: GemmConfig, row_norm: NormedRows | None = None,
                       early: bool = False) -> None:
    """``dst[pair] = f(a[pair // a_div] @ dequantize(w)[expert]^T)`` as ``launch_quant_experts`` defines it,
    through the GEMV kernel with ``cfg`` (``kind`` "gemv", "gemv-prefetch" or, int4 only, "gemv-w32";
    ``block_m``: pairs of one expert per pass over its rows). Needs the alignment-free rows (``rows.direct``).
    ``row_norm``: ``a`` is its scaled rows, normalized in the kernel. ``early``: ``rows``' ids and the weights were
    written before the kernel before this one started (:func:`ninfer.kernels.pdl.early_pdl`)."""
    if not rows.direct:
        raise ValueError(f"the expert GEMV needs alignment-free decode rows, got {rows.pairs} aligned pairs")
    if not cfg.kind.startswith("gemv"):
        raise ValueError(f"not a GEMV config: {cfg}")
    name = w.format.name
    p = kernel_params(name, cfg)
    if cfg.block_k % p["group"]:
        raise ValueError(f"gemv block_k {cfg.block_k} must be a multiple of the scale group {p['group']}")
    if any(b & (b - 1) for b in (cfg.block_m, cfg.block_n, cfg.block_k)):
        raise ValueError(f"gemv blocks must be powers of two: {cfg}")
    q, scales, row_scale = kernel_tensors(w)
    n_out, k = dst.shape[1], a.shape[1]
    words = cfg.kind == "gemv-w32"
    if words:  # int4 codes as 32-bit words, eight nibbles each (quant_gemm.gemv); strides below then count words
        if not name.startswith("int4") or k % 8 or q.data_ptr() % 4 or any(st % 4 for st in q.stride()[:-1]):
            raise ValueError("gemv-w32 reads int4 codes as 32-bit words: it needs K % 8 == 0 and 4-byte aligned rows")
        q = q.view(torch.int32)
    k_steps = triton.cdiv(k, cfg.block_k)
    per_split = triton.cdiv(k_steps, cfg.split_k)
    splits = triton.cdiv(k_steps, per_split)
    nk = rows.pairs
    ws = torch.empty(splits, nk, n_out * (2 if swiglu else 1), dtype=torch.float32, device=a.device) \
        if splits > 1 else dst
    rs = row_scale if row_scale is not None else scales
    grid = (nk, triton.cdiv(n_out, cfg.block_n), splits)
    # With splits the reduce kernel normalizes each pair's sums once; without, every program does
    in_kernel_norm = row_norm if splits == 1 else None
    reads = reader_args(in_kernel_norm, cfg.block_m, rs)
    pdl = early_pdl(a.device) if early else small_kernel_pdl(a.device)
    # the L2 hints only where the launch overlaps the kernel before (inline PTX: not in the interpreter)
    prefetch = early and pdl.wait and not INTERPRET and a.is_cuda
    q_row_bytes = q.shape[-1] * q.element_size()
    s_row_bytes = scales.shape[-1] * scales.element_size() if scales.dim() == 3 else 0
    span = per_split * cfg.block_k  # columns a program reads; its bytes may straddle one more line
    q_lines = triton.next_power_of_2(triton.cdiv(span * q_row_bytes, k * 128) + 1) if prefetch else 0
    s_lines = triton.next_power_of_2(triton.cdiv(span * s_row_bytes, k * 128) + 1) if prefetch and s_row_bytes else 0
    _moe_gemv_kernel[grid](
        x_ptr=a, q_ptr=q, s_ptr=scales, rs_ptr=rs, out_ptr=dst, rw_ptr=rw, ws_ptr=ws, ids_ptr=rows.flat_ids,
        stats_ptr=reads.stats, NK=nk, N_OUT=n_out, K=k, a_div=a_div, k_per_split=per_split * cfg.block_k,
        M_TOK=a.shape[0], n_parts=reads.parts, eps=reads.eps, q_row_bytes=q_row_bytes, s_row_bytes=s_row_bytes,
        EARLY=early, Q_LINES=q_lines, S_LINES=s_lines, ROW_NORM=in_kernel_norm is not None,
        PARTS_BLOCK=reads.parts_block, stride_xm=a.stride(0),
        stride_qe=q.stride(0), stride_qn=q.stride(1), stride_se=scales.stride(0),
        stride_sn=scales.stride(1) if scales.dim() == 3 else 0, stride_re=rs.stride(0), stride_om=dst.stride(0),
        FMT=FMT_CODES[name], GROUP=p["group"], ROW_BLOCK=p["row_block"], ROW_SCALE=row_scale is not None,
        SWIGLU=swiglu, ROUTE_WEIGHT=not swiglu, SPLIT=splits > 1, EVEN_K=k % cfg.block_k == 0, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PAIRS_BLOCK=rows.pairs_block,
        PREFETCH=cfg.kind == "gemv-prefetch", WORDS=words, **pdl.constexprs(), **pdl.options(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        reduce_splits(ws, dst, dst, nk, splits, swiglu, False, min(triton.next_power_of_2(nk), 8), row_norm=row_norm,
                      row_div=a_div)


def expert_gemv_candidates(fmt: str, pairs: int, n_out: int, k: int, sms: int) -> list[GemmConfig]:
    """GEMV configs for ``pairs`` routed pairs: ``(rows, packed bytes per row per K step, warps,
    stages)``, each with the split-K that brings the grid near four programs per SM (assuming every
    pair its own expert) and, where that split is > 1, without it. At top-8 one token's pairs have
    distinct experts (one pass each); from two tokens on an expert may hold several pairs, taken
    two per pass. One stage: the slab stays in registers (Triton stages only loads that feed a
    ``tl.dot``); the prefetch kind keeps two K steps in flight instead. int4 formats also get the
    32-bit-word decode (``gemv-w32``, fewer instructions per weight). All fit 99 KB (sm_120)."""
    if fmt not in FMT_CODES:
        raise ValueError(f"no quantized GEMM kernel for format {fmt!r}")
    block_m = 1 if pairs <= 8 else 2
    four_bit = fmt.startswith("int4") or fmt == "nvfp4"
    shapes = [("gemv", 32, 256, 4, 1), ("gemv", 16, 256, 4, 1), ("gemv", 64, 128, 4, 1),
              ("gemv-prefetch", 32, 128, 4, 1), ("gemv", 32, 128, 4, 3)]
    if fmt.startswith("int4"):
        shapes += [("gemv-w32", 32, 256, 4, 1), ("gemv-w32", 64, 128, 4, 1)]
    out: list[GemmConfig] = []
    for kind, bn, row_bytes, warps, stages in shapes:
        bk = max(row_bytes * (2 if four_bit else 1), quant_gemm_tune.GROUPS.get(fmt, 1))
        cfg = GemmConfig(block_m, bn, bk, 1, warps, stages, kind)
        split = quant_gemm_tune.gemv_split(pairs * triton.cdiv(n_out, bn), triton.cdiv(k, bk), sms)
        out.extend([GemmConfig(block_m, bn, bk, split, warps, stages, kind), cfg] if split > 1 else [cfg])
    return out


TABLE = "moe_gemv"  # the tuner state's and the disk cache's table of these choices


def choose_config(fmt: str, a: torch.Tensor, rows: ExpertRows, n_out: int, k: int, swiglu: bool,
                  launch: Callable[[GemmConfig], None], normed: bool = False) -> GemmConfig:
    """``GROUPED_DOT`` or a GEMV config for this call, by the process's tuner state
    (:func:`ninfer.kernels.tuning.default_tuner`, table ``"moe_gemv"``). Alignment-free calls of <= MAX_PAIRS
    pairs are tuned; their first tunable call per key takes the choice stored on disk if
    it is still a candidate, else times ``launch`` of each candidate (graph replays) and keeps (and stores)
    the fastest. Untuned keys (capture, interpreter, CPU, ``NINFER_QUANT_TUNE=0``): the dot. Aligned calls of up
    to ``ALIGNED_MAX_PAIRS`` pairs in blocks of 16 (a speculative verification of several lanes) choose between
    the dot and the register decode (:mod:`.quant_mma`) the same way. ``normed``: the activations' norm was deferred
    (``launch`` normalizes them): tuned apart, the dot (which would read them materialized) not among the candidates."""
    floats = a.dtype in (torch.bfloat16, torch.float16)
    aligned = not rows.direct and takes_rows(rows) and rows.pairs <= ALIGNED_MAX_PAIRS and floats and fmt in MMA_FORMATS
    if not aligned and (not rows.direct or rows.pairs > MAX_PAIRS):
        return GROUPED_DOT
    key = (fmt, a.dtype, rows.tune_m, n_out, k, swiglu, a.device) + (("row-norm",) if normed else ())

    def cands() -> list[GemmConfig]:
        sms = sm_count(a.device)
        register_decode = expert_mma_candidates(fmt, rows.pairs, n_out, k, sms) if floats else []
        gemv = [] if aligned else expert_gemv_candidates(fmt, rows.pairs, n_out, k, sms)
        kernels = [*gemv, *register_decode]
        return kernels if normed and kernels else [GROUPED_DOT, *kernels]

    def time_fn(cfgs: list[GemmConfig]) -> dict[GemmConfig, float]:
        return quant_gemm_tune.time_candidates(cfgs, launch, graphs=True, cold=l2_cold(experts=True))

    return default_tuner().choose(TABLE, key, cands, time_fn, a.device)
