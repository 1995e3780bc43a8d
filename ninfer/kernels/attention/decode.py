"""Decode attention over paged K/V: split-KV (flash-decoding) for up to a few new tokens per sequence.

One program owns one KV head of one sequence and a contiguous range of its keys (a split). Its
``M`` dimension holds every (new token, query head) pair reading that KV head, ``T * GROUP`` rows
(6 at T = 1 on the 27B model), so each K/V byte is read from memory once. The splits write a
normalised partial output and its log-sum-exp; a second kernel merges them per output row.

The number of splits is fixed on the host (enough programs to fill the GPU whatever the batch);
the keys per split follow each sequence's context length on the device, rounded to
``SPLIT_ALIGN`` keys, so short sequences simply leave their last splits empty. No host sync.
Sequences may add up to ``DECODE_MAX_TOKENS`` tokens (speculative verification); the causal mask
among them is applied per row.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from ninfer.kernels.attention.common import LOG2E, kernel_args, kv_tile_rows, load_kv_tile, softmax_step, store_output
from ninfer.kernels.attention.paged import PagedKV
from ninfer.kernels.attention.split_kv import MAX_SPLITS, merge_kernel, sm_count, split_range
from ninfer.kernels.autotune import ninfer_autotune
from ninfer.kernels.dispatch import autotune_configs, fp32_first_config, pdl_enabled
from ninfer.kernels.pdl import pdl_enter

DECODE_MAX_TOKENS = 8


def _config(block_n: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


# K+V per stage at head dim 256 in bf16: 1 KB per key. The first config is the interpreter's, fp32's
# (tests) and NINFER_AUTOTUNE=off's: 16-key tiles compile 3-4x faster in fp32 (0.9-1.7 s against 3-6.7 s
# at head dim 256, offline sm_90); it and the next (64 KB) fit the RTX 5090; deeper pipelines keep more
# bytes in flight on Hopper.
_CONFIGS = [
    _config(16, 4, 1),
    _config(64, 4, 1),
    _config(32, 4, 2),
    _config(32, 4, 3),
    _config(64, 4, 2),
    _config(64, 4, 3),
    _config(64, 8, 3),
    _config(128, 8, 2),
]


@ninfer_autotune(configs=autotune_configs(_CONFIGS), key=["GROUP", "HEAD_DIM", "QUANT", "BLOCK_M"],
                 prune_configs_by=fp32_first_config("q_ptr"))
@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, o_ptr, g_ptr,
    stride_qn, stride_qh, stride_on, stride_oh, stride_gn, stride_gh,
    stride_kp, stride_ks, stride_kh, stride_sp, stride_ss, stride_sh, stride_bt,
    cu_ptr, ctx_ptr, qk_scale, part_o_ptr, part_lse_ptr, num_splits,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr, NG: tl.constexpr,
    HAS_GATE: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL_TRIGGER: tl.constexpr = False,
):
    pdl_enter(False, PDL_TRIGGER)  # the kernel after this (the merge, or unsplit the output projection) may launch
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(cu_ptr + b)
    seqlen = tl.load(cu_ptr + b + 1) - start
    ctx = tl.load(ctx_ptr + b)
    lo, hi, _ = split_range(ctx, split, num_splits)
    if (seqlen == 0) | (lo >= hi):
        return

    offs_r = tl.arange(0, BLOCK_M)
    t = offs_r // GROUP
    head = kvh * GROUP + offs_r % GROUP
    row_ok = t < seqlen
    offs_d = tl.arange(0, HEAD_DIM)
    offs_j = tl.arange(0, BLOCK_N)
    tok = (start + t).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0)
    dtype = q_ptr.dtype.element_ty
    q_pos = ctx - seqlen + t
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + offs_j
        valid_n = offs_n < hi
        rows, page = kv_tile_rows(bt_row, offs_n, valid_n, kvh, stride_kp, stride_ks, stride_kh, PAGE_SIZE)
        k = load_kv_tile(k_ptr, ks_ptr, rows, page, offs_n, offs_d, valid_n, kvh, stride_sp, stride_ss,
                         stride_sh, dtype, PAGE_SIZE, QUANT, NG, True)
        v = load_kv_tile(v_ptr, vs_ptr, rows, page, offs_n, offs_d, valid_n, kvh, stride_sp, stride_ss,
                         stride_sh, dtype, PAGE_SIZE, QUANT, NG, True)
        visible = valid_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        m_i, l_i, acc = softmax_step(q, k, v, m_i, l_i, acc, visible, qk_scale, DOT_PREC)

    if num_splits == 1:  # folded at compile time: Triton specialises integer arguments equal to 1
        store_output(o_ptr, g_ptr, acc / l_i[:, None], tok, head, offs_d, row_ok, stride_on, stride_oh,
                     stride_gn, stride_gh, HAS_GATE)
    else:
        # With several new tokens, a split may hold only keys after a row's query: weight 0, output 0.
        seen = l_i > 0
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
        part = (tok * (GROUP * tl.num_programs(0)) + head) * num_splits + split
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])


@lru_cache(maxsize=None)
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def default_num_splits(device: torch.device, batch: int, kv_heads: int) -> int:
    """About four programs per SM for any batch (at most ``MAX_SPLITS``); 1 when the batch alone fills it.

    Measured on the H200 (``perf/sweep_attention_decode.py``, 27B heads, bf16 KV, contexts 8k-128k): at
    batch 8, 16 splits (512 programs) reach 86-107 % of copy bandwidth where 9 (two per SM) reached
    44-48 %; at batch 1 the cap of 64 splits was the best of those timed."""
    return max(1, min(MAX_SPLITS, 4 * sm_count(device) // (batch * kv_heads)))


def measured_config(q: torch.Tensor, kv: "PagedKV", programs: int) -> dict | None:
    """The tile config the H200 sweep found best for 16-bit queries over bf16 KV, or None (autotune).

    ``perf/sweep_attention_decode.py`` timed every config with every split count: 64-key tiles in two
    stages won with up to ~256 programs (batch 1: 39 / 70 / 94 % of copy bandwidth at 8k / 32k / 128k),
    32-key tiles in two stages with ~512 (batch 8: 86 / 102 / 107 %, reads only), within 3 % of the
    best in every case. The autotuner cannot find this itself: its key holds no batch or context, so it
    would time whichever shape came first. Other GPUs (the RTX 5090 has 99 KB of shared memory, too
    little for 64-key tiles in two stages), fp32 and quantized KV keep the autotuner."""
    if q.device.type != "cuda" or q.dtype == torch.float32 or kv.quant is not None or not _is_sm90(q.device):
        return None
    block_n = 32 if programs >= 384 else 64
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 2}


def paged_attention_decode_triton(
    q: torch.Tensor,
    kv: "PagedKV",
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen: int,
    *,
    gate: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal paged attention when every sequence adds at most ``max_seqlen <= DECODE_MAX_TOKENS`` tokens."""
    assert 1 <= max_seqlen <= DECODE_MAX_TOKENS, max_seqlen
    out, args, consts = kernel_args(q, kv, block_tables, gate, out)
    n, heads, head_dim = q.shape
    batch, kv_heads = context_lens.shape[0], kv.k.shape[2]
    if n == 0:
        return out
    splits = num_splits or default_num_splits(q.device, batch, kv_heads)
    part_o = torch.empty((n, heads, splits, head_dim) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((n, heads, splits) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    block_m = max(16, triton.next_power_of_2(max_seqlen * consts["GROUP"]))
    chosen = measured_config(q, kv, kv_heads * batch * splits)
    kernel = _decode_kernel if chosen is None else _decode_kernel.fn  # .fn: the kernel without its autotuner
    trigger = pdl_enabled(q.device)
    kernel[(kv_heads, batch, splits)](*args, cu_seqlens, context_lens, scale * LOG2E, part_o, part_lse, splits,
                                      BLOCK_M=block_m, PDL_TRIGGER=trigger, **consts, **(chosen or {}))
    if splits > 1:
        g = out if gate is None else gate
        merge_kernel[(heads, max_seqlen, batch)](
            part_o_ptr=part_o, part_lse_ptr=part_lse, o_ptr=out, g_ptr=g, cu_ptr=cu_seqlens, ctx_ptr=context_lens,
            stride_on=out.stride(0), stride_oh=out.stride(1), stride_gn=g.stride(0), stride_gh=g.stride(1),
            num_splits=splits, HEADS=heads, HEAD_DIM=head_dim, SPLITS_POW2=triton.next_power_of_2(splits),
            HAS_GATE=gate is not None, PDL_TRIGGER=trigger, num_warps=8,
        )
    return out
