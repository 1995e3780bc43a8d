"""Prefill attention over paged K/V: FlashAttention-2 tiling on a ragged causal batch.

One program owns ``BLOCK_M`` new tokens of one sequence for one query head and streams that
sequence's keys ``BLOCK_N`` at a time through the page table, with an online fp32 softmax. Keys
before the block's first query are visible to every row and run without masks; only the tiles
on the diagonal apply the causal mask. Earlier context (a later prefill chunk) is just more
unmasked keys. Grid ``(q_heads, m_blocks, batch * splits)``: the heads vary fastest, so the 6
query heads sharing a KV head (and their neighbours) run together and read its tiles from L2;
m-blocks run longest-first to shorten the causal tail.

Split-KV: a short chunk over a long cached context (a 100-token turn continuing a 64k-token
conversation from the prefix cache) makes only ``q_heads * m_blocks`` programs, 24-48 on the 27B
model against 132 SMs, each walking every cached key alone. Such launches also split the keys, as
the decode kernel does (``decode``): the split count is fixed on the host from the
launch's shape, each split's key range follows the sequence's context length on the device
(``split_range``), and the splits write partial outputs and log-sum-exps that the decode
module's ``merge_kernel`` combines (applying the gate). Launches that fill the GPU store directly.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import triton
import triton.language as tl

from ninfer.kernels.attention.common import (
    LOG2E,
    kernel_args,
    kv_tile_rows,
    load_kv_tile,
    softmax_step,
    store_output,
)
from ninfer.kernels.attention.paged import PagedKV
from ninfer.kernels.attention.split_kv import MAX_SPLITS, merge_kernel, sm_count, split_range
from ninfer.kernels.autotune import ninfer_autotune
from ninfer.kernels.dispatch import autotune_configs, fp32_first_config
from ninfer.kernels.scoped import scoped

SPLIT_BLOCK_M = 64  # the host's guess at BLOCK_M when counting programs (the autotuner picks 16-128)
# forced_prefill_splits' override: a context variable, so that it holds only inside the block and only for
# the thread (or task) that entered it
_forced_splits: ContextVar[int | None] = ContextVar("ninfer_forced_prefill_splits", default=None)


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


# SPLIT in the key: a split launch has fewer keys per program and more programs than an unsplit one of
# the same length, so its best tile differs, and each must be benchmarked on its own.
@ninfer_autotune(configs=autotune_configs(_CONFIGS), key=["GROUP", "HEAD_DIM", "QUANT", "tune_len", "SPLIT"],
                 prune_configs_by=fp32_first_config("q_ptr"))
@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, o_ptr, g_ptr,
    stride_qn, stride_qh, stride_on, stride_oh, stride_gn, stride_gh,
    stride_kp, stride_ks, stride_kh, stride_sp, stride_ss, stride_sh, stride_bt,
    cu_ptr, ctx_ptr, qk_scale, tune_len, part_o_ptr, part_lse_ptr, num_splits,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr, NG: tl.constexpr,
    HAS_GATE: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    head = tl.program_id(0)
    m0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    # The unsplit path keeps the plain kernel's exact code (exit, then context load; loop bounds below):
    # folding it into the split bounds (lo = 0, hi = ctx, min/max clamps) gave the same TTGIR and loop
    # PTX, but ptxas (CUDA 12.9, offline sm_90) then serialised the hot loop's wgmma (C7515) at 128 x 64
    # and 64 x 64 tiles: the 25% slower unsplit prefill seen on the H200. perf/ptx_check.py flags it.
    if SPLIT:
        b = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
        start = tl.load(cu_ptr + b)
        seqlen = tl.load(cu_ptr + b + 1) - start
        ctx = tl.load(ctx_ptr + b)
        lo, hi, _ = split_range(ctx, split, num_splits)
        # Splits past the context's last key are not read by the merge either.
        if (m0 >= seqlen) | (lo >= hi):
            return
    else:
        b = tl.program_id(2)
        start = tl.load(cu_ptr + b)
        seqlen = tl.load(cu_ptr + b + 1) - start
        if m0 >= seqlen:
            return
        ctx = tl.load(ctx_ptr + b)
    past = ctx - seqlen  # context tokens before this call's first new token

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
    # Keys below past + m0 are visible to every row of the block: whole tiles of them (from lo, aligned
    # to BLOCK_N) need no mask. Unsplit, lo = 0 and hi = ctx > past + m0, so the clamps drop out.
    if SPLIT:
        full_end = lo + (tl.minimum(tl.maximum(past + m0, lo), hi) - lo) // BLOCK_N * BLOCK_N
    else:
        lo = 0
        full_end = (past + m0) // BLOCK_N * BLOCK_N
    for n0 in range(lo, full_end, BLOCK_N):
        offs_n = n0 + offs_j
        rows, page = kv_tile_rows(bt_row, offs_n, offs_n < full_end, kvh, stride_kp, stride_ks, stride_kh, PAGE_SIZE)
        k = load_kv_tile(k_ptr, ks_ptr, rows, page, offs_n, offs_d, offs_n < full_end, kvh, stride_sp, stride_ss,
                         stride_sh, dtype, PAGE_SIZE, QUANT, NG, False)
        v = load_kv_tile(v_ptr, vs_ptr, rows, page, offs_n, offs_d, offs_n < full_end, kvh, stride_sp, stride_ss,
                         stride_sh, dtype, PAGE_SIZE, QUANT, NG, False)
        m_i, l_i, acc = softmax_step(q, k, v, m_i, l_i, acc, all_rows, qk_scale, DOT_PREC)

    # One past the last key any row of the block sees, within this split; a split wholly after the
    # block's queries leaves the range empty.
    if SPLIT:
        kv_end = tl.minimum(past + tl.minimum(m0 + BLOCK_M, seqlen), hi)
    else:
        kv_end = past + tl.minimum(m0 + BLOCK_M, seqlen)
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

    if SPLIT:
        # A split holding only keys after a row's query gives that row weight 0 and output 0 (the merge
        # reads every split up to the context's last key, whatever each row saw).
        seen = l_i > 0
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
        part = (tok * tl.num_programs(0) + head) * num_splits + split
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])
    else:
        heads = tl.full([BLOCK_M], 0, tl.int32) + head
        store_output(o_ptr, g_ptr, acc / l_i[:, None], tok, heads, offs_d, row_ok, stride_on, stride_oh,
                     stride_gn, stride_gh, HAS_GATE)


def default_prefill_splits(device: torch.device, heads: int, max_seqlen: int) -> int:
    """1 when one sequence's programs (``heads`` x its m-blocks) fill the GPU; else about two programs per SM.

    One sequence's, not the launch's: in a packed or mixed launch the sequences' programs do unequal work,
    and the longest chunk over the longest context runs alone once the rest are done. Counted over the whole
    launch, 4 decode rows beside a 128-token chunk at 17k context made enough programs to go unsplit, and
    that chunk's 48 programs walked every key alone: 2.3 ms a layer, 44% of the 27B step (run 2026-12-03.17).
    Host-side: the context lengths stay on the device, so a short chunk over a short context splits too;
    its splits past the context are empty and cost one merge launch."""
    sms = sm_count(device)
    programs = heads * triton.cdiv(max_seqlen, SPLIT_BLOCK_M)
    return 1 if programs >= sms else min(MAX_SPLITS, triton.cdiv(2 * sms, programs))


def tune_length(max_seqlen: int) -> int:
    """The autotuning bucket of a launch: short chunks and long prompts favour different tiles."""
    return min(max(triton.next_power_of_2(max_seqlen), 128), 2048)


def launch_variant(device: torch.device, heads: int, max_seqlen: int) -> tuple[int, bool, bool, bool, int]:
    """What the host decides per launch that Triton compiles or tunes apart: the tuning bucket, whether the keys
    are split, the split count's specialisations (equal to 1, divisible by 16) and the merge's power of two.
    The split count follows the SM count, so these classes are not powers of two: on the H200 a 27B chunk of
    257-320 tokens splits 3 ways in the 512-token bucket, where 256 and 512 tokens do not share its variant."""
    splits = default_prefill_splits(device, heads, max_seqlen)
    return tune_length(max_seqlen), splits > 1, splits == 1, splits % 16 == 0, triton.next_power_of_2(splits)


@contextmanager
def forced_prefill_splits(splits: int) -> Iterator[None]:
    """Every prefill launch inside uses ``splits`` key ranges. The engine's start-up warm-up prefills one
    sequence per chunk length, which takes the split kernel for short chunks, while a mixed step (a chunk
    plus decode rows) of the same length takes the unsplit one: warming both keeps their compilation and
    autotuning out of serving. Tests use it too. A launch's own ``num_splits`` still wins."""
    if splits < 1:
        raise ValueError(f"forced_prefill_splits needs splits >= 1, got {splits}")
    with scoped(_forced_splits, splits):
        yield


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
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal paged attention for any batch; ``max_seqlen`` (host int) bounds the new tokens per sequence.
    ``num_splits`` overrides :func:`default_prefill_splits` (the key ranges each sequence is cut into)."""
    out, args, consts = kernel_args(q, kv, block_tables, gate, out)
    n, heads, head_dim = q.shape
    batch = context_lens.shape[0]
    if n == 0:
        return out
    splits = num_splits or _forced_splits.get() or default_prefill_splits(q.device, heads, max_seqlen)
    assert splits == 1 or max_seqlen < 65536, "the merge grid has one program per token in its second axis"
    if splits > 1:
        part_o = torch.empty((n, heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((n, heads, splits), dtype=torch.float32, device=q.device)
        consts["HAS_GATE"] = False  # the merge applies it; one kernel binary for gated and plain layers
    else:
        part_o = part_lse = out  # never read or written without splits

    def grid(meta: dict) -> tuple[int, int, int]:
        return heads, triton.cdiv(max_seqlen, meta["BLOCK_M"]), batch * splits

    tune_len = tune_length(max_seqlen)
    _prefill_kernel[grid](*args, cu_seqlens, context_lens, scale * LOG2E, tune_len, part_o, part_lse, splits,
                          SPLIT=splits > 1, **consts)
    if splits > 1:
        g = out if gate is None else gate
        merge_kernel[(heads, max_seqlen, batch)](
            part_o_ptr=part_o, part_lse_ptr=part_lse, o_ptr=out, g_ptr=g, cu_ptr=cu_seqlens, ctx_ptr=context_lens,
            stride_on=out.stride(0), stride_oh=out.stride(1), stride_gn=g.stride(0), stride_gh=g.stride(1),
            num_splits=splits, HEADS=heads, HEAD_DIM=head_dim, SPLITS_POW2=triton.next_power_of_2(splits),
            HAS_GATE=gate is not None, num_warps=8,
        )
    return out
