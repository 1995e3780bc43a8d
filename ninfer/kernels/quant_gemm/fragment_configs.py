"""The register decode's candidate configs (:mod:`.fragment_mma`): its own loads (``num_stages`` 1 / 2), pairs of
tiles per warp, the ``cp.async`` pipeline (``NINFER_FRAG_ASYNC=1``) and K split over a program's warps
(``NINFER_FRAG_KSPLIT=1``), each split for a number of programs per SM; :mod:`.tune` times them beside its other
paths."""
from __future__ import annotations

import triton

from ninfer.kernels.dispatch import frag_async, frag_ksplit, split_sum_mode
from ninfer.kernels.quant_gemm.configs import GROUPS, KSPLIT_KIND, MMA_MAX_M, PAIR_KIND, GemmConfig

ASYNC_MIN_STAGES = 3  # a config's num_stages: 1 codes loaded in the trip, 2 a trip ahead in registers, 3+ cp.async


def fragment_candidates(fmt: str, m: int, n_out: int, k: int, sms: int, *, swiglu: bool = False) -> list[GemmConfig]:
    """Configs of the register decode (:mod:`ninfer.kernels.quant_gemm.fragment_mma`) for int4 and int8 weights in
    the fragment layout, any M (8, 16 or 32 tokens per program; more tokens take more programs, each reading the
    weight again, which the prefill sizes' dequantization path beats): ``(warps, chunks per loop trip)`` with
    split-K for about 8, 4 and 16 programs per SM. The programs are small (no shared memory, 2-4 warps), so
    several share an SM. Each comes with the next loop trip's codes requested during this one (``num_stages=2``)
    and without. The favourite (the H200's best at 1 and 8 tokens; 8 warps never won, so are not offered): 4 warps,
    2 chunks per trip, 8 programs per SM, prefetching.

    For 9-32 tokens also narrower programs (8 or 16 tokens; speculative rounds' verification, short prompt chunks):
    a tile's token blocks run side by side, all but the first reading its codes from L2, in programs of the decode
    sizes' register count, where 32-token programs take 100-255 registers (``perf/ptx_check.py --kinds frag --m
    32``): 2-3 programs an SM.

    Without SwiGLU also pairs of tiles per warp (``kind="frag-pair"``: rows of both halves of the output): each
    activation load then feeds the MMAs of 32 rows, as SwiGLU's gate and up tiles share theirs. A warp's
    activations come from L1 once per tile and token block: at 32 tokens that is as many bytes through L1 as
    the codes take from memory.

    With ``NINFER_SPLIT_SUM=tile`` (the split-K sum in one load whatever the split count, read when a call shape's
    list is first built) also 32 programs per SM (splits of one or two loop trips) and, up to 8 tokens, trips of 8
    chunks (twice the codes in flight per lane, without prefetching).

    With ``NINFER_FRAG_ASYNC=1`` also the configs of :func:`fragment_async_candidates`."""
    tokens = 8 if m <= 8 else 16 if m <= 16 else 32
    tile_sum = split_sum_mode() == "tile"
    per_sms = (8, 4, 16, 32) if tile_sum else (8, 4, 16)
    shapes = [(tokens, warps, unroll, per_sm, stages, "frag") for stages in (2, 1)
              for warps, unroll in ((4, 2), (4, 4), (2, 4)) for per_sm in per_sms]
    if tile_sum and m <= 8:
        shapes += [(tokens, warps, 8, per_sm, 1, "frag") for warps in (2, 4) for per_sm in (8, 16)]
    if m <= MMA_MAX_M:
        shapes += [(narrow, warps, unroll, 8, 2, "frag") for narrow in (16, 8) if narrow < tokens
                   for warps, unroll in ((4, 2), (2, 4))]
    if not swiglu and n_out % 32 == 0:
        shapes += [(tokens, warps, unroll, per_sm, 2, PAIR_KIND) for warps, unroll in ((4, 2), (2, 4))
                   for per_sm in (8, 4)]
    out = _fragment_configs(fmt, m, n_out, k, sms, shapes)
    if frag_async():
        out += fragment_async_candidates(fmt, m, n_out, k, sms)
    if frag_ksplit():
        out += fragment_ksplit_candidates(fmt, m, n_out, k)
    return out


