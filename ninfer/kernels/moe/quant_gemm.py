"""Grouped expert GEMMs over quantized expert stacks, dequantized in the K loop.

The quantized counterpart of the float kernels in :mod:`ninfer.kernels.moe.gemm`, launched by
``moe_experts_triton`` for a stack that is a :class:`QuantizedTensor` (``[E, N, K]`` in any format
of :mod:`ninfer.kernels.quant_gemm`: int4 g64/g128, int8 g32/g64, nvfp4, fp8 rows, fp8 128-blocks).
Programs find their expert and rows exactly as the float kernels do (:mod:`ninfer.kernels.moe.align`:
alignment-free at decode, aligned row blocks otherwise), so experts without tokens own no program
and only the selected experts' packed bytes are read; no dequantized copy of a stack ever exists.

Inside a program the work is the dense quantized GEMM's, reusing its helpers: the program holds a
``[BLOCK_N, BLOCK_M]`` tile of ``y^T`` for BLOCK_N weight rows of its expert, so the weight rows
(the dominant traffic) take the MMA's M side and a 16-row tile of pairs wastes nothing on them.
Each K step loads packed rows, dequantizes them in registers (bit-pattern tricks, no int->float
conversions) and feeds the dot. 16-row tiles (decode, short prefills) multiply each group's scale
into the partial product (exact codes go to the MMA); 64-row tiles dequantize the tile once (one
multiply per weight, amortised over 64 rows); nvfp4's 16-wide groups always scale the tile. Per-row
scales (fp8 rows, the nvfp4 global scale) multiply the accumulator once, then SwiGLU (gate/up,
gate rows first) or the routing weight (down), and the tile is stored at its pairs' rows.

Tile sizes are autotuned per (format, shapes, pair-count bucket) as for the float kernels; the
first config of each list fits the RTX 5090's 99 KB of shared memory and is the interpreter's.

At decode (alignment-free rows, <= 64 pairs) a 16-row MMA tile mostly pads one or two pairs per
expert; :mod:`ninfer.kernels.moe.quant_gemv` offers a ``tl.dot``-free GEMV instead.
``launch_quant_experts`` runs whichever its ``path`` asks for: by default the faster of the two as
measured on the key's first call (``quant_gemv.choose_config``; this path while unmeasured, e.g.
during graph capture), or one pinned (``path="dot"`` / ``"gemv"`` / a config; ``NINFER_MOE_PATH``).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninfer.kernels.autotune import ninfer_autotune
from ninfer.kernels.dispatch import autotune_configs
from ninfer.kernels.moe.align import ExpertRows, aligned_tile, pair_group, pair_rows
from ninfer.kernels.moe.mma_configs import EXPERT_KINDS, expert_mma_candidates
from ninfer.kernels.moe.quant_gemv import (
    GROUPED_DOT,
    choose_config,
    expert_gemv_candidates,
    launch_expert_gemv,
)
from ninfer.kernels.moe.quant_mma import launch_expert_mma, takes_rows
from ninfer.kernels.norms import NormedRows
from ninfer.kernels.quant_gemm.common import FMT_CODES, finish
from ninfer.kernels.quant_gemm.gemm import k_loop
from ninfer.kernels.quant_gemm.tune import GemmConfig, sm_count
from ninfer.kernels.quant_gemm.weights import QuantizedTensor

QUANT_FORMATS = frozenset(FMT_CODES)  # formats these kernels read
PATH_ENV = "NINFER_MOE_PATH"
PATHS = ("auto", "dot", "gemv", "mma")


def default_path() -> str:
    """The path of a ``launch_quant_experts`` call that names none: ``NINFER_MOE_PATH`` (read per call, so a
    test or benchmark may set it late), "auto" (measure the candidates per decode key) unless it pins "dot",
    "gemv" or "mma" everywhere (e.g. to compare whole engine runs: ``NINFER_MOE_PATH=dot perf/bench_engine.py ...``)."""
    path = os.environ.get(PATH_ENV, "auto")
    if path not in PATHS:
        raise ValueError(f"{PATH_ENV} must be one of {', '.join(PATHS)}, got {path!r}")
    return path


def _config(block_n: int, block_k: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps, num_stages=stages)


# Shared memory per stage, gate/up (two weight tiles) in bf16: 2 * BLOCK_N * BLOCK_K * bytes per
# code (1/2 for 4-bit, 1 for 8-bit) + BLOCK_K * BLOCK_M * 2 for the activations, plus the dequantized
# tiles on their way to the MMA. The first config of each list stays far below 99 KB in every format.
_SKINNY = [  # BLOCK_M = 16: weight streaming; BLOCK_N = 16 rows per warp, as the dense skinny path
    _config(32, 128, 2, 4),   # int8 gate/up: 4 * (8 + 4) KB staged
    _config(64, 128, 4, 4),
    _config(32, 256, 2, 4),
    _config(64, 256, 4, 3),
    _config(16, 256, 1, 4),
    _config(128, 128, 8, 3),
]
_TILED = [  # BLOCK_M = 64: MMA-bound, the tile dequantized once per 64 pairs
    _config(64, 64, 4, 3),    # int8 gate/up: 3 * (8 + 8) KB staged
    _config(128, 64, 4, 3),
    _config(128, 64, 8, 4),
    _config(64, 128, 4, 3),
    _config(256, 64, 8, 3),
    _config(128, 128, 8, 3),
]
_KEY = ["N_OUT", "K", "FMT", "GROUP", "SWIGLU", "ROUTE_WEIGHT", "tune_m"]


@triton.jit
def _quant_block(x_ptr, q_ptr, s_ptr, rs_ptr, out_ptr, rw_ptr, expert, pairs, pid_n, NK, N_OUT, K, a_div,
                 stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_re, stride_om,
                 FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr, SCALED: tl.constexpr,
                 ROW_SCALE: tl.constexpr, SWIGLU: tl.constexpr, ROUTE_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[pair, n] = f(x[pair // a_div] @ W[expert, n]^T)`` for BLOCK_M pairs of one expert and
    BLOCK_N output columns, W packed. SWIGLU: also the up rows ``n + N_OUT``, ``f = silu(gate) * up``.
    ROUTE_WEIGHT: times ``rw[pair]``. Padding rows (pair >= NK) read row 0 and are not stored."""
    # Columns per scale group inside a K step (GROUP 0: no groups along K, fp8 rows); a conditional
    # expression on constexprs, the form quant_gemm's kernel already relies on, rather than min().
    CHUNK: tl.constexpr = BLOCK_K if GROUP == 0 else (GROUP if GROUP < BLOCK_K else BLOCK_K)  # noqa: FURB136
    SUB: tl.constexpr = BLOCK_K if SCALED else CHUNK  # columns per dot
    row_ok = pairs < NK
    xrows = tl.where(row_ok, pairs // a_div, 0).to(tl.int64)  # int64: N*k*K passes 2^31 for long prompts
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N_OUT - 1)  # clamped instead of masked; the store drops them
    e64 = expert.to(tl.int64)
    q_ptr += e64 * stride_qe
    s_ptr += e64 * stride_se
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc, acc_up = k_loop(acc, acc_up, x_ptr, xrows, q_ptr, s_ptr, rows, 0, tl.cdiv(K, BLOCK_K), N_OUT, K, stride_xm,
                          stride_qn, stride_sn, FMT, GROUP, CHUNK, ROW_BLOCK, SCALED, SWIGLU, BLOCK_N, BLOCK_K, SUB,
                          EVEN_K, IEEE)
    n_ok = offs_n < N_OUT
    if ROW_SCALE:
        rs_ptr += e64 * stride_re
        acc *= tl.load(rs_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
        if SWIGLU:
            acc_up *= tl.load(rs_ptr + N_OUT + offs_n, mask=n_ok, other=0.0)[:, None]
    if ROUTE_WEIGHT:
        acc *= tl.load(rw_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    mask = n_ok[:, None] & row_ok[None, :]
    finish(acc, acc_up, pairs, offs_n, mask, out_ptr, 0, out_ptr, stride_om, SWIGLU, False)


@triton.jit(do_not_specialize=["NK", "num_blocks", "tune_m"])  # pair counts vary per call: no recompiles
def _aligned_quant_gemm(
    x_ptr, q_ptr, s_ptr, rs_ptr, out_ptr, rw_ptr, sorted_ptr, block_experts_ptr,
    NK, N_OUT, K, a_div, num_blocks, tune_m,
    stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_re, stride_om,
    FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr, SCALED: tl.constexpr,
    ROW_SCALE: tl.constexpr, SWIGLU: tl.constexpr, ROUTE_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One program per (aligned row block, column tile)."""
    pid_m, pid_n = aligned_tile(tl.program_id(0), num_blocks, N_OUT, BLOCK_N, GROUP_M)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    _quant_block(x_ptr, q_ptr, s_ptr, rs_ptr, out_ptr, rw_ptr, expert, pairs, pid_n, NK, N_OUT, K, a_div,
                 stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_re, stride_om,
                 FMT, GROUP, ROW_BLOCK, SCALED, ROW_SCALE, SWIGLU, ROUTE_WEIGHT, IEEE, EVEN_K,
                 BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit(do_not_specialize=["NK", "tune_m"])
def _direct_quant_gemm(
    x_ptr, q_ptr, s_ptr, rs_ptr, out_ptr, rw_ptr, ids_ptr,
    NK, N_OUT, K, a_div, tune_m,
    stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_re, stride_om,
    FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr, SCALED: tl.constexpr,
    ROW_SCALE: tl.constexpr, SWIGLU: tl.constexpr, ROUTE_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PAIRS_BLOCK: tl.constexpr,
):
    """Decode without the alignment launch: the program of an expert's first pair computes that
    expert for all its pairs; the programs of its other pairs exit."""
    expert, match, rank, count, earlier = pair_group(ids_ptr, tl.program_id(0), NK, PAIRS_BLOCK)
    if earlier > 0:
        return
    for t0 in range(0, count, BLOCK_M):  # one trip unless an expert has more than BLOCK_M pairs
        pairs = pair_rows(match, rank, count, t0, NK, BLOCK_M, PAIRS_BLOCK)
        _quant_block(x_ptr, q_ptr, s_ptr, rs_ptr, out_ptr, rw_ptr, expert, pairs, tl.program_id(1), NK, N_OUT, K,
                     a_div, stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_re, stride_om,
                     FMT, GROUP, ROW_BLOCK, SCALED, ROW_SCALE, SWIGLU, ROUTE_WEIGHT, IEEE, EVEN_K,
                     BLOCK_M, BLOCK_N, BLOCK_K)


# Named apart in the shipped tables (ninfer.kernels.autotune): two of them tune one function.
_gemm_skinny = ninfer_autotune(configs=autotune_configs(_SKINNY), key=_KEY, name="_gemm_skinny")(_aligned_quant_gemm)
_gemm_tiled = ninfer_autotune(configs=autotune_configs(_TILED), key=_KEY, name="_gemm_tiled")(_aligned_quant_gemm)
_gemm_direct = ninfer_autotune(configs=autotune_configs(_SKINNY), key=_KEY, name="_gemm_direct")(_direct_quant_gemm)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 codes and scales travel as bytes and are bitcast in the kernel (portable loads and masks)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def launch_quant_experts(rows: ExpertRows, a: torch.Tensor, w: QuantizedTensor, dst: torch.Tensor,
                         rw: torch.Tensor, *, a_div: int, swiglu: bool, path: str | GemmConfig | None = None,
                         row_norm: NormedRows | None = None, early: bool = False) -> None:
    """``dst[pair] = f(a[pair // a_div] @ dequantize(w)[expert]^T)`` for every routed pair, ``w`` a
    quantized stack ``[E, N, K]``: SwiGLU over the two row halves (gate/up, ``dst`` has N / 2
    columns) or times the routing weight ``rw[pair]`` (down).

    ``path``: "auto" (None: :func:`default_path`) measures the ``tl.dot`` kernels here against the GEMV of
    :mod:`ninfer.kernels.moe.quant_gemv` per key at decode (:func:`ninfer.kernels.moe.quant_gemv.choose_config`);
    "dot" pins the ``tl.dot`` kernels, "gemv" the GEMV's first candidate wherever it applies
    (alignment-free decode rows; the dot elsewhere), "mma" the register decode's (:mod:`.quant_mma`: int4 stacks at
    decode rows or in blocks of 16 pairs; the dot elsewhere); a ``GemmConfig`` of either kind pins exactly that
    (tests, benchmarks; a GEMV config raises on aligned rows). ``row_norm``: ``a`` is its scaled rows, whose norm the
    GEMV and the register decode apply (tuned apart, without the dot), the dot reads them materialized. ``early``:
    ``rows``' ids and the weights were written before the kernel before this one started, so the GEMV and the
    register decode request what they can before they wait for it (:func:`ninfer.kernels.pdl.early_pdl`; the
    tuner's timed launches never do: each would overlap the one before it)."""
    name = w.format.name
    if name not in QUANT_FORMATS or len(w.shape) != 3:
        raise ValueError(f"no grouped expert GEMM for a {name} weight of shape {list(w.shape)}")
    n_out, k_dim = dst.shape[1], a.shape[1]
    if w.shape[1] != n_out * (2 if swiglu else 1) or w.shape[2] != k_dim:
        raise ValueError(f"expert stack {list(w.shape)} does not fit activations [*, {k_dim}] -> [*, {n_out}]")
    if w.tensors["qweight"].stride(-1) != 1 or w.tensors["scales"].stride(-1) != 1:
        raise ValueError("packed expert tensors must be contiguous along K")

    def launch(cfg: GemmConfig, early: bool = False) -> None:
        if cfg.kind == "dot":
            _launch_dot(rows, a if row_norm is None else row_norm.materialize(), w, dst, rw, a_div=a_div,
                        swiglu=swiglu)
        elif cfg.kind in EXPERT_KINDS:
            launch_expert_mma(rows, a, w, dst, rw, a_div=a_div, swiglu=swiglu, cfg=cfg, row_norm=row_norm,
                              early=early)
        else:
            launch_expert_gemv(rows, a, w, dst, rw, a_div=a_div, swiglu=swiglu, cfg=cfg, row_norm=row_norm,
                               early=early)

    path = default_path() if path is None else path
    if isinstance(path, GemmConfig):
        cfg = path
    elif path == "auto":
        cfg = choose_config(name, a, rows, n_out, k_dim, swiglu, launch, normed=row_norm is not None)
    elif path == "dot":
        cfg = GROUPED_DOT
    elif path == "gemv":  # where it applies (alignment-free decode rows), else the dot
        cfg = expert_gemv_candidates(name, rows.pairs, n_out, k_dim, sm_count(a.device))[0] if rows.direct \
            else GROUPED_DOT
    elif path == "mma":  # the register decode's first candidate where it applies (int4; decode rows or blocks of
        # 16), else the dot
        mma = expert_mma_candidates(name, rows.pairs, n_out, k_dim, sm_count(a.device)) if takes_rows(rows) else []
        cfg = mma[0] if mma else GROUPED_DOT
    else:
        raise ValueError(f"expert GEMM path must be auto, dot, gemv, mma or a GemmConfig, got {path!r}")
    launch(cfg, early)


def _launch_dot(rows: ExpertRows, a: torch.Tensor, w: QuantizedTensor, dst: torch.Tensor, rw: torch.Tensor, *,
                a_div: int, swiglu: bool) -> None:
    """The ``tl.dot`` kernels above (alignment-free at decode, aligned row blocks otherwise)."""
    name = w.format.name
    n_out, k_dim = dst.shape[1], a.shape[1]
    q, scales = _bytes(w.tensors["qweight"]), _bytes(w.tensors["scales"])
    row_scale = {"fp8": scales, "nvfp4": w.tensors.get("global_scale")}.get(name)
    fmt = w.format
    consts = {
        "FMT": FMT_CODES[name],
        "GROUP": fmt.group_size or getattr(fmt, "block", 0),  # columns per scale; 0: one scale per row
        "ROW_BLOCK": getattr(fmt, "block", 1),  # rows per scale (fp8 128-blocks)
        # 16-row tiles scale the partial products (exact codes to the MMA; fp8 rows scale at the end),
        # 64-row tiles the dequantized weights; nvfp4's 16-wide groups are too narrow for a dot each.
        "SCALED": name == "nvfp4" or (name != "fp8" and rows.block_m > 16),
        "ROW_SCALE": row_scale is not None, "SWIGLU": swiglu, "ROUTE_WEIGHT": not swiglu,
        "IEEE": a.dtype == torch.float32, "EVEN_K": k_dim % 256 == 0,  # every BLOCK_K divides 256
    }
    rs = row_scale if row_scale is not None else scales
    sizes = (rows.pairs, n_out, k_dim, a_div)
    strides = (a.stride(0), q.stride(0), q.stride(1), scales.stride(0), scales.stride(1) if scales.dim() == 3 else 0,
               rs.stride(0), dst.stride(0))
    tensors = (a, q, scales, rs, dst, rw)
    if rows.direct:
        _gemm_direct[rows.grid(n_out)](*tensors, rows.flat_ids, *sizes, rows.tune_m, *strides,
                                       BLOCK_M=16, PAIRS_BLOCK=rows.pairs_block, **consts)
    else:
        gemm = _gemm_skinny if rows.block_m == 16 else _gemm_tiled
        gemm[rows.grid(n_out)](*tensors, rows.sorted_pairs, rows.block_experts, *sizes, rows.blocks, rows.tune_m,
                               *strides, BLOCK_M=rows.block_m, GROUP_M=8, **consts)
