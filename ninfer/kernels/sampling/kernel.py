"""The Triton sampling kernel: one launch samples one token for every row of ``logits [B, V]``.

Grid ``(n_chunks, B)``. Each program reads one CHUNK of its row once and computes the penalised,
temperature-scaled scores ``u``, the raw and scaled softmax statistics of the chunk, and stores
its KC highest scores with their ids (the candidates; ties cut by lowest id). The last program to
finish a row (an arrival counter per row, reset by that program, so graph replays start from
zero) merges the chunks and picks the token:

* every filter keeps an upper set of ``u``: min_p keeps ``exp(u - max) >= min_p``, top_k keeps
  ``u >= k-th largest``, top_p keeps ``u >= the largest value whose upper set holds top_p of the
  remaining mass``, so the kept set is decided by thresholds found by bisection over the order-
  preserving int32 keys of ``u`` (ties at a threshold are all kept);
* the merged candidates hold every element whose key exceeds ``T_G`` (the largest per-chunk
  KC-th key), so thresholds above ``T_G`` are found exactly in registers. Only when a threshold
  falls below it (top_k > KC, or a nucleus wider than the candidates) does the last program
  stream the row again: bisection passes until the rest fits in NC = S_PAD * KC slots, then one
  pass collects it into the workspace and registers finish exactly;
* the token is drawn by inverse CDF over the kept mass with one uniform from Philox keyed by
  the row's seed with its counter as the Philox counter, so a row's draw never depends on
  other rows. Without filters, the chunk is chosen from the chunk masses and only that chunk
  is scanned.

Keys and the row-streaming passes live in ``passes.py``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ninfer.kernels.sampling.passes import (
    KEY_MAX,
    KEY_NONE,
    block_scores,
    collect_row,
    key_value,
    order_key,
    register_weights,
    row_pass,
    row_scan,
    row_search,
)


@triton.jit
def _largest_key_reaching(keys, w, sel, target, floor):
    """Largest key ``t`` of a selected element with ``sum(w[sel & keys >= t]) >= target``.

    Bisection on the key from ``max(floor, smallest key)`` up, each step snapping the bracket to
    the nearest element keys, so it ends after about log2(#elements above the floor) steps.
    Assumes the sum above the floor reaches target.
    """
    lo = tl.maximum(tl.min(tl.where(sel, keys, KEY_MAX), 0), floor).to(tl.int64)
    hi = tl.max(tl.where(sel, keys, KEY_NONE), 0).to(tl.int64) + 1
    while hi - lo > 1:
        mid = ((lo + hi) // 2).to(tl.int32)
        up = sel & (keys >= mid)
        f = tl.sum(tl.where(up, w, 0.0), 0)
        nxt = tl.min(tl.where(up, keys, KEY_MAX), 0)
        if (f >= target) & (nxt != KEY_MAX):
            lo = nxt.to(tl.int64)
        else:
            hi = tl.max(tl.where(sel & (keys < mid), keys, KEY_NONE), 0).to(tl.int64) + 1
    return lo.to(tl.int32)


@triton.jit
def _select_top(keys, ok, vals, offs, k, out_v, out_id, GROUPS: tl.constexpr, CHUNK: tl.constexpr):
    """Store the ``k`` largest keys' values and ids (ties by lowest id) at ``out_v/out_id[0:n]``.

    Returns ``(t, n)``: every element with a key above ``t`` was stored (``t`` = KEY_NONE: all were).
    The smallest of ``GROUPS >= k`` group maxima has at least k elements at or above it, so the
    bisection starts there (when every group has a valid element).
    """
    n_ok = tl.sum(ok.to(tl.int32), 0)
    t = n_ok * 0 + KEY_NONE
    if n_ok > k:
        groups = tl.reshape(tl.where(ok, keys, KEY_NONE), [GROUPS, CHUNK // GROUPS], can_reorder=True)
        floor = tl.min(tl.max(groups, 1), 0)
        t = _largest_key_reaching(keys, tl.where(ok, 1.0, 0.0), ok, k, floor)
    above = ok & (keys > t)
    tie = ok & (keys == t)
    room = k - tl.sum(above.to(tl.int32), 0)
    sel = above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= room))
    pos = tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(out_v + pos, vals, mask=sel)
    tl.store(out_id + pos, offs, mask=sel)
    return t, tl.sum(sel.to(tl.int32), 0)


@triton.jit
def _pick_in_registers(kept, w, ids, u01, NC: tl.constexpr):
    wk = tl.where(kept, w, 0.0)
    cum = tl.cumsum(wk, 0)
    r = u01 * tl.max(cum, 0)
    j = tl.arange(0, NC)
    first = tl.min(tl.where(kept & (cum > r), j, NC), 0)
    pick = tl.where(first == NC, tl.max(tl.where(kept, j, -1), 0), first)
    return tl.sum(tl.where(j == pick, ids, 0), 0)


@triton.jit
def _sample_row(ck, cid, t_g, M, p_c, z, cm, logits_row, counts_row, seen_row, vocab_limit, inv_temp, inv_rep,
                rep, pres, freq, rep_lim, pen_lim, mask_row, mask_lim, HAS_MASK: tl.constexpr, n_chunks, top_k, top_p,
                min_p, u01, cand_u, cand_id,
                S_PAD: tl.constexpr, NC: tl.constexpr, CHUNK: tl.constexpr):
    """Filters (min_p, top_k, then top_p over what they keep) and the draw, for a T > 0 row.

    The register set is ``(ck, cid)`` (empty slots hold KEY_NONE); it holds every element of the
    set being filtered whose key exceeds ``rb``. Only keys and ids stay live across the row
    passes; weights are recomputed from the keys.
    """
    rb = t_g
    none = t_g * 0 + KEY_NONE
    k_on = (top_k > 0) & (top_k < vocab_limit)
    mp_on = min_p > 0.0
    p_on = top_p < 1.0
    min_p = tl.where(mp_on, min_p, 0.0)
    tk = none
    if k_on:
        inc = ck > rb
        if tl.sum(inc.to(tl.int32), 0) >= top_k:
            tk = _largest_key_reaching(ck, tl.where(inc, 1.0, 0.0), inc, top_k, none)
        else:
            tk, _f, n_lo = row_search(logits_row, counts_row, seen_row, vocab_limit, inv_temp, inv_rep, rep,
                                      pres, freq, rep_lim, pen_lim, mask_row, mask_lim, HAS_MASK, n_chunks, M, none,
                                      0.0, top_k.to(tl.float32),
                                      vocab_limit.to(tl.float32), rb + 1, False, NC, CHUNK)
            if n_lo <= NC:
                ck, cid = collect_row(logits_row, counts_row, seen_row, vocab_limit, inv_temp, inv_rep, rep,
                                      pres, freq, rep_lim, pen_lim, mask_row, mask_lim, HAS_MASK, n_chunks, M, none,
                                      0.0, tk, cand_u, cand_id,
                                      NC, CHUNK)
                rb = tk - 1
                tk = _largest_key_reaching(ck, tl.where(ck != KEY_NONE, 1.0, 0.0), ck != KEY_NONE, top_k, none)
    # Complete: no element left out of the registers passes top_k and min_p.
    complete = (rb == KEY_NONE) | (tk > rb) | (mp_on & (tl.exp(key_value(rb) - M) < min_p))
    cw = register_weights(ck, M)
    z0 = tl.sum(tl.where((ck >= tk) & (cw >= min_p), cw, 0.0), 0)
    if ~complete:
        if k_on | mp_on:
            z0, n0, _nx, _pv = row_pass(logits_row, counts_row, seen_row, vocab_limit, inv_temp, inv_rep, rep,
                                        pres, freq, rep_lim, pen_lim, mask_row, mask_lim, HAS_MASK, n_chunks, M, tk,
                                        min_p, none, True, CHUNK)
            if n0 <= NC:
                ck, cid = collect_row(logits_row, counts_row, seen_row, vocab_limit, inv_temp, inv_rep, rep,
                                      pres, freq, rep_lim, pen_lim, mask_row, mask_lim, HAS_MASK, n_chunks, M, tk,
                                      min_p, none, cand_u, cand_id,
                                      NC, CHUNK)
                rb = none
                complete = rb == KEY_NONE
        else:
            z0 = z
    kt = none
    zk = z0
    if p_on:
        target = top_p * z0
        cw = register_weights(ck, M)
        inc = (ck > rb) & (ck >= tk) & (cw >= min_p)
        if (tl.sum(tl.where(inc, cw, 0.0), 0) >= target) & (tl.sum(inc.to(tl.int32), 0) > 0):
            kt = _largest_key_reaching(ck, cw, inc, target, none)
        else:
            kt, zk, n_lo = row_search(logits_row, counts_row, seen_row, vocab_limit, inv_temp, inv_rep, rep,
                                      pres, freq, rep_lim, pen_lim, mask_row, mask_lim, HAS_MASK, n_chunks, M, tk,
                                      min_p, target, z0, rb + 1, True,
                                      NC, CHUNK)
            if n_lo <= NC:
                ck, cid = collect_row(logits_row, counts_row, seen_row, vocab_limit, inv_temp, inv_rep, rep,
                                      pres, freq, rep_lim, pen_lim, mask_row, mask_lim, HAS_MASK, n_chunks, M, tk,
                                      min_p, kt, cand_u, cand_id,
                                      NC, CHUNK)
                rb = kt - 1
                cw = register_weights(ck, M)
                kt = _largest_key_reaching(ck, cw, ck != KEY_NONE, target, none)
    if complete | (kt > rb):
        cw = register_weights(ck, M)
        tok = _pick_in_registers((ck >= kt) & (ck >= tk) & (cw >= min_p) & (ck != KEY_NONE), cw, cid, u01, NC)
    elif (~k_on) & (~mp_on) & (~p_on):
        # Unfiltered: the chunk masses choose the chunk, and only that chunk is rescanned.
        c = tl.arange(0, S_PAD)
        cum = tl.cumsum(p_c, 0)
        r = u01 * tl.max(cum, 0)
        pick = tl.minimum(tl.min(tl.where(cm & (cum > r), c, S_PAD), 0), n_chunks - 1)
        r_in = r - tl.sum(tl.where(c == pick, cum - p_c, 0.0), 0)
        tok = row_scan(logits_row, counts_row, seen_row, vocab_limit, inv_temp, inv_rep, rep, pres, freq,
                       rep_lim, pen_lim, mask_row, mask_lim, HAS_MASK, pick, pick + 1, M, tk, 0.0, kt, r_in, CHUNK)
    else:
        tok = row_scan(logits_row, counts_row, seen_row, vocab_limit, inv_temp, inv_rep, rep, pres, freq,
                       rep_lim, pen_lim, mask_row, mask_lim, HAS_MASK, n_chunks * 0, n_chunks, M, tk, min_p, kt,
                       u01 * zk, CHUNK)
    return tok


# n_chunks == 1 must stay a runtime value (it seeds loop-carried scalars).
@triton.jit(do_not_specialize=["vocab_limit", "n_chunks"])
def sample_kernel(
    logits_ptr, stride_l, counts_ptr, stride_c, seen_ptr, stride_s, mask_ptr, stride_m, mask_idx_ptr,
    temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, pres_ptr, freq_ptr, rep_ptr, seed_ptr, counter_ptr,
    cand_u_ptr, cand_id_ptr, stat_f_ptr, stat_i_ptr, lp_v_ptr, lp_id_ptr, arrive_ptr,
    tok_ptr, logprob_ptr, top_id_ptr, top_lp_ptr,
    vocab_limit, n_chunks,
    CHUNK: tl.constexpr, KC: tl.constexpr, S_PAD: tl.constexpr, NUM_LP: tl.constexpr, LP_CAP: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    logits_row = logits_ptr + row * stride_l
    counts_row = counts_ptr + row * stride_c
    seen_row = seen_ptr + row * stride_s
    NC: tl.constexpr = S_PAD * KC
    cand_u = cand_u_ptr + row * NC
    cand_id = cand_id_ptr + row * NC
    temp = tl.load(temp_ptr + row)
    greedy = temp <= 0.0
    inv_temp = tl.math.div_rn(1.0, tl.where(greedy, 1.0, temp))
    rep = tl.load(rep_ptr + row)
    inv_rep = tl.math.div_rn(1.0, rep)
    pres = tl.load(pres_ptr + row)
    freq = tl.load(freq_ptr + row)
    rep_lim = tl.where(rep != 1.0, vocab_limit, 0)
    pen_lim = tl.where((pres != 0.0) | (freq != 0.0), vocab_limit, 0)
    mask_row = mask_ptr
    mask_lim = vocab_limit * 0
    if HAS_MASK:  # row -> its bitmask row, -1: unconstrained (reads no mask bytes)
        m_idx = tl.load(mask_idx_ptr + row)
        mask_row = mask_ptr + tl.maximum(m_idx, 0).to(tl.int64) * stride_m
        mask_lim = tl.where(m_idx >= 0, vocab_limit, 0)

    # ---- this chunk: statistics and candidates
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x, u, ok = block_scores(logits_row, counts_row, seen_row, offs, vocab_limit, inv_temp, inv_rep, rep, pres, freq,
                            rep_lim, pen_lim, mask_row, mask_lim, HAS_MASK)
    raw_ok = (offs < vocab_limit) & (x == x)
    xm = tl.max(tl.where(raw_ok, x, float("-inf")), 0)
    xs = tl.sum(tl.where(raw_ok, tl.exp(x - tl.where(xm == float("-inf"), 0.0, xm)), 0.0), 0)
    um = tl.max(tl.where(ok, u, float("-inf")), 0)
    us = tl.sum(tl.where(ok, tl.exp(u - tl.where(um == float("-inf"), 0.0, um)), 0.0), 0)
    t_c, n_c = _select_top(order_key(u), ok, u, offs, KC, cand_u + chunk * KC, cand_id + chunk * KC, KC, CHUNK)
    n_lp = n_c * 0
    if NUM_LP > 0:
        lp_at = (row * S_PAD + chunk) * LP_CAP
        _t, n_lp = _select_top(order_key(tl.where(x == 0.0, 0.0, x)), raw_ok, x, offs, NUM_LP,
                               lp_v_ptr + lp_at, lp_id_ptr + lp_at, LP_CAP, CHUNK)
    sf = stat_f_ptr + (row * S_PAD + chunk) * 4
    tl.store(sf, xm)
    tl.store(sf + 1, xs)
    tl.store(sf + 2, um)
    tl.store(sf + 3, us)
    si = stat_i_ptr + (row * S_PAD + chunk) * 4
    tl.store(si, t_c)
    tl.store(si + 1, n_c)
    tl.store(si + 2, n_lp)
    # Publish this chunk; the last one to arrive merges the row (release/acquire through the counter).
    tl.debug_barrier()
    arrived = tl.atomic_add(arrive_ptr + row, 1, sem="acq_rel")
    if arrived == n_chunks - 1:
        tl.debug_barrier()
        c = tl.arange(0, S_PAD)
        cm = c < n_chunks
        sfc = stat_f_ptr + (row * S_PAD + c) * 4
        xm_c = tl.load(sfc, mask=cm, other=float("-inf"), cache_modifier=".cg")
        xs_c = tl.load(sfc + 1, mask=cm, other=0.0, cache_modifier=".cg")
        um_c = tl.load(sfc + 2, mask=cm, other=float("-inf"), cache_modifier=".cg")
        us_c = tl.load(sfc + 3, mask=cm, other=0.0, cache_modifier=".cg")
        t_g = tl.max(tl.load(stat_i_ptr + (row * S_PAD + c) * 4, mask=cm, other=KEY_NONE, cache_modifier=".cg"), 0)
        raw_max = tl.max(xm_c, 0)
        raw_lse = raw_max + tl.log(tl.sum(tl.where(cm, xs_c * tl.exp(xm_c - raw_max), 0.0), 0))
        M = tl.max(um_c, 0)
        p_c = tl.where(cm, us_c * tl.exp(um_c - M), 0.0)
        z = tl.sum(p_c, 0)
        j = tl.arange(0, NC)
        j_chunk = j // KC
        j_n = tl.load(stat_i_ptr + (row * S_PAD + j_chunk) * 4 + 1, mask=j_chunk < n_chunks, other=0,
                      cache_modifier=".cg")
        in_r = (j % KC) < j_n
        cu = tl.load(cand_u + j, mask=in_r, other=0.0, cache_modifier=".cg")
        cid = tl.load(cand_id + j, mask=in_r, other=0, cache_modifier=".cg")
        ck = tl.where(in_r, order_key(cu), KEY_NONE)
        if greedy:
            tok = tl.min(tl.where(ck == tl.max(ck, 0), cid, KEY_MAX), 0)
        else:
            u01 = tl.rand(tl.load(seed_ptr + row), tl.load(counter_ptr + row))
            tok = _sample_row(ck, cid, t_g, M, p_c, z, cm, logits_row, counts_row, seen_row, vocab_limit, inv_temp,
                              inv_rep, rep, pres, freq, rep_lim, pen_lim, mask_row, mask_lim, HAS_MASK, n_chunks,
                              tl.load(top_k_ptr + row),
                              tl.load(top_p_ptr + row), tl.load(min_p_ptr + row), u01, cand_u, cand_id,
                              S_PAD, NC, CHUNK)
        tok = tok.to(tl.int64)
        tl.store(tok_ptr + row, tok)
        tl.store(logprob_ptr + row, tl.load(logits_row + tok).to(tl.float32) - raw_lse)
        if NUM_LP > 0:
            q = tl.arange(0, S_PAD * LP_CAP)
            q_chunk = q // LP_CAP
            q_n = tl.load(stat_i_ptr + (row * S_PAD + q_chunk) * 4 + 2, mask=q_chunk < n_chunks, other=0,
                          cache_modifier=".cg")
            q_in = (q % LP_CAP) < q_n
            lv = tl.load(lp_v_ptr + row * S_PAD * LP_CAP + q, mask=q_in, other=float("-inf"),
                         cache_modifier=".cg")
            li = tl.load(lp_id_ptr + row * S_PAD * LP_CAP + q, mask=q_in, other=KEY_MAX, cache_modifier=".cg")
            for i in tl.static_range(NUM_LP):
                best = tl.max(lv, 0)
                best_id = tl.min(tl.where(lv == best, li, KEY_MAX), 0)
                tl.store(top_id_ptr + row * NUM_LP + i, best_id.to(tl.int64))
                tl.store(top_lp_ptr + row * NUM_LP + i, best - raw_lse)
                lv = tl.where(li == best_id, float("-inf"), lv)
                li = tl.where(li == best_id, KEY_MAX, li)
        # Penalty state and RNG counter advance here, so the caller does nothing per token. Every
        # thread loads before any stores (barrier): plain read-modify-write, no atomics needed.
        n_tok = tl.load(counts_row + tok)
        step = tl.load(counter_ptr + row)
        tl.debug_barrier()
        tl.store(counts_row + tok, n_tok + 1)
        tl.store(seen_row + tok, 1)
        tl.store(counter_ptr + row, step + 1)
        tl.store(arrive_ptr + row, 0)
