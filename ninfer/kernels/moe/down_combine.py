"""The routed experts' down projection and the combine in one launch, at decode.

At batch 1 the MoE block's last two launches are latency, not bytes: the down GEMV reads 4 MB of int4 codes (eight
experts of 2048 x 512 in the 35B-A3B) in ~9 µs, and the combine that sums its eight rows per token, adds the gated
shared expert and applies the next norm takes ~3 µs more for 4 KB (run 2026-12-05.20, H100). Here one program owns
``BLOCK_N`` output columns of one token and walks that token's ``TOPK`` pairs itself: it requests every pair's slab
of codes and scales at once (all ``TOPK x K / BLOCK_K`` loads in flight), then decodes, dots each with the pair's
row of SwiGLU output and sums them weighted by the routing weights, each pair's product rounded to the activations'
dtype first as the two-launch path stores it. The combine's epilogue follows in the same program: plus
``sigmoid(logit) * shared``, and with the norm, the new residual stream; the last program of a token to arrive (an
arrival counter, :mod:`ninfer.kernels.counters`) reads the token's row back from L2 and writes its RMSNorm.

Every pair's rows are read once per token that chose the expert: at batch 1 that is the two-launch path's bytes; at
eight tokens an expert two tokens share is read twice (the second time mostly from L2).

``NINFER_MOE_DOWN_COMBINE=1`` takes this path; the configs are tuned per shape as the expert GEMV's
(:mod:`ninfer.kernels.tuning`, table ``"moe_down_combine"``, CUDA-graph replays). Off by default: a 35B-A3B block took
3-7% longer with it at 1-8 tokens (docs/performance.md, "The launch diet's switches measured").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import autotune_configs, env_switch
from ninfer.kernels.norms import NextNorm
from ninfer.kernels.pdl import pdl_enter, small_kernel_pdl
from ninfer.kernels.quant_gemm.common import FMT_CODES, kernel_tensors
from ninfer.kernels.quant_gemm.gemv import tile_counters
from ninfer.kernels.quant_gemm.gemv_steps import (
    gemv_decode,
    gemv_dot,
    gemv_raw,
    gemv_scales,
    gemv_x,
    w32_dot,
    w32_raw,
    w32_scales,
    w32_values,
)
from ninfer.kernels.quant_gemm.timing import time_candidates
from ninfer.kernels.quant_gemm.tune import GROUPS, GemmConfig, kernel_params, m_bucket
from ninfer.kernels.quant_gemm.weights import ROWS, QuantizedTensor
from ninfer.kernels.tuning import default_tuner

TABLE = "moe_down_combine"
KIND, WORDS_KIND = "down-combine", "down-combine-w32"
MAX_TOKENS = 8  # tokens up to which the path applies (64 pairs at top-8: the alignment-free decode rows)


def down_combine_enabled() -> bool:
    """``NINFER_MOE_DOWN_COMBINE`` (read per call; off by default)."""
    return env_switch("NINFER_MOE_DOWN_COMBINE", False)


def down_combine_applies(down: object, tokens: int, dtype: torch.dtype) -> bool:
    """Whether :func:`launch_down_combine` takes a call: the switch on, a quantized stack in a format of the GEMV
    helpers (row-major), at most ``MAX_TOKENS`` tokens of float activations."""
    if not down_combine_enabled() or not isinstance(down, QuantizedTensor) or len(down.shape) != 3:
        return False
    if down.layout != ROWS:  # the GEMV helpers read the formats' own row-major layout
        return False
    return (down.format.name in FMT_CODES and 0 < tokens <= MAX_TOKENS
            and dtype in (torch.float32, torch.float16, torch.bfloat16))


@triton.jit
def request_slabs(q_ptr, s_ptr, rows, K, stride_qn, stride_sn, FMT: tl.constexpr, GROUP: tl.constexpr,
                  ROW_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr, EVEN_K: tl.constexpr,
                  WORDS: tl.constexpr):
    """Every K step's packed codes and group scales of one expert's rows, requested together."""
    raws = ()
    scales = ()
    for s in tl.static_range(STEPS):
        if WORDS:
            raws = raws + (w32_raw(q_ptr, rows, s * BLOCK_K, K, stride_qn, BLOCK_K, EVEN_K),)
            scales = scales + (w32_scales(s_ptr, rows, s * BLOCK_K, K, stride_sn, GROUP, BLOCK_K, EVEN_K),)
        else:
            raws = raws + (gemv_raw(q_ptr, rows, s * BLOCK_K, K, stride_qn, FMT, BLOCK_K, EVEN_K),)
            scales = scales + (gemv_scales(s_ptr, rows, s * BLOCK_K, K, stride_sn, FMT, GROUP, ROW_BLOCK, BLOCK_K,
                                           EVEN_K),)
    return raws, scales


@triton.jit
def slabs_dot_row(raws, scales, x_ptr, pair, K, stride_xm, FMT: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr, EVEN_K: tl.constexpr,
                  WORDS: tl.constexpr, L2_ONLY: tl.constexpr = False):
    """``W . x[pair]`` over all K steps, fp32 ``[BLOCK_N]`` (``L2_ONLY``: x written in this launch)."""
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in tl.static_range(STEPS):
        xt = gemv_x(x_ptr, pair, s * BLOCK_K, K, stride_xm, BLOCK_K, EVEN_K, L2_ONLY)
        if WORDS:
            acc += w32_dot(w32_values(raws[s]), scales[s], xt, GROUP, BLOCK_N, BLOCK_K)
        else:
            lo, hi = gemv_decode(raws[s], FMT)
            acc += gemv_dot(lo, hi, scales[s], xt, FMT, GROUP, BLOCK_N, BLOCK_K)
    return acc


@triton.jit(do_not_specialize=["H"])
def _down_combine_kernel(
    x_ptr, q_ptr, s_ptr, rs_ptr, rw_ptr, ids_ptr, shared_ptr, logit_ptr, res_ptr, norm_w_ptr, out_ptr, new_res_ptr,
    cnt_ptr, H, stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_re, stride_sm, stride_lm, eps,
    K: tl.constexpr, TOPK: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr,
    ROW_SCALE: tl.constexpr, SHARED: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, WORDS: tl.constexpr,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    """Program ``(column tile, token t)``: ``y[t, cols] = sum_j round(rw[t, j] * W_down[ids[t, j], cols] .
    x[t * TOPK + j])`` plus the combine's epilogue (see the module docstring)."""
    pdl_enter(PDL_WAIT, PDL_TRIGGER)
    t = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    rows = tl.minimum(offs_n, H - 1)  # clamped rows load valid memory; the stores drop them
    STEPS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    slabs = ()
    for j in tl.static_range(TOPK):  # every pair's bytes in flight before the first product
        e64 = tl.load(ids_ptr + t * TOPK + j).to(tl.int64)
        slabs = slabs + (request_slabs(q_ptr + e64 * stride_qe, s_ptr + e64 * stride_se, rows, K, stride_qn,
                                       stride_sn, FMT, GROUP, ROW_BLOCK, BLOCK_K, STEPS, EVEN_K, WORDS),)
    dtype = out_ptr.dtype.element_ty
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pair = t * TOPK + j
        part = slabs_dot_row(slabs[j][0], slabs[j][1], x_ptr, pair, K, stride_xm, FMT, GROUP, BLOCK_N, BLOCK_K,
                             STEPS, EVEN_K, WORDS)
        if ROW_SCALE:
            e64 = tl.load(ids_ptr + pair).to(tl.int64)
            part *= tl.load(rs_ptr + e64 * stride_re + rows)
        part *= tl.load(rw_ptr + pair).to(tl.float32)
        y += part.to(dtype).to(tl.float32)  # as the two-launch path stores each pair's row
    if SHARED:
        gate = tl.sigmoid(tl.load(logit_ptr + t * stride_lm).to(tl.float32))
        y += gate * tl.load(shared_ptr + t * stride_sm + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    finish_token_tile(y, t, offs_n, n_ok, res_ptr, norm_w_ptr, out_ptr, new_res_ptr, cnt_ptr + t, tl.num_programs(0), H,
                      eps, NORM, RESIDUAL, NORM, BLOCK_H)


@triton.jit
def finish_token_tile(y, t, offs_n, n_ok, res_ptr, norm_w_ptr, out_ptr, new_res_ptr, arrive_ptr, tiles, H, eps,
                      NORM: tl.constexpr, RESIDUAL: tl.constexpr, COUNT: tl.constexpr, BLOCK_H: tl.constexpr):
    """The combine's epilogue of token ``t``'s columns ``offs_n`` (``y`` fp32): ``out`` (contiguous ``[T, H]``)
    receives ``y``, or with ``NORM`` ``new_res`` receives ``y + residual`` and the token's last program of ``tiles`` to
    arrive at its counter (``COUNT``: always with ``NORM``; release / acquire) reads the row back from L2 and writes its
    RMSNorm to ``out``. Returns whether this program arrived last (it then resets the counter; False without COUNT)."""
    dtype = out_ptr.dtype.element_ty
    row = t.to(tl.int64) * H
    if NORM:
        h = y.to(dtype).to(tl.float32)
        if RESIDUAL:
            h += tl.load(res_ptr + row + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(new_res_ptr + row + offs_n, h.to(dtype), mask=n_ok)
    else:
        tl.store(out_ptr + row + offs_n, y.to(dtype), mask=n_ok)
    last = False
    if COUNT:
        tl.debug_barrier()
        last = tl.atomic_add(arrive_ptr, 1, sem="acq_rel") == tiles - 1
        if last:
            tl.debug_barrier()
            if NORM:  # the whole row is in new_res now
                cols = tl.arange(0, BLOCK_H)
                in_row = cols < H
                s = tl.load(new_res_ptr + row + cols, mask=in_row, other=0.0, cache_modifier=".cg").to(tl.float32)
                rstd = tl.rsqrt(tl.sum(s * s, axis=0) / H + eps)
                w = tl.load(norm_w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
                tl.store(out_ptr + row + cols, (s * rstd * (1.0 + w)).to(dtype), mask=in_row)
            tl.store(arrive_ptr, 0)  # for the next launch or graph replay
    return last


def down_combine_candidates(fmt: str, inter_size: int) -> list[GemmConfig]:
    """``(columns, K per step, warps)``: narrow tiles for many programs at batch 1, the whole intermediate row in
    one or two steps; int4 stacks also as 32-bit words. The first candidate holds 32 KB of codes per program at
    the 35B-A3B shape in 126 registers a thread (sm_90, ``perf/ptx_moe_decode.py``; 32-column tiles take eight
    warps: at four they spilled), no shared memory beyond the reductions' 4 KB: any GPU."""
    group = GROUPS.get(fmt, 1)
    whole = max(group, min(triton.next_power_of_2(inter_size), 512))
    half = max(group, whole // 2)
    shapes = [(KIND, 16, whole, 4), (KIND, 8, whole, 2), (KIND, 32, half, 8), (KIND, 16, half, 4)]
    if fmt.startswith("int4"):
        shapes += [(WORDS_KIND, 16, whole, 4), (WORDS_KIND, 32, half, 8)]
    out: list[GemmConfig] = []
    for kind, bn, bk, warps in shapes:
        cfg = GemmConfig(1, bn, bk, 1, warps, 1, kind)
        if cfg not in out:
            out.append(cfg)
    return out


def launch_down_combine(inter: torch.Tensor, down: QuantizedTensor, rw: torch.Tensor, ids: torch.Tensor,
                        shared: tuple[torch.Tensor, torch.Tensor] | None, norm: NextNorm | None, out: torch.Tensor,
                        cfg: GemmConfig) -> bool:
    """``out [T, H]``: the routed sum of ``down [E, H, I]`` over ``inter [T * k, I]`` (SwiGLU rows, pair-major)
    weighted by ``rw [T * k]`` for experts ``ids [T, k]``, plus ``sigmoid(logit) * output`` of ``shared``; with
    ``norm``, ``norm.new_residual`` receives that plus ``norm.residual`` and ``out`` its RMSNorm. False (nothing
    launched) where the norm needs arrival counters and none are free (a first use inside graph capture)."""
    t, top_k = ids.shape
    h, inter_size = down.shape[1], down.shape[2]
    name = down.format.name
    words = cfg.kind == WORDS_KIND
    p = kernel_params(name, cfg)
    q, scales, row_scale = kernel_tensors(down)
    if words:
        if not name.startswith("int4") or inter_size % 8 or q.data_ptr() % 4:
            raise ValueError("the 32-bit-word decode reads int4 codes: it needs I % 8 == 0 and 4-byte aligned rows")
        q = q.view(torch.int32)
    if cfg.block_k % p["group"]:
        raise ValueError(f"down-combine block_k {cfg.block_k} must be a multiple of the scale group {p['group']}")
    counters = None
    if norm is not None:
        counters = tile_counters(out.device, t)
        if counters is None:
            return False
    tiles = triton.cdiv(h, cfg.block_n)
    rs = row_scale if row_scale is not None else scales
    s_out, logit = shared if shared is not None else (out, out)
    res = norm.residual if norm is not None and norm.residual is not None else out
    pdl = small_kernel_pdl(out.device)
    _down_combine_kernel[(tiles, t)](
        inter, q, scales, rs, rw, ids, s_out, logit, res, norm.weight if norm is not None else out, out,
        norm.new_residual if norm is not None else out, counters if counters is not None else out,
        h, inter.stride(0), q.stride(0), q.stride(1), scales.stride(0), scales.stride(1) if scales.dim() == 3 else 0,
        rs.stride(0), s_out.stride(0), logit.stride(0), norm.eps if norm is not None else 0.0,
        K=inter_size, TOPK=top_k, FMT=FMT_CODES[name], GROUP=p["group"], ROW_BLOCK=p["row_block"],
        ROW_SCALE=row_scale is not None, SHARED=shared is not None, NORM=norm is not None,
        RESIDUAL=norm is not None and norm.residual is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_H=triton.next_power_of_2(h), WORDS=words, **pdl.constexprs(), **pdl.options(),
        num_warps=cfg.num_warps, num_stages=1,
    )
    return True


def down_combine(inter: torch.Tensor, down: QuantizedTensor, rw: torch.Tensor, ids: torch.Tensor,
                 shared: tuple[torch.Tensor, torch.Tensor] | None, norm: NextNorm | None, out: torch.Tensor) -> bool:
    """:func:`launch_down_combine` with the config the tuner keeps for this shape and token bucket (1, 2, 4, 8;
    graph-timed on the first tunable call; untunable calls take the shipped or first candidate). False where nothing
    was launched."""
    name = down.format.name
    t = ids.shape[0]
    key = (name, inter.dtype, m_bucket(t), down.shape[1], down.shape[2], ids.shape[1], inter.device)
    cands = lambda: autotune_configs(down_combine_candidates(name, down.shape[2]))  # noqa: E731

    def time_fn(cfgs: list[GemmConfig]) -> dict[GemmConfig, float]:
        trial = NextNorm(norm.weight, norm.eps, norm.residual, torch.empty_like(norm.new_residual)) \
            if norm is not None else None
        sink = torch.empty_like(out)
        return time_candidates(cfgs, lambda cfg: launch_down_combine(inter, down, rw, ids, shared, trial, sink, cfg),
                               graphs=True)

    cfg = default_tuner().choose(TABLE, key, cands, time_fn, inter.device)
    return launch_down_combine(inter, down, rw, ids, shared, norm, out, cfg)
