"""Streaming helpers of the sampling kernel: scores of a block of ids, their order keys, and the
passes over a whole row that the last program of a row makes when a threshold falls below the
merged candidates (see ``kernel.py``).

Keys: ``key(u) = bits(u)`` for ``u >= 0`` and ``bits(u) ^ 0x7FFFFFFF`` below, so int32 order is float
order; ``KEY_NONE`` (int32 min) lies below every real key and means "no threshold".
"""
from __future__ import annotations

import triton
import triton.language as tl

KEY_NONE = tl.constexpr(-2147483648)
KEY_MAX = tl.constexpr(2147483647)


@triton.jit
def order_key(u):
    b = u.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def key_value(k):
    b = tl.where(k < 0, k ^ 0x7FFFFFFF, k)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def block_scores(logits_row, counts_row, seen_row, offs, vocab_limit, inv_temp, inv_rep, rep, pres, freq, rep_lim,
                 pen_lim, mask_row, mask_lim, HAS_MASK: tl.constexpr):
    """Raw logits ``x``, scores ``u`` (penalties then temperature) and the valid mask of ``offs``.

    Penalty state is only read below ``rep_lim`` / ``pen_lim`` and the token bitmask below
    ``mask_lim`` (vocab_limit for rows that use it, 0 otherwise: a masked-off load moves no
    bytes). Divisions are products with the row's
    reciprocals (within an ulp of the reference's division, and far cheaper); every pass uses
    this one function, so a score is bit-identical in all of them.
    """
    valid = offs < vocab_limit
    x = tl.load(logits_row + offs, mask=valid, other=0.0).to(tl.float32)
    if HAS_MASK:
        # Structured output: a token whose bit is clear is -inf from here on, for the scores and
        # the raw logprobs alike. Unconstrained rows have mask_lim 0: their loads move no bytes.
        word = tl.load(mask_row + offs // 32, mask=offs < mask_lim, other=-1)
        x = tl.where(((word >> (offs % 32)) & 1) != 0, x, float("-inf"))
    seen = tl.load(seen_row + offs, mask=offs < rep_lim, other=0)
    z = tl.where(seen != 0, tl.where(x > 0, x * inv_rep, x * rep), x)
    cnt = tl.load(counts_row + offs, mask=offs < pen_lim, other=0)
    z = z - freq * cnt.to(tl.float32)
    z = z - tl.where(cnt > 0, pres, 0.0)
    u = z * inv_temp
    u = tl.where(u == 0.0, 0.0, u)  # -0.0 and 0.0 must share a key
    return x, u, valid & (x == x) & (u == u)


@triton.jit
def register_weights(ck, M):
    """``exp(u - M)`` of the register set (``u`` recovered bit-exactly from its key); 0 in empty slots."""
    return tl.where(ck != KEY_NONE, tl.exp(key_value(ck) - M), 0.0)


@triton.jit
def row_pass(logits_row, counts_row, seen_row, vocab_limit, inv_temp, inv_rep, rep, pres, freq, rep_lim, pen_lim,
             mask_row, mask_lim, HAS_MASK: tl.constexpr,
             n_chunks, M, tk, min_p, b, USE_MASS: tl.constexpr, CHUNK: tl.constexpr):
    """One pass over the row for the elements kept by top_k (``key >= tk``) and min_p.

    Returns the weight (mass ``exp(u - M)`` or count) and the count of those with key >= b, the
    smallest such key, and the largest key below b. Per-lane accumulators, reduced once at the end.
    """
    fb = tl.zeros([CHUNK], tl.float32)
    nb = tl.zeros([CHUNK], tl.int32)
    nxt = tl.full([CHUNK], KEY_MAX, tl.int32)
    prv = tl.full([CHUNK], KEY_NONE, tl.int32)
    for c in range(0, n_chunks):
        offs = c * CHUNK + tl.arange(0, CHUNK)
        x, u, ok = block_scores(logits_row, counts_row, seen_row, offs, vocab_limit, inv_temp, inv_rep, rep,
                                pres, freq, rep_lim, pen_lim, mask_row, mask_lim, HAS_MASK)
        key = order_key(u)
        wm = tl.exp(u - M)
        keep = ok & (key >= tk) & (wm >= min_p)
        in_b = keep & (key >= b)
        if USE_MASS:
            fb += tl.where(in_b, wm, 0.0)
        else:
            fb += in_b.to(tl.float32)
        nb += in_b.to(tl.int32)
        nxt = tl.minimum(nxt, tl.where(in_b, key, KEY_MAX))
        prv = tl.maximum(prv, tl.where(keep & ~in_b, key, KEY_NONE))
    return tl.sum(fb, 0), tl.sum(nb, 0), tl.min(nxt, 0), tl.max(prv, 0)


@triton.jit
def row_search(logits_row, counts_row, seen_row, vocab_limit, inv_temp, inv_rep, rep, pres, freq, rep_lim, pen_lim,
               mask_row, mask_lim, HAS_MASK: tl.constexpr,
               n_chunks, M, tk, min_p, target, total, hi_key, USE_MASS: tl.constexpr, NC: tl.constexpr,
               CHUNK: tl.constexpr):
    """Bracket the largest key reaching ``target`` below ``hi_key`` by passes over the row.

    ``total`` is the weight of all kept elements (the bracket's lower end starts below them all).
    Each pass bisects the bracket and snaps it to element keys. Stops when it holds one key, or
    when the elements at or above its lower end fit in NC slots (the caller then collects them).
    Returns ``(lo, weight at lo, count at lo)``.
    """
    lo = (tk * 0).to(tl.int64) + KEY_NONE
    hi = hi_key.to(tl.int64)
    f_lo = total
    n_lo = tk * 0 + KEY_MAX  # unknown until lo moves onto an element
    while (hi - lo > 1) & (n_lo > NC):
        mid = ((lo + hi) // 2).to(tl.int32)
        fb, nb, nxt, prv = row_pass(logits_row, counts_row, seen_row, vocab_limit, inv_temp, inv_rep, rep, pres,
                                    freq, rep_lim, pen_lim, mask_row, mask_lim, HAS_MASK, n_chunks, M, tk, min_p, mid,
                                    USE_MASS, CHUNK)
        if (fb >= target) & (nb > 0):
            lo = nxt.to(tl.int64)
            f_lo = fb
            n_lo = nb
        else:
            hi = prv.to(tl.int64) + 1
    return lo.to(tl.int32), f_lo, n_lo


@triton.jit
def collect_row(logits_row, counts_row, seen_row, vocab_limit, inv_temp, inv_rep, rep, pres, freq, rep_lim, pen_lim,
                mask_row, mask_lim, HAS_MASK: tl.constexpr,
                n_chunks, M, tk, min_p, lo, cand_u, cand_id, NC: tl.constexpr, CHUNK: tl.constexpr):
    """Gather every kept element with key >= lo (at most NC) into the row's slots; load them back
    as the register set ``(keys, ids)``."""
    tl.debug_barrier()  # the slots' previous contents are already in registers
    n = tk * 0
    for c in range(0, n_chunks):
        offs = c * CHUNK + tl.arange(0, CHUNK)
        x, u, ok = block_scores(logits_row, counts_row, seen_row, offs, vocab_limit, inv_temp, inv_rep, rep,
                                pres, freq, rep_lim, pen_lim, mask_row, mask_lim, HAS_MASK)
        key = order_key(u)
        keep = ok & (key >= tk) & (tl.exp(u - M) >= min_p) & (key >= lo)
        pos = n + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(cand_u + pos, u, mask=keep & (pos < NC))
        tl.store(cand_id + pos, offs, mask=keep & (pos < NC))
        n += tl.sum(keep.to(tl.int32), 0)
    tl.debug_barrier()
    j = tl.arange(0, NC)
    cu = tl.load(cand_u + j, mask=j < n, other=0.0, cache_modifier=".cg")
    cid = tl.load(cand_id + j, mask=j < n, other=0, cache_modifier=".cg")
    return tl.where(j < n, order_key(cu), KEY_NONE), cid


@triton.jit
def row_scan(logits_row, counts_row, seen_row, vocab_limit, inv_temp, inv_rep, rep, pres, freq, rep_lim, pen_lim,
             mask_row, mask_lim, HAS_MASK: tl.constexpr,
             c_begin, c_end, M, tk, min_p, kt, r, CHUNK: tl.constexpr):
    """Inverse CDF over chunks [c_begin, c_end): the first kept id whose running mass exceeds r."""
    run = r * 0.0
    tok = c_begin * 0 - 1
    last = c_begin * 0 - 1
    c = c_begin
    while (c < c_end) & (tok < 0):
        offs = c * CHUNK + tl.arange(0, CHUNK)
        x, u, ok = block_scores(logits_row, counts_row, seen_row, offs, vocab_limit, inv_temp, inv_rep, rep,
                                pres, freq, rep_lim, pen_lim, mask_row, mask_lim, HAS_MASK)
        key = order_key(u)
        wm = tl.exp(u - M)
        kept = ok & (key >= tk) & (wm >= min_p) & (key >= kt)
        wk = tl.where(kept, wm, 0.0)
        last = tl.maximum(last, tl.max(tl.where(kept, offs, -1), 0))
        s = tl.sum(wk, 0)
        if run + s > r:
            cum = run + tl.cumsum(wk, 0)
            tok = tl.min(tl.where(kept & (cum > r), offs, KEY_MAX), 0)
            tok = tl.where(tok == KEY_MAX, last, tok)  # the two sums rounded differently
        run += s
        c += 1
    return tl.where(tok < 0, last, tok)  # r beyond the rescanned total (rounding): last kept id
