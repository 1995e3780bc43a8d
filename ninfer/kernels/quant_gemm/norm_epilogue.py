"""The RMSNorm that follows a decode GEMM, in the GEMM's own launch.

A decoder layer's output projections (attention ``o_proj``, DeltaNet ``out_proj``, the MLP's ``down_proj``) are
each followed by a zero-centred RMSNorm over the new residual stream (``h = y + residual``): at decode a launch of
its own, and a gap before it, twice per layer. The norm needs whole rows of ``h`` while a GEMM program owns 16
outputs of it, so the programs count themselves in at one arrival counter (:mod:`ninfer.kernels.counters`) after
writing their part of ``h``; the last to arrive sees all of it and normalizes every row. That is serial work for
one program, cheap only for a few rows (the dispatcher takes this path up to ``MAX_ROWS`` tokens), and it reads
``h`` back from L2, which the other programs wrote during this launch. The sum over a row runs in a fixed order:
results do not depend on which program arrives last.

Measured: applied to every 27B output projection (run 2026-12-05.7, a loop over 1024-column steps, twice per row)
it cost more than the launches it saved (6.93 against 6.61 ms a step at batch 1, 10.64 against 8.11 at C = 8). The
last program now loads a row's chunks together (one round trip to L2 per row) and applies it up to ``MAX_ROWS``
tokens only; holding the row costs registers in the whole kernel (168 against 52 for the 27B down projection's
favourite config, sm_90, Triton 3.6). The 27B's norms are now deferred to the GEMMs that read them
(:mod:`.deferred_norm`); this path is the default (``NINFER_NORM_IN_GEMM``) where the readers decline deferred rows,
the 35B-A3B's MoE blocks: 2.52 against 2.56 ms a step at batch 1 on an H100 (run 2026-12-06.8).
"""
from __future__ import annotations

import triton
import triton.language as tl

# Tokens up to which a GEMM applies the norm itself: the last program's serial pass grows with them (estimated at one
# round trip to L2 a row, not yet measured; the norm's own launch and the gap before it measured ~2.5 µs).
MAX_ROWS = 2
NORM_COLS = 1024  # columns per chunk of a row in the last program's pass
NORM_BLOCK = tl.constexpr(NORM_COLS)


@triton.jit
def norm_when_all_arrived(cnt_ptr, h_ptr, stride_hm, w_ptr, normed_ptr, stride_nm, M, N, eps,
                          CHUNKS: tl.constexpr):
    """Counts this program in at the counter after the output tiles' (grid axes 0 and 2 give the tiles, as in
    :func:`~ninfer.kernels.quant_gemm.gemv_steps.last_split_arrived`), after its stores of ``h`` (release). The last
    program to arrive (acquire) writes ``normed[m] = h[m] * rsqrt(mean(h[m]^2) + eps) * (1 + w)`` for rows ``m <
    M`` of ``h [M, N]`` (``N <= CHUNKS * NORM_BLOCK``) and resets the counter. Call it once per program that finished
    output tiles. A row's chunks are loaded together, so each row costs one round trip to L2 (run 2026-12-05.7
    looped over the chunks, twice per row: ~2.7 µs a row)."""
    slot = tl.num_programs(0) * tl.num_programs(2)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel")
    if arrived == slot - 1:
        tl.debug_barrier()
        cols = tl.arange(0, NORM_BLOCK)
        scales = ()
        for c in tl.static_range(CHUNKS):
            cc = c * NORM_BLOCK + cols
            scales = scales + (1.0 + tl.load(w_ptr + cc, mask=cc < N, other=0.0).to(tl.float32),)
        for m in range(M):
            row = h_ptr + m * stride_hm  # at most MAX_ROWS rows: int32 offsets
            hs = ()
            for c in tl.static_range(CHUNKS):
                cc = c * NORM_BLOCK + cols
                hs = hs + (tl.load(row + cc, mask=cc < N, other=0.0, cache_modifier=".cg").to(tl.float32),)
            squares = hs[0] * hs[0]
            for c in tl.static_range(1, CHUNKS):
                squares += hs[c] * hs[c]
            rstd = tl.rsqrt(tl.sum(squares, axis=0) / N + eps)  # as the norm kernel (norms.py)
            out = normed_ptr + m * stride_nm
            for c in tl.static_range(CHUNKS):
                cc = c * NORM_BLOCK + cols
                tl.store(out + cc, (hs[c] * rstd * scales[c]).to(normed_ptr.dtype.element_ty), mask=cc < N)
        tl.store(cnt_ptr + slot, 0)
