"""Gated DeltaNet decode in one launch: causal conv + SiLU, q/k L2 norm, gates, the delta rule and the
gated RMSNorm, for a few tokens per sequence (decode, speculative verification).

One program owns one (sequence, value head, block of ``BV`` value columns): its ``[dk, BV]`` slice of the fp32
state stays in registers, and every program of a key head convolves and normalizes the key head's q and k
itself (a few hundred channels: cheaper than another launch). A batch-1 step of the 27B model runs 48 x dv / BV
programs: one program per key head (16), which an earlier version ran, left most of the GPU idle and took
~14 us per layer. Two things need the whole key head, and the last of its programs to finish does them
(an arrival counter per (sequence, key head), as the split-K GEMMs' fused reduction does):

* The gated norm needs the full dv row of a head's output: each program stores its block of the rule's output
  (rounded, as the composed path hands it to the norm) and the block's sum of squares; the last program
  normalizes every value head of the group from those (block sums added in block order: deterministic).
* The conv windows are updated in place. Every program of a key head reads the same q/k channels' old
  window, so only the last one writes the new q/k windows; each program writes its own v channels' window.

Numerics follow the composed path (conv, recurrent and gated-norm kernels) rounding for rounding: the conv's
fp32 tap sum to the weight dtype, its SiLU to the weight then the input dtype, the windows it writes back
through the weight dtype; gates, L2 norms and the rule in fp32 (no ``tl.dot``); the rule's output, the normed
value and the output to the input dtype, the norm weight's product to ``promote(weight, input)``. Only fp32
summation orders differ.

The a/b gates come as two ``[N, Hv]`` inputs, or as their projection's input ``x [N, H]`` and float weight
``[2 Hv, H]`` (a rows, then b), which each program then applies to its tokens for its value head (two dot
products of H, fp32, rounded to x's dtype as the projection's GEMM output is): the GEMM's launches (cuBLAS
takes two at decode sizes) and a gap are gone, for 2 H weights read from L2 per program.

Speculative verification (``state_out_slots``) keeps its per-token states: the conv window and the
DeltaNet state after token ``t`` go to slot ``state_out_slots[b, t]`` and the input slot is only read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.autotune import ninfer_autotune
from ninfer.kernels.counters import SLOTS, arrival_counters
from ninfer.kernels.deltanet.common import check_head_dims, decay_beta, l2_normalize
from ninfer.kernels.dispatch import autotune_configs, deltanet_early, pdl_enabled
from ninfer.kernels.norms import NormedRows
from ninfer.kernels.pdl import Pdl, early_pdl, pdl_enter

MAX_TOKENS = 8  # per sequence and call: 1 + at most 7 draft tokens (the tokens are an unrolled loop)
GATE_BLOCK = 2048  # columns of the gate projections' unrolled K blocks: 3 blocks of 16 values a thread at H = 5120
TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _tap_tile(rows, taps, TAP_AXIS: tl.constexpr):
    """``rows [D]`` and ``taps [KP]`` broadcast to a ``[D, KP]`` (``TAP_AXIS = 1``) or ``[KP, D]`` tile."""
    if TAP_AXIS == 1:
        tile = rows[:, None] + taps[None, :]
    else:
        tile = taps[:, None] + rows[None, :]
    return tile


@triton.jit
def _conv_silu(x_rows, sx_n, slot_row, ss_k, w_rows, sw_k, t: tl.constexpr, K: tl.constexpr, WDT: tl.constexpr,
               XDT: tl.constexpr, TAP_AXIS: tl.constexpr):
    """``silu(conv)`` of token ``t`` (fp32, rounded as the conv kernel's output): the conv reads the inputs at
    positions ``t - K + 1 .. t``, those before position 0 from the old window in the state slot.

    The window is one tile of channels x taps: as separate per-tap vectors it kept so many pointer vectors
    live beside the state that ptxas spilled ~10 KB per thread at dk = dv = 128. Its taps lie along
    ``TAP_AXIS``, the other axis along the state's axis the result multiplies (q, k: dk = 0; v: dv = 1),
    so that the compiler keeps the state in one register layout (else it converts the whole state
    through 64 KB of shared memory)."""
    KP: tl.constexpr = triton.next_power_of_2(K)
    tap = tl.arange(0, KP)
    pos = t - (K - 1) + tap
    zero = tl.zeros(x_rows.shape, dtype=tl.int32)
    in_k = _tap_tile(zero, tap, TAP_AXIS) < K
    fresh = _tap_tile(zero, pos, TAP_AXIS) >= 0  # a new token's input, else one of the old window
    from_x = tl.load(_tap_tile(x_rows, pos * sx_n, TAP_AXIS), mask=fresh & in_k, other=0.0)
    from_old = tl.load(_tap_tile(slot_row, (K - 1 + pos) * ss_k, TAP_AXIS), mask=~fresh, other=0.0)
    window = tl.where(fresh, from_x.to(WDT), from_old.to(WDT)).to(tl.float32)
    w = tl.load(_tap_tile(w_rows, tap * sw_k, TAP_AXIS), mask=in_k, other=0.0).to(tl.float32)
    y = tl.sum(window * w, axis=TAP_AXIS).to(WDT).to(tl.float32)
    return (y / (1.0 + tl.exp(-y))).to(WDT).to(XDT).to(tl.float32)


@triton.jit
def _window_after(x_rows, sx_n, old_row, ss_k, last, ok, K: tl.constexpr, WDT: tl.constexpr):
    """The ``K - 1`` inputs of the window after position ``last``, oldest first (those before position 0 from the old
    window ``old_row``), rounded through the weight dtype ``WDT`` as the conv reads them (and as the conv kernel and
    the reference write them); loads only, none where ``ok`` is false."""
    vals = ()
    for j in tl.static_range(K - 1):
        pos = last - (K - 2) + j
        from_x = tl.load(x_rows + pos * sx_n, mask=ok & (pos >= 0), other=0.0)
        from_old = tl.load(old_row + (K - 1 + pos) * ss_k, mask=ok & (pos < 0), other=0.0)
        vals = vals + (tl.where(pos >= 0, from_x.to(WDT), from_old.to(WDT)),)
    return vals


@triton.jit
def _windows_read(rows, sx_n, slot_rows, conv_state, out_slots, seq, length, ch, ss_s, ss_c, ss_k, so_b,
                  K: tl.constexpr, T_MAX: tl.constexpr, HAS_OUT_SLOTS: tl.constexpr, WDT: tl.constexpr):
    """The conv windows of channels ``ch`` to write, as ``(targets, values, oks)``: after every token to its out
    slot, or after the last one in place. Loads only: :func:`_windows_write` stores them after a barrier, so that
    a caller can have several sets of loads in flight at once."""
    targets = ()
    values = ()
    oks = ()
    if HAS_OUT_SLOTS:
        for t in tl.static_range(T_MAX):
            ok = t < length
            out_slot = tl.load(out_slots + seq * so_b + t, mask=ok, other=0).to(tl.int64)
            targets = targets + (conv_state + out_slot * ss_s + ch * ss_c,)
            values = values + (_window_after(rows + ch, sx_n, slot_rows + ch * ss_c, ss_k, t, ok, K, WDT),)
            oks = oks + (ok,)
    else:
        ok = length > 0
        targets = (slot_rows + ch * ss_c,)
        values = (_window_after(rows + ch, sx_n, slot_rows + ch * ss_c, ss_k, length - 1, ok, K, WDT),)
        oks = (ok,)
    return targets, values, oks


@triton.jit
def _windows_write(targets, values, oks, ss_k, K: tl.constexpr):
    """Store what :func:`_windows_read` read (after a barrier where the windows are updated in place)."""
    for i in tl.static_range(len(targets)):
        for j in tl.static_range(K - 1):
            tl.store(targets[i] + j * ss_k, values[i][j].to(targets[i].dtype.element_ty), mask=oks[i])


@triton.jit
def _gate_projections(x_row, w_a_row, w_b_row, r, H: tl.constexpr, BH: tl.constexpr):
    """``(x . w_a, x . w_b) * r`` of one token and value head: fp32 sums, rounded to x's dtype as the projection's
    GEMM output is (``r``: the row's deferred-norm factor, or 1). The K blocks are unrolled so that all their loads
    are in flight at once."""
    acc_a = tl.zeros((BH,), dtype=tl.float32)
    acc_b = tl.zeros((BH,), dtype=tl.float32)
    for h0 in tl.static_range(0, H, BH):
        offs = h0 + tl.arange(0, BH)
        ok = offs < H
        xs = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        acc_a += xs * tl.load(w_a_row + offs, mask=ok, other=0.0).to(tl.float32)
        acc_b += xs * tl.load(w_b_row + offs, mask=ok, other=0.0).to(tl.float32)
    xdt = x_row.dtype.element_ty
    return (tl.sum(acc_a, axis=0) * r).to(xdt), (tl.sum(acc_b, axis=0) * r).to(xdt)


@triton.jit
def _row_factor(stats, tok, stride_p, n_parts, eps, H: tl.constexpr, PARTS: tl.constexpr):
    """``rsqrt(sum(stats[:, tok]) / H + eps)``: the deferred norm's factor of row ``tok`` from its shares
    (``ninfer.kernels.quant_gemm.deferred_norm``), summed in part order; they bypass L1 (written the launch before)."""
    parts = tl.arange(0, PARTS)
    shares = tl.load(stats + parts * stride_p + tok, mask=parts < n_parts, other=0.0, cache_modifier=".cg")
    return tl.rsqrt(tl.sum(shares, axis=0) / H + eps)


# (value columns per program, warps): narrow blocks spread a batch-1 step over many SMs; the state block
# [DK, BV] fp32 stays in registers. Compiled for sm_90 at dk = dv = 128 (ptxas: registers per thread), 64 x 4
# warps and 128 x 16 warps spilled; these did not (128 x 8 does at 4 tokens per sequence, 328 B).
_CONFIGS = [(32, 4), (16, 2), (64, 8), (128, 8)]


@ninfer_autotune(
    configs=autotune_configs([triton.Config({"BV": bv}, num_warps=w) for bv, w in _CONFIGS]),
    key=["HV", "GROUP", "DK", "DV", "K", "T_MAX", "BATCH_LOG2", "HAS_OUT_SLOTS"],
    restore_value=["state", "conv_state"],  # both are updated in place: benchmarking must not advance them
)
@triton.jit
def _decode_kernel(
    qkv, z, a, b, conv_w, conv_state, A_log, dt_bias, norm_w, state, y, sumsq, counters, cu_seqlens, slot_ids,
    out_slots, gate_x, gate_w, gate_stats, stride_qkv_t, stride_z_t, stride_a_t, stride_b_t, stride_w_c, stride_w_k,
    stride_cs_s, stride_cs_c, stride_cs_k, stride_state_s, stride_out_slots_b, stride_gx_t, stride_gw_n, stride_gs_p,
    gate_parts, gate_eps, scale, eps, BATCH_LOG2,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K: tl.constexpr,
    T_MAX: tl.constexpr, HAS_OUT_SLOTS: tl.constexpr, WDT: tl.constexpr, PROD_DTYPE: tl.constexpr,
    GATES_FROM_X: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, BV: tl.constexpr, GATE_NORM: tl.constexpr = False,
    GATE_PARTS: tl.constexpr = 1, PDL_TRIGGER: tl.constexpr = False, PDL_WAIT: tl.constexpr = False,
):
    """One program per (sequence, value head, block of value columns). ``PDL_TRIGGER``: the output projection after
    this may launch now and request its weights; ``PDL_WAIT`` (launched early: :func:`~ninfer.kernels.pdl.early_pdl`):
    the sequence bounds, slots, recurrent state and decay parameters, none written by the projection before it, are
    loaded first, then the kernel waits for that projection."""
    pdl_enter(False, PDL_TRIGGER)
    BLOCK: tl.constexpr = BV if BV < DV else DV
    NV: tl.constexpr = DV // BLOCK
    seq, head, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    key_head = head // GROUP
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    length = tl.load(cu_seqlens + seq + 1).to(tl.int64) - bos
    if length <= 0:  # an empty sequence leaves its slots alone, as the references do
        return
    xdt = y.dtype.element_ty
    offs_k = tl.arange(0, DK)
    offs_v = vb * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ids + seq).to(tl.int64)
    # Channels of the conv: q of this key head, its k, then this block of the value head's v.
    q_ch = key_head * DK + offs_k
    k_ch = HV // GROUP * DK + q_ch
    v_ch = 2 * (HV // GROUP) * DK + head * DV + offs_v
    rows = qkv + bos * stride_qkv_t
    slot_rows = conv_state + slot * stride_cs_s
    head_block = head * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
    s = tl.load(state + slot * stride_state_s + head_block)
    neg_A = -tl.exp(tl.load(A_log + head).to(tl.float32))
    bias = tl.load(dt_bias + head).to(tl.float32)
    if PDL_WAIT:
        tl.extra.cuda.gdc_wait()
    for t in tl.static_range(T_MAX):
        if t < length:
            tok = bos + t
            q_t = _conv_silu(rows + q_ch, stride_qkv_t, slot_rows + q_ch * stride_cs_c, stride_cs_k,
                             conv_w + q_ch * stride_w_c, stride_w_k, t, K, WDT, xdt, 1)
            k_t = _conv_silu(rows + k_ch, stride_qkv_t, slot_rows + k_ch * stride_cs_c, stride_cs_k,
                             conv_w + k_ch * stride_w_c, stride_w_k, t, K, WDT, xdt, 1)
            v_t = _conv_silu(rows + v_ch, stride_qkv_t, slot_rows + v_ch * stride_cs_c, stride_cs_k,
                             conv_w + v_ch * stride_w_c, stride_w_k, t, K, WDT, xdt, 0)
            q_t = l2_normalize(q_t, scale, 0)[:, None]
            k_t = l2_normalize(k_t, 1.0, 0)[:, None]
            if GATES_FROM_X:
                r = 1.0
                if GATE_NORM:  # x holds rows whose norm was deferred: the sums take the row's factor
                    r = _row_factor(gate_stats, tok, stride_gs_p, gate_parts, gate_eps, H, GATE_PARTS)
                a_t, b_t = _gate_projections(gate_x + tok * stride_gx_t, gate_w + head * stride_gw_n,
                                             gate_w + (HV + head) * stride_gw_n, r, H, BH)
            else:
                a_t = tl.load(a + tok * stride_a_t + head)
                b_t = tl.load(b + tok * stride_b_t + head)
            g, beta = decay_beta(a_t, b_t, neg_A, bias)
            s = s * tl.exp(g)
            delta = (v_t - tl.sum(s * k_t, axis=0)) * beta
            s = s + k_t * delta[None, :]
            o = tl.sum(s * q_t, axis=0).to(xdt)
            # the rule's output (rounded, as the composed path hands it to the norm) and its block's sum of
            # squares: the norm needs the whole row, which the last program of the key head gathers
            tl.store(y + tok * (HV * DV) + head * DV + offs_v, o)
            o = o.to(tl.float32)
            tl.store(sumsq + (tok * HV + head) * NV + vb, tl.sum(o * o, axis=0))
            if HAS_OUT_SLOTS:
                out_slot = tl.load(out_slots + seq * stride_out_slots_b + t).to(tl.int64)
                tl.store(state + out_slot * stride_state_s + head_block, s)
    if not HAS_OUT_SLOTS:
        tl.store(state + slot * stride_state_s + head_block, s)
    # This block's v windows: no other program reads these channels. (Reading them before the rule, to overlap
    # the loads, cost 10-35 registers and spilled the 128-column config that the H200 takes at batch 1.)
    v_win = _windows_read(rows, stride_qkv_t, slot_rows, conv_state, out_slots, seq, length, v_ch, stride_cs_s,
                          stride_cs_c, stride_cs_k, stride_out_slots_b, K, T_MAX, HAS_OUT_SLOTS, WDT)
    tl.debug_barrier()  # in place: every thread's reads of the old window come before any write
    _windows_write(*v_win, stride_cs_k, K)
    # Every program of the key head convolved its old q/k windows and stored its outputs before it arrives:
    # the last to arrive writes the new q/k windows and normalizes the group's outputs.
    counter = counters + seq * (HV // GROUP) + key_head
    tl.debug_barrier()
    if tl.atomic_add(counter, 1, sem="acq_rel") == GROUP * NV - 1:
        tl.debug_barrier()
        # Every load of this tail first (the q and k windows, the group's outputs, sums and gates), then one
        # barrier, then the stores: one memory round trip instead of one per window set and value head.
        q_win = _windows_read(rows, stride_qkv_t, slot_rows, conv_state, out_slots, seq, length, q_ch, stride_cs_s,
                              stride_cs_c, stride_cs_k, stride_out_slots_b, K, T_MAX, HAS_OUT_SLOTS, WDT)
        k_win = _windows_read(rows, stride_qkv_t, slot_rows, conv_state, out_slots, seq, length, k_ch, stride_cs_s,
                              stride_cs_c, stride_cs_k, stride_out_slots_b, K, T_MAX, HAS_OUT_SLOTS, WDT)
        normed = _gated_norms(y, z, norm_w, sumsq, bos, length, key_head, stride_z_t, eps, HV, GROUP, DV, NV, T_MAX,
                              PROD_DTYPE)
        tl.debug_barrier()  # the windows are updated in place: all reads of the old ones come first
        _windows_write(*q_win, stride_cs_k, K)
        _windows_write(*k_win, stride_cs_k, K)
        _store_norms(*normed)
        tl.store(counter, 0)  # for the next launch (or graph replay)


@triton.jit
def _gated_norms(y, z, norm_w, sumsq, bos, length, key_head, stride_z_t, eps, HV: tl.constexpr,
                 GROUP: tl.constexpr, DV: tl.constexpr, NV: tl.constexpr, T_MAX: tl.constexpr,
                 PROD_DTYPE: tl.constexpr):
    """The gated RMSNorm of the key head's value heads (all ``GROUP`` as one tile), every token, in the reference's
    order of roundings, from the rule's outputs and block sums of squares that the key head's programs stored
    (other SMs, this launch: loads bypass L1). The blocks' sums add up in block order (deterministic). Returns
    ``(rows, values, masks)`` per token for :func:`_store_norms`: the outputs overwrite the rule's."""
    xdt = y.dtype.element_ty
    GP: tl.constexpr = triton.next_power_of_2(GROUP)
    offs_v = tl.arange(0, DV)[None, :]
    head = key_head * GROUP + tl.arange(0, GP)[:, None]
    in_group = tl.arange(0, GP)[:, None] < GROUP
    norm_weight = tl.load(norm_w + offs_v).to(tl.float32)
    blocks = tl.arange(0, NV)[None, :]
    rows = ()
    values = ()
    masks = ()
    for t in tl.static_range(T_MAX):
        ok = in_group & (t < length)
        tok = bos + t
        row = y + tok * (HV * DV) + head * DV + offs_v
        o = tl.load(row, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        ss = tl.sum(tl.load(sumsq + (tok * HV + head) * NV + blocks, mask=ok, other=0.0, cache_modifier=".cg"),
                    axis=1)[:, None]
        n = (o * tl.rsqrt(ss / DV + eps)).to(xdt).to(tl.float32)
        gz = tl.load(z + tok * stride_z_t + head * DV + offs_v, mask=ok, other=0.0).to(tl.float32)
        out = (norm_weight * n).to(PROD_DTYPE).to(tl.float32) * (gz / (1.0 + tl.exp(-gz)))
        rows = rows + (row,)
        values = values + (out.to(xdt),)
        masks = masks + (ok,)
    return rows, values, masks


@triton.jit
def _store_norms(rows, values, masks):
    for t in tl.static_range(len(rows)):
        tl.store(rows[t], values[t], mask=masks[t])


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """``n`` arrival counters (:mod:`ninfer.kernels.counters`), one per (sequence, key head)."""
    counters = arrival_counters(device)
    if counters is None or n > SLOTS:
        raise RuntimeError(f"DeltaNet decode: {n} arrival counters needed (at most {SLOTS}), first inside "
                           "CUDA-graph capture or more than there are; run the batch size once before capturing it")
    return counters


def gated_deltanet_decode_triton(
    qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    max_seqlen: int,
    state_out_slots: torch.Tensor | None = None,
    gate_x: torch.Tensor | NormedRows | None = None,
    gate_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton :func:`ninfer.kernels.deltanet.mixer.gated_deltanet_reference` for at most ``MAX_TOKENS``
    tokens per sequence (``max_seqlen`` bounds them: a host int, no sync). Updates ``conv_state`` and
    ``state`` in place (or writes per-token slots with ``state_out_slots [B, >= max_seqlen]``). With ``gate_x
    [N, H]`` and ``gate_weight [2 Hv, H]`` (a rows, then b; float) instead of ``a`` and ``b``, the kernel projects
    the gates itself: ``a, b = (gate_x @ gate_weight.T).split(Hv, -1)``; ``gate_x`` may be rows whose norm was
    deferred (:class:`~ninfer.kernels.norms.NormedRows`: each token's sums take its row's factor)."""
    n = qkv.shape[0]
    hv, dk, dv = state.shape[1:]
    taps = conv_weight.shape[1]
    hk = (qkv.shape[1] - hv * dv) // (2 * dk)
    batch = slot_ids.shape[0]
    assert 1 <= max_seqlen <= MAX_TOKENS and hv % hk == 0 and check_head_dims(dk, dv)
    gates_from_x = gate_weight is not None
    gate_norm = gate_x if isinstance(gate_x, NormedRows) else None
    stride_gs, parts, gate_eps = 0, 0, 0.0  # the deferred norm's shares: part stride, parts, eps (with GATE_NORM)
    if gate_norm is not None:
        gate_x = gate_norm.scaled
        stride_gs, parts, gate_eps = gate_norm.stats.stride(0), gate_norm.stats.shape[0], gate_norm.eps
        assert gate_norm.stats.shape[1] == n and gate_norm.stats.stride(1) == 1
    if gates_from_x:
        assert gate_x is not None and gate_x.shape == (n, gate_weight.shape[1]) and gate_weight.shape[0] == 2 * hv
        assert gate_x.stride(1) == 1 and gate_weight.stride(1) == 1 and gate_weight.dtype in TL_DTYPE
        a = b = gate_x  # not read
    else:
        assert a is not None and b is not None and a.stride(1) == 1 and b.stride(1) == 1
        gate_x = gate_weight = a  # not read
    assert qkv.stride(1) == 1 and z.stride(1) == 1
    assert state.dtype == torch.float32 and state[0].is_contiguous() and norm_weight.is_contiguous()
    assert conv_state.shape[1:] == (qkv.shape[1], taps - 1) and z.shape == (n, hv * dv)
    y = torch.empty((n, hv * dv), dtype=qkv.dtype, device=qkv.device)
    if n == 0 or batch == 0:
        return y
    has_out = state_out_slots is not None
    out_slots = state_out_slots if has_out else slot_ids
    blocks = lambda meta: dv // min(meta["BV"], dv)  # noqa: E731
    sumsq = torch.empty((n, hv, dv // min(bv for bv, _ in _CONFIGS)), dtype=torch.float32, device=qkv.device)
    pdl = early_pdl(qkv.device) if deltanet_early() else Pdl(trigger=pdl_enabled(qkv.device))
    _decode_kernel[lambda meta: (batch, hv, blocks(meta))](
        qkv, z, a, b, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, y, sumsq,
        _counters(qkv.device, batch * hk), cu_seqlens, slot_ids, out_slots, gate_x, gate_weight,
        gate_norm.stats if gate_norm is not None else gate_x, qkv.stride(0),
        z.stride(0), a.stride(0), b.stride(0), conv_weight.stride(0), conv_weight.stride(1), conv_state.stride(0),
        conv_state.stride(1), conv_state.stride(2), state.stride(0), out_slots.stride(0) if has_out else 0,
        gate_x.stride(0), gate_weight.stride(0), stride_gs, parts, gate_eps, dk ** -0.5, eps, batch.bit_length(),
        HV=hv, GROUP=hv // hk, DK=dk, DV=dv, K=taps, T_MAX=triton.next_power_of_2(max_seqlen), HAS_OUT_SLOTS=has_out,
        WDT=TL_DTYPE[conv_weight.dtype], PROD_DTYPE=TL_DTYPE[torch.promote_types(norm_weight.dtype, qkv.dtype)],
        GATES_FROM_X=gates_from_x, H=gate_x.shape[1] if gates_from_x else 1,
        BH=min(GATE_BLOCK, triton.next_power_of_2(gate_x.shape[1])) if gates_from_x else 1,
        GATE_NORM=gate_norm is not None, GATE_PARTS=triton.next_power_of_2(max(parts, 1)),
        PDL_TRIGGER=pdl.trigger, PDL_WAIT=pdl.wait, **pdl.options(),
    )
    return y
