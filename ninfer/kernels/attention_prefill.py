"""Prefill attention over paged K/V: FlashAttention-2 tiling on a ragged causal batch.

One program owns ``BLOCK_M`` new tokens of one sequence for one query head and streams that
sequence's keys ``BLOCK_N`` at a time through the page table, with an online fp32 softmax. Keys
before the block's first query are visible to every row and run without masks; only the tiles
on the diagonal apply the causal mask. Earlier context (a later prefill chunk) is just more
unmasked keys. Grid ``(q_heads, m_blocks, batch)``: the heads vary fastest, so the 6 query heads
sharing a KV head (and their neighbours) run together and read its tiles from L2; m-blocks run
longest-first to shorten the causal tail.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ninfer.kernels.attention_common import LOG2E, kernel_args, kv_tile_rows, load_kv_tile, softmax_step, store_output
from ninfer.kernels.dispatch import autotune_configs, fp32_first_config

if TYPE_CHECKING:
    from ninfer.kernels.attention import PagedKV


def _config(block_m: int, block_n: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


# Shared memory at head dim 256 in bf16: Q 512 B/row, K+V 1 KB/key per stage. The first config is the
# interpreter's, fp32's (tests) and NINFER_AUTOTUNE=off's: small tiles, because ptxas takes 1.4 s on an
# fp32 head-dim-256 tile of 16 x 16 and 19 s on 64 x 32 (offline sm_90 compile); it fits the RTX 5090's
# 99 KB (24 KB in bf16) as does the next; the larger ones are for Hopper.
_CONFIGS = [
    _config(16, 16, 4, 1),
    _config(64, 32, 4, 1),
    _config(64, 32, 4, 2),
    _config(64, 64, 4, 2),
    _config(128, 32, 8, 2),
    _config(128, 32, 8, 3),
    _config(128, 64, 8, 2),
]


@triton.autotune(configs=autotune_configs(_CONFIGS), key=["GROUP", "HEAD_DIM", "QUANT", "tune_len"],
                 prune_configs_by=fp32_first_config("q_ptr"))
@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, o_ptr, g_ptr,
    stride_qn, stride_qh, stride_on, stride_oh, stride_gn, stride_gh,
    stride_kp, stride_ks, stride_kh, stride_sp, stride_ss, stride_sh, stride_bt,
    cu_ptr, ctx_ptr, qk_scale, tune_len,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr, NG: tl.constexpr,
    HAS_GATE: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    head = tl.program_id(0)
    b = tl.program_id(2)
    m0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    start = tl.load(cu_ptr + b)
    seqlen = tl.load(cu_ptr + b + 1) - start
    if m0 >= seqlen:
        return
    past = tl.load(ctx_ptr + b) - seqlen  # context tokens before this call's first new token

    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seqlen
    offs_d = tl.arange(0, HEAD_DIM)
    offs_j = tl.arange(0, BLOCK_N)
    tok = (start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qn + head * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0)
    dtype = q_ptr.dtype.element_ty
    kvh = head // GROUP
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    all_rows = tl.full([BLOCK_M, BLOCK_N], 1, tl.int1)
    full_end = (past + m0) // BLOCK_N * BLOCK_N  # keys below it are visible to every row of the block
    for n0 in range(0, full_end, BLOCK_N):
        offs_n = n0 + offs_j
        rows, page = kv_tile_rows(bt_row, offs_n, offs_n < full_end, kvh, stride_kp, stride_ks, stride_kh, PAGE_SIZE)
        k = load_kv_tile(k_ptr, ks_ptr, rows, page, offs_n, offs_d, offs_n < full_end, kvh, stride_sp, stride_ss,
                         stride_sh, dtype, PAGE_SIZE, QUANT, NG, False)
        v = load_kv_tile(v_ptr, vs_ptr, rows, page, offs_n, offs_d, offs_n < full_end, kvh, stride_sp, stride_ss,
                         stride_sh, dtype, PAGE_SIZE, QUANT, NG, False)
        m_i, l_i, acc = softmax_step(q, k, v, m_i, l_i, acc, all_rows, qk_scale, DOT_PREC)

    kv_end = past + tl.minimum(m0 + BLOCK_M, seqlen)  # one past the last key any row of the block sees
    q_pos = past + offs_m
    for n0 in range(full_end, kv_end, BLOCK_N):
        offs_n = n0 + offs_j
        valid_n = offs_n < kv_end
        rows, page = kv_tile_rows(bt_row, offs_n, valid_n, kvh, stride_kp, stride_ks, stride_kh, PAGE_SIZE)
        k = load_kv_tile(k_ptr, ks_ptr, rows, page, offs_n, offs_d, valid_n, kvh, stride_sp, stride_ss,
                         stride_sh, dtype, PAGE_SIZE, QUANT, NG, True)
        v = load_kv_tile(v_ptr, vs_ptr, rows, page, offs_n, offs_d, valid_n, kvh, stride_sp, stride_ss,
                         stride_sh, dtype, PAGE_SIZE, QUANT, NG, True)
        visible = valid_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        m_i, l_i, acc = softmax_step(q, k, v, m_i, l_i, acc, visible, qk_scale, DOT_PREC)

    heads = tl.full([BLOCK_M], 0, tl.int32) + head
    store_output(o_ptr, g_ptr, acc / l_i[:, None], tok, heads, offs_d, row_ok, stride_on, stride_oh,
                 stride_gn, stride_gh, HAS_GATE)


def paged_attention_prefill_triton(
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
) -> torch.Tensor:
    """Causal paged attention for any batch; ``max_seqlen`` (host int) bounds the new tokens per sequence."""
    out, args, consts = kernel_args(q, kv, block_tables, gate, out)
    heads, batch = q.shape[1], context_lens.shape[0]
    if q.shape[0] == 0:
        return out

    def grid(meta: dict) -> tuple[int, int, int]:
        return heads, triton.cdiv(max_seqlen, meta["BLOCK_M"]), batch

    # Short chunks and long prompts favour different tiles: tune once per length bucket.
    tune_len = min(max(triton.next_power_of_2(max_seqlen), 128), 2048)
    _prefill_kernel[grid](*args, cu_seqlens, context_lens, scale * LOG2E, tune_len, **consts)
    return out