def is_variant(cfg: GemmConfig) -> bool:
    """Whether ``cfg`` is one of the register decode's switched-in variants (``cp.async`` or K split), not its own."""
    return cfg.num_stages >= ASYNC_MIN_STAGES or cfg.kind == KSPLIT_KIND


def fragment_splits(kc: int, unroll: int, split: int) -> tuple[int, int]:
    """``(chunks per split, splits)`` for ``split`` requested: whole loop trips per split, no empty split."""
    trips = kc // unroll
    per = -(-trips // max(1, min(split, trips))) * unroll
    return per, -(-kc // per)


def fragment_ksplit_candidates(fmt: str, m: int, n_out: int, k: int) -> list[GemmConfig]:
    """Register decode configs whose program holds one 16-row tile with 4 or 8 warps, each over an equal share of
    K (``kind="frag-ksplit"``), summed through shared memory: K split over a program's warps instead of over
    programs, whose partial sums take a round trip through global memory and an arrival counter. One program per
    tile (and split: 1 or 2, where K falls into whole, equal shares), 2 chunks a trip, the next trip's codes
    requested during this one or (3 stages) copied ahead by ``cp.async``."""
    tokens = 8 if m <= 8 else 16 if m <= 16 else 32
    kc, out = k // 64, []
    for warps in (4, 8):
        for split in (1, 2):
            per, _ = fragment_splits(kc, 2, split)
            if k % 128 or 128 % GROUPS[fmt] or kc % per or per % (2 * warps):
                continue
            for stages in (2, 3):
                cfg = GemmConfig(tokens, 16, 128, split, warps, stages, KSPLIT_KIND)
                if cfg not in out:
                    out.append(cfg)
    return out


ASYNC_STAGES = (3, 5)


def fragment_async_candidates(fmt: str, m: int, n_out: int, k: int, sms: int) -> list[GemmConfig]:
    """Register decode configs whose codes come through ``cp.async`` copies into shared memory ``num_stages - 1``
    loop trips ahead (``num_stages`` in ``ASYNC_STAGES``), 8 and 16 programs per SM (the codes no longer hold
    registers while in flight, so more programs may fit). Shared memory per program: ``(num_stages - 1) x`` a
    trip's codes, at most 72 KB (int8 SwiGLU at 5 stages, `perf/ptx_check.py`): inside the RTX 5090's
    99 KB."""
    tokens = 8 if m <= 8 else 16 if m <= 16 else 32
    shapes = [(tokens, warps, unroll, per_sm, stages, "frag") for stages in ASYNC_STAGES
              for warps, unroll in ((4, 2), (2, 4)) for per_sm in (8, 16)]
    return _fragment_configs(fmt, m, n_out, k, sms, shapes)


def _fragment_configs(fmt: str, m: int, n_out: int, k: int, sms: int,
                      shapes: list[tuple[int, int, int, int, int, str]]) -> list[GemmConfig]:
    """``(tokens, warps, chunks per trip, programs per SM, stages, kind)`` -> the configs that fit K and its scale
    groups, split-K sized for that many programs per SM."""
    out: list[GemmConfig] = []
    for block_m, warps, unroll, per_sm, stages, kind in shapes:
        bk = 64 * unroll
        if k % bk or bk % GROUPS[fmt]:
            continue
        rows = 32 if kind == PAIR_KIND else 16
        programs = triton.cdiv(n_out // rows, warps) * triton.cdiv(m, block_m)
        split = max(1, min(triton.cdiv(per_sm * sms, programs), k // bk))
        cfg = GemmConfig(block_m, rows * warps, bk, split, warps, stages, kind)
        if cfg not in out:
            out.append(cfg)
    return out
