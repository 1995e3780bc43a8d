"""Gated DeltaNet prefill: the chunked (UT) rule over a ragged batch, in three Triton kernels.

With chunk-local rows ``r, s`` (chunks of 64), ``gamma`` the inclusive in-chunk cumulative log
decay, ``Gamma_rs = exp(gamma_r - gamma_s)`` for ``s <= r`` and ``S`` the state entering a chunk::

    T     = (I + strict_lower(beta K K^T * Gamma))^-1          # unit lower triangular
    V_new = T diag(beta) (V - exp(gamma) * (K S))               # == U - W S of the reference
    O     = exp(gamma) * (Q S) + ((Q K^T) * Gamma) V_new
    S    <- exp(gamma_last) S + K^T (exp(gamma_last - gamma) * V_new)

1. ``_qk_gate_kernel`` (chunk x key head): normalised q/k, the gates of the key head's value heads,
   ``gamma`` and ``P = (Q K^T) * Gamma`` (``Q K^T`` is shared by the value heads of a group).
2. ``_inverse_kernel`` (chunk x value head, few warps): ``T diag(beta)`` from 16x16 blocks:
   forward substitution on the four diagonal blocks, block substitution for the six below.
3. ``_state_kernel`` (sequence x value head x dv block) walks the chunks in order with its state
   slice in registers and also writes the output, so per-chunk states never touch memory.
   Factoring ``W S = T diag(beta) exp(gamma) K S`` lets it reuse the keys it loads anyway instead
   of a precomputed ``W``. It can also write the state after one chosen token of each sequence into
   another slot (prefix-cache checkpoints inside the launch spare the engine a forward per checkpoint).

Chunks are located on the device: a program finds its sequence from ``cu_seqlens`` (cumulative
chunk counts), so launches need only host ints (no sync) and surplus programs exit at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.autotune import ninfer_autotune
from ninfer.kernels.deltanet.common import check_head_dims, decay_beta, l2_normalize
from ninfer.kernels.dispatch import autotune_configs

CHUNK = 64
SUB = 16  # side of the blocks of T
# Products of the fp32 16 x 16 blocks of T = (I + A)^-1 in bf16/fp16 runs (fp32 runs are always "ieee").
# TF32, Triton's default for fp32, puts ~1e-3 relative error into T; "ieee" (FMA loops) is exact; "tf32x3"
# (three TF32 products) is near-fp32 on the tensor cores. perf/bench_deltanet.py times the three in one
# run; on the H200 "tf32x3" was the fastest at 1k/8k/32k (4-5% over "ieee" at 8k/32k) with outputs within
# 1.1e-3 relative of "ieee"'s, so it is the default.
INVERSE_PRECISION = "tf32x3"
# dv block of the state kernel, never smaller, also for dv < 64 (small test models: padded, masked
# columns): with 16 or 32 the B operands of its chain of wgmma dots are 16 / 32-column tiles (32 / 64-byte
# swizzle) and Triton on sm_90 emits wgmma reads past the end of one (memcheck: invalid __shared__ read at
# the ``T @ (V - ...)`` dot), so 16-bit inputs fault with an illegal address or, with num_stages = 2, give
# wrong results. 64 (128-byte swizzled B tiles) is clean in every config; tests/kernels/
# test_deltanet_codegen.py compiles the launcher's configs for sm_90 and checks those tiles on any host.
BLOCK_V = 64


@triton.jit
def _locate_chunk(cu_seqlens, chunk, batch, BLOCK_B: tl.constexpr, C: tl.constexpr):
    """First packed row of flat chunk ``chunk`` and its number of rows (<= 0: past the last chunk)."""
    offs = tl.arange(0, BLOCK_B)
    starts = tl.load(cu_seqlens + offs, mask=offs < batch, other=0).to(tl.int64)
    ends = tl.load(cu_seqlens + offs + 1, mask=offs < batch, other=0).to(tl.int64)
    counts = (ends - starts + C - 1) // C
    through = tl.cumsum(counts, 0)  # chunks of all sequences up to and including each one
    pick = offs == tl.sum((through <= chunk).to(tl.int32), 0)
    row0 = tl.sum(tl.where(pick, starts + (chunk - through + counts) * C, 0), 0)
    return row0, tl.minimum(tl.sum(tl.where(pick, ends, 0), 0) - row0, C)


@ninfer_autotune(configs=autotune_configs([triton.Config({}, num_warps=w) for w in (4, 8)]),
                 key=["HV", "GROUP", "DK"])
@triton.jit
def _qk_gate_kernel(
    q, k, a, b, A_log, dt_bias, cu_seqlens, qn, kn, gam, bet, pmat,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_a_t, stride_b_t, batch, scale,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, BLOCK_B: tl.constexpr, C: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    key_head = tl.program_id(1)
    row0, n = _locate_chunk(cu_seqlens, tl.program_id(0), batch, BLOCK_B, C)
    if n <= 0:
        return
    dot_t = qn.dtype.element_ty
    r = tl.arange(0, C)
    valid = r < n
    rows = row0 + r
    offs_k = tl.arange(0, DK)
    q_c = l2_normalize(tl.load(q + rows[:, None] * stride_q_t + key_head * stride_q_h + offs_k[None, :],
                               mask=valid[:, None], other=0.0), scale, 1).to(dot_t)
    k_c = l2_normalize(tl.load(k + rows[:, None] * stride_k_t + key_head * stride_k_h + offs_k[None, :],
                               mask=valid[:, None], other=0.0), 1.0, 1).to(dot_t)
    qk_off = rows[:, None] * (HV // GROUP * DK) + key_head * DK + offs_k[None, :]
    tl.store(qn + qk_off, q_c, mask=valid[:, None])
    tl.store(kn + qk_off, k_c, mask=valid[:, None])
    qk = tl.dot(q_c, tl.trans(k_c), input_precision=DOT_PREC)
    causal = r[:, None] >= r[None, :]
    for j in tl.static_range(GROUP):
        head = key_head * GROUP + j
        g, beta = decay_beta(tl.load(a + rows * stride_a_t + head, mask=valid, other=0.0),
                             tl.load(b + rows * stride_b_t + head, mask=valid, other=0.0),
                             -tl.exp(tl.load(A_log + head).to(tl.float32)), tl.load(dt_bias + head).to(tl.float32))
        gamma = tl.cumsum(tl.where(valid, g, 0.0), 0)  # padded rows repeat the last gamma: no inf below
        tl.store(gam + rows * HV + head, gamma, mask=valid)
        tl.store(bet + rows * HV + head, beta, mask=valid)
        p = qk * tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], float("-inf")))
        tl.store(pmat + (rows[:, None] * HV + head) * C + r[None, :], p.to(dot_t), mask=valid[:, None])


@triton.jit
def _key_cols(kn_c, n, first, kb, KSTRIDE: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    r = first + tl.arange(0, BC)
    cols = kb + tl.arange(0, BK)[None, :]
    return tl.load(kn_c + r[:, None] * KSTRIDE + cols, mask=(r < n)[:, None], other=0.0)


@triton.jit
def _gram_blocks(kn_c, n, KSTRIDE: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr,
                 BC: tl.constexpr, DOT_PREC: tl.constexpr):
    """The ten lower blocks ``K_i K_j^T`` of the chunk's Gram matrix, accumulated over dk slices.

    Slicing dk keeps only four ``BC x BK`` key slices live at a time (few warps, no spills).
    """
    z = tl.zeros((BC, BC), dtype=tl.float32)
    a00, a11, a22, a33, a10, a20, a21, a30, a31, a32 = z, z, z, z, z, z, z, z, z, z
    for kb in range(0, DK, BK):
        k0 = _key_cols(kn_c, n, 0, kb, KSTRIDE, BK, BC)
        k1 = _key_cols(kn_c, n, BC, kb, KSTRIDE, BK, BC)
        k2 = _key_cols(kn_c, n, 2 * BC, kb, KSTRIDE, BK, BC)
        k3 = _key_cols(kn_c, n, 3 * BC, kb, KSTRIDE, BK, BC)
        a00 = tl.dot(k0, tl.trans(k0), a00, input_precision=DOT_PREC)
        a11 = tl.dot(k1, tl.trans(k1), a11, input_precision=DOT_PREC)
        a22 = tl.dot(k2, tl.trans(k2), a22, input_precision=DOT_PREC)
        a33 = tl.dot(k3, tl.trans(k3), a33, input_precision=DOT_PREC)
        a10 = tl.dot(k1, tl.trans(k0), a10, input_precision=DOT_PREC)
        a20 = tl.dot(k2, tl.trans(k0), a20, input_precision=DOT_PREC)
        a21 = tl.dot(k2, tl.trans(k1), a21, input_precision=DOT_PREC)
        a30 = tl.dot(k3, tl.trans(k0), a30, input_precision=DOT_PREC)
        a31 = tl.dot(k3, tl.trans(k1), a31, input_precision=DOT_PREC)
        a32 = tl.dot(k3, tl.trans(k2), a32, input_precision=DOT_PREC)
    return a00, a11, a22, a33, a10, a20, a21, a30, a31, a32


@triton.jit
def _gated(kk, gam_c, bet_c, n, i: tl.constexpr, j: tl.constexpr, HV: tl.constexpr, BC: tl.constexpr):
    """Block (i, j) of ``strict_lower(beta K K^T * Gamma)`` from the Gram block ``kk``."""
    ri = i * BC + tl.arange(0, BC)
    rj = j * BC + tl.arange(0, BC)
    gamma_i = tl.load(gam_c + ri * HV, mask=ri < n, other=0.0)
    gamma_j = tl.load(gam_c + rj * HV, mask=rj < n, other=0.0)
    beta_i = tl.load(bet_c + ri * HV, mask=ri < n, other=0.0)
    keep = (ri < n)[:, None] & (rj < n)[None, :]  # padded rows: never exp of a positive difference
    if i == j:
        keep = keep & (ri[:, None] > rj[None, :])
    return kk * beta_i[:, None] * tl.exp(tl.where(keep, gamma_i[:, None] - gamma_j[None, :], float("-inf")))


@triton.jit
def _substitute_row(x, sel):
    """One forward-substitution step: row ``sel`` of ``x`` (still ``-A``) becomes a row of ``(I + A)^-1 - I``."""
    row = tl.sum(tl.where(sel, x, 0.0), 0)
    row = row + tl.sum(row[:, None] * x, 0)
    return tl.where(sel, row[None, :], x)


@triton.jit
def _invert_diagonal(a0, a1, a2, a3, BC: tl.constexpr):
    """``(I + a)^-1`` of four strictly lower ``BC x BC`` blocks, interleaved for parallelism."""
    r = tl.arange(0, BC)
    x0, x1, x2, x3 = -a0, -a1, -a2, -a3
    for i in range(2, BC):  # rows 0 and 1 of -a are already final
        sel = r[:, None] == i
        x0 = _substitute_row(x0, sel)
        x1 = _substitute_row(x1, sel)
        x2 = _substitute_row(x2, sel)
        x3 = _substitute_row(x3, sel)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    return x0 + eye, x1 + eye, x2 + eye, x3 + eye


@triton.jit
def _store_block(tm_c, bet_c, n, x, i: tl.constexpr, j: tl.constexpr, HV: tl.constexpr,
                 C: tl.constexpr, BC: tl.constexpr):
    """Store block (i, j) of ``T diag(beta)``."""
    ri = i * BC + tl.arange(0, BC)
    rj = j * BC + tl.arange(0, BC)
    beta_j = tl.load(bet_c + rj * HV, mask=rj < n, other=0.0)
    ptrs = tm_c + ri[:, None] * (HV * C) + rj[None, :]
    tl.store(ptrs, (x * beta_j[None, :]).to(tm_c.dtype.element_ty), mask=(ri < n)[:, None])


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@ninfer_autotune(configs=autotune_configs([triton.Config({}, num_warps=w) for w in (1, 2, 4)]),
                 key=["HV", "GROUP", "DK"])
@triton.jit
def _inverse_kernel(
    kn, gam, bet, cu_seqlens, tmat, batch,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, BLOCK_B: tl.constexpr,
    C: tl.constexpr, BC: tl.constexpr, DOT_PREC: tl.constexpr, INV_PREC: tl.constexpr,
):
    head = tl.program_id(1)
    row0, n = _locate_chunk(cu_seqlens, tl.program_id(0), batch, BLOCK_B, C)
    if n <= 0:
        return
    # Chunk base pointers once; int32 offsets from them keep the address registers few.
    ks: tl.constexpr = HV // GROUP * DK  # row stride of the normalised keys
    kn_c = kn + row0 * ks + head // GROUP * DK
    gam_c = gam + row0 * HV + head
    bet_c = bet + row0 * HV + head
    tm_c = tmat + (row0 * HV + head) * C
    g00, g11, g22, g33, g10, g20, g21, g30, g31, g32 = _gram_blocks(kn_c, n, ks, DK, BK, BC, DOT_PREC)
    a00 = _gated(g00, gam_c, bet_c, n, 0, 0, HV, BC)
    a11 = _gated(g11, gam_c, bet_c, n, 1, 1, HV, BC)
    a22 = _gated(g22, gam_c, bet_c, n, 2, 2, HV, BC)
    a33 = _gated(g33, gam_c, bet_c, n, 3, 3, HV, BC)
    a10 = _gated(g10, gam_c, bet_c, n, 1, 0, HV, BC)
    a20 = _gated(g20, gam_c, bet_c, n, 2, 0, HV, BC)
    a21 = _gated(g21, gam_c, bet_c, n, 2, 1, HV, BC)
    a30 = _gated(g30, gam_c, bet_c, n, 3, 0, HV, BC)
    a31 = _gated(g31, gam_c, bet_c, n, 3, 1, HV, BC)
    a32 = _gated(g32, gam_c, bet_c, n, 3, 2, HV, BC)
    t00, t11, t22, t33 = _invert_diagonal(a00, a11, a22, a33, BC)
    # Block forward substitution: T_ij = -T_ii sum_{j <= m < i} A_im T_mj.
    t10 = -_mm(t11, _mm(a10, t00, INV_PREC), INV_PREC)
    t21 = -_mm(t22, _mm(a21, t11, INV_PREC), INV_PREC)
    t32 = -_mm(t33, _mm(a32, t22, INV_PREC), INV_PREC)
    t20 = -_mm(t22, _mm(a20, t00, INV_PREC) + _mm(a21, t10, INV_PREC), INV_PREC)
    t31 = -_mm(t33, _mm(a31, t11, INV_PREC) + _mm(a32, t21, INV_PREC), INV_PREC)
    t30 = -_mm(t33, _mm(a30, t00, INV_PREC) + _mm(a31, t10, INV_PREC) + _mm(a32, t20, INV_PREC), INV_PREC)
    _store_block(tm_c, bet_c, n, t00, 0, 0, HV, C, BC)
    _store_block(tm_c, bet_c, n, t10, 1, 0, HV, C, BC)
    _store_block(tm_c, bet_c, n, t11, 1, 1, HV, C, BC)
    _store_block(tm_c, bet_c, n, t20, 2, 0, HV, C, BC)
    _store_block(tm_c, bet_c, n, t21, 2, 1, HV, C, BC)
    _store_block(tm_c, bet_c, n, t22, 2, 2, HV, C, BC)
    _store_block(tm_c, bet_c, n, t30, 3, 0, HV, C, BC)
    _store_block(tm_c, bet_c, n, t31, 3, 1, HV, C, BC)
    _store_block(tm_c, bet_c, n, t32, 3, 2, HV, C, BC)
    _store_block(tm_c, bet_c, n, t33, 3, 3, HV, C, BC)


@triton.jit
def _value_cols(offs_v, DV: tl.constexpr, BV: tl.constexpr):
    """Columns of a dv block inside dv: all of them unless the block is padded (dv < BV)."""
    if DV % BV == 0:
        return tl.full(offs_v.shape, 1, tl.int1)  # folded away: the 27B path compiles as without masks
    return offs_v < DV


@ninfer_autotune(
    configs=autotune_configs([triton.Config({}, num_warps=w, num_stages=s) for s in (1, 2) for w in (4, 8)]),
    key=["HV", "GROUP", "DK", "DV", "BV", "BATCH_LOG2", "CKPT"],
    # The state is updated in place (final and checkpoint slots are rows of it): benchmarking configs
    # must neither advance it nor leave checkpoints behind.
    restore_value=["state"],
)
@triton.jit
def _state_kernel(
    qn, kn, v, gam, tmat, pmat, state, o, cu_seqlens, slot_ids, ckpt_offsets, ckpt_slots, stride_v_t, stride_v_h,
    stride_state_s, BATCH_LOG2, HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, DOT_PREC: tl.constexpr, CKPT: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    length = tl.load(cu_seqlens + seq + 1).to(tl.int64) - bos
    if length <= 0:  # an empty sequence leaves its slot alone, as the reference does
        return
    dot_t = qn.dtype.element_ty
    key_head = head // GROUP
    r = tl.arange(0, C)
    offs_k = tl.arange(0, DK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    cols = _value_cols(offs_v, DV, BV)[None, :]  # padded columns: zero state and values, so zero updates
    state_ptrs = (state + tl.load(slot_ids + seq).to(tl.int64) * stride_state_s + head * (DK * DV)
                  + offs_k[:, None] * DV + offs_v[None, :])
    s = tl.load(state_ptrs, mask=cols, other=0.0)
    if CKPT:  # the state after the first ``ckpt`` tokens also goes to slot ``ckpt_slots[seq]``
        ckpt = tl.load(ckpt_offsets + seq).to(tl.int64)
        ckpt_ptrs = (state + tl.load(ckpt_slots + seq).to(tl.int64) * stride_state_s + head * (DK * DV)
                     + offs_k[:, None] * DV + offs_v[None, :])
    for c in range(tl.cdiv(length, C)):
        n = tl.minimum(length - c * C, C)
        valid = r < n
        rows = bos + c * C + r
        qk_off = rows[:, None] * (HV // GROUP * DK) + key_head * DK + offs_k[None, :]
        k_c = tl.load(kn + qk_off, mask=valid[:, None], other=0.0)
        q_c = tl.load(qn + qk_off, mask=valid[:, None], other=0.0)
        v_c = tl.load(v + rows[:, None] * stride_v_t + head * stride_v_h + offs_v[None, :],
                      mask=valid[:, None] & cols, other=0.0).to(tl.float32)
        gamma = tl.load(gam + rows * HV + head, mask=valid, other=0.0)
        gamma_last = tl.load(gam + (bos + c * C + n - 1) * HV + head)
        mat_off = (rows[:, None] * HV + head) * C + r[None, :]
        lower = valid[:, None] & (r[None, :] <= r[:, None])  # blocks above the diagonal were never written
        t_c = tl.load(tmat + mat_off, mask=lower, other=0.0)
        p_c = tl.load(pmat + mat_off, mask=lower, other=0.0)

        s_d = s.to(dot_t)
        decay = tl.exp(gamma)[:, None]
        v_new = tl.dot(t_c, (v_c - decay * tl.dot(k_c, s_d, input_precision=DOT_PREC)).to(dot_t),
                       input_precision=DOT_PREC)
        o_c = (decay * tl.dot(q_c, s_d, input_precision=DOT_PREC)
               + tl.dot(p_c, v_new.to(dot_t), input_precision=DOT_PREC))
        tl.store(o + rows[:, None] * (HV * DV) + head * DV + offs_v[None, :], o_c.to(o.dtype.element_ty),
                 mask=valid[:, None] & cols)
        if CKPT:
            r_in = ckpt - c * C  # checkpoint's rows in this chunk; only its chunk does the extra work
            if (r_in > 0) & (r_in <= n):
                # Rows of v_new below r_in do not depend on later rows (T is lower triangular).
                gamma_ck = tl.load(gam + (bos + c * C + r_in - 1) * HV + head)
                to_ck = (tl.exp(tl.where(r < r_in, gamma_ck - gamma, float("-inf")))[:, None] * v_new).to(dot_t)
                tl.store(ckpt_ptrs, s * tl.exp(gamma_ck) + tl.dot(tl.trans(k_c), to_ck, input_precision=DOT_PREC),
                         mask=cols)
        to_end = (tl.exp(gamma_last - gamma)[:, None] * v_new).to(dot_t)
        s = s * tl.exp(gamma_last) + tl.dot(tl.trans(k_c), to_end, input_precision=DOT_PREC)
    tl.store(state_ptrs, s, mask=cols)


def gated_delta_rule_chunked_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    ckpt_offsets: torch.Tensor | None = None,
    ckpt_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule over a ragged batch; same contract as ``gated_delta_rule``.

    Matmul inputs are bf16/fp16 when q is (fp32 accumulation, fp32 state); fp32 otherwise.

    Checkpoints: with ``ckpt_offsets`` (int32 ``[B]``) and ``ckpt_slots`` (int ``[B]``), both on q's
    device, the state after the first ``ckpt_offsets[b]`` tokens of sequence ``b`` (``1 <= r <= len_b``;
    0 or anything outside that range: none) is also written to ``state[ckpt_slots[b]]``; the final state
    still goes to ``slot_ids[b]`` and ``o`` is unchanged. Writing it inside the launch spares the prefix
    cache a forward (a read of all the weights) per checkpoint. A checkpoint slot must be none of the
    batch's ``slot_ids`` and no other sequence's checkpoint slot.
    """
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    batch = slot_ids.shape[0]
    assert k.shape == q.shape and v.shape[0] == n and hv % hk == 0 and check_head_dims(dk, dv)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    assert state.dtype == torch.float32 and state.shape[1:] == (hv, dk, dv) and state[0].is_contiguous()
    ckpt = ckpt_offsets is not None
    assert ckpt == (ckpt_slots is not None), "ckpt_offsets and ckpt_slots go together"
    assert not ckpt or (ckpt_offsets.shape == (batch,) and ckpt_slots.shape == (batch,))
    o = torch.empty((n, hv, dv), dtype=v.dtype, device=v.device)
    if n == 0:
        return o
    dot_dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    # fp32 runs are the exact path the tests hold against the reference: no TF32 in their products.
    prec = "ieee" if dot_dtype == torch.float32 else "tf32"
    inv_prec = "ieee" if dot_dtype == torch.float32 else INVERSE_PRECISION
    qn = torch.empty((n, hk, dk), dtype=dot_dtype, device=q.device)
    kn = torch.empty_like(qn)
    gam = torch.empty((n, hv), dtype=torch.float32, device=q.device)
    bet = torch.empty_like(gam)
    tmat = torch.empty((n, hv, CHUNK), dtype=dot_dtype, device=q.device)
    pmat = torch.empty_like(tmat)
    max_chunks = (n + (CHUNK - 1) * batch) // CHUNK  # >= sum over sequences of ceil(len / CHUNK)
    block_b = max(2, triton.next_power_of_2(batch))
    group = hv // hk
    _qk_gate_kernel[(max_chunks, hk)](
        q, k, a, b, A_log, dt_bias, cu_seqlens, qn, kn, gam, bet, pmat,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), a.stride(0), b.stride(0), batch, dk ** -0.5,
        HV=hv, GROUP=group, DK=dk, BLOCK_B=block_b, C=CHUNK, DOT_PREC=prec,
    )
    _inverse_kernel[(max_chunks, hv)](
        kn, gam, bet, cu_seqlens, tmat, batch,
        HV=hv, GROUP=group, DK=dk, BK=min(dk, 64), BLOCK_B=block_b, C=CHUNK, BC=SUB, DOT_PREC=prec,
        INV_PREC=inv_prec,
    )
    _state_kernel[(batch, hv, triton.cdiv(dv, BLOCK_V))](
        qn, kn, v, gam, tmat, pmat, state, o, cu_seqlens, slot_ids, ckpt_offsets, ckpt_slots, v.stride(0),
        v.stride(1), state.stride(0), batch.bit_length(), HV=hv, GROUP=group, DK=dk, DV=dv, BV=BLOCK_V, C=CHUNK,
        DOT_PREC=prec, CKPT=ckpt,
    )
    return o


def chunked_batch_sizes(max_batch: int) -> list[int]:
    """Sequence counts up to ``max_batch`` that reach every compiled variant and autotune key of the
    chunked kernels: ``BLOCK_B`` (the next power of two, at least 2), the state kernel's ``BATCH_LOG2``
    tuning key, and Triton's specialisation of the ``batch`` argument (equal to 1, divisible by 16).
    Warm-up prefills packed batches of these sizes, since serving packs several prompts (and decode rows)
    into one chunked launch."""
    seen: dict[tuple[int, int, bool, bool], int] = {}
    for b in range(1, max_batch + 1):
        seen.setdefault((max(2, triton.next_power_of_2(b)), b.bit_length(), b == 1, b % 16 == 0), b)
    return sorted(seen.values())
