"""Launch configurations of the quantized GEMM and their per-GPU selection.

Candidates depend on the shape and the weight's layout, the heuristic favourite first (what an untuned key,
``NINFER_QUANT_TUNE=0`` and a CUDA-graph capture take): ``tl.dot`` tiles (skinny split-K up to 16 tokens, 32..128
tokens above), then, chosen only by measurement, the GEMV (``kind="gemv"``, M <= 8), the int4 tensor-core decode
(``"gemv-mma"``, M <= 32) and the dequantization path (``"dequant"``, M > 16, weights of at most
``DEQUANT_MAX_ELEMENTS``); weights in the fragment layout take the register decode (its candidates:
:mod:`.fragment_configs`) and the tiled GEMM over it (:func:`fragment_layout_candidates`). On the first call for a key ``(format, dtype, M bucket, N, K, epilogue)``
every candidate is timed (decode sizes from CUDA-graph replays, as the engine runs them; never inside a capture)
and the fastest kept in the tuner state (:mod:`ninfer.kernels.tuning`) and on disk (:mod:`ninfer.kernels.tune_cache`,
``NINFER_TUNE_CACHE``). Split-K is chosen here, not by ``triton.autotune``, because it changes the launch (workspace,
epilogue). At least one candidate per path fits in 99 KB of shared memory (RTX 5090).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import cache, lru_cache

import torch
import triton

from ninfer.kernels.dispatch import autotune_configs, split_sum_mode
from ninfer.kernels.quant_gemm.common import FMT_CODES
from ninfer.kernels.quant_gemm.configs import GROUPS, MMA_MAX_M, GemmConfig
from ninfer.kernels.quant_gemm.fragment_configs import fragment_candidates
from ninfer.kernels.quant_gemm.fragments import FRAGMENTS
from ninfer.kernels.quant_gemm.timing import time_candidates
from ninfer.kernels.quant_gemm.weights import ROWS
from ninfer.kernels.tuning import default_tuner

SKINNY_MAX_M = 16
GEMV_MAX_M = 8
FRAG_PREFILL_MAX_M = 512  # the largest prefill key that also times the register decode beside the dequantization
WIDE_FRAG_TOKENS = 64  # tokens per program of the register decode's prefill-size candidate
# Largest weight (rows x K) the dequant path takes: 512 MiB of bf16 workspace. Every dense projection of
# Qwen3.5-27B fits (gate_up 34816 x 5120 = 356 MB); the 248320 x 5120 LM head (2.5 GB) does not.
DEQUANT_MAX_ELEMENTS = 256 << 20
TABLE = "quant_gemm"  # the tuner state's and the disk cache's table of these choices


def kernel_params(fmt: str, cfg: GemmConfig) -> dict[str, int]:
    """Scale geometry of the kernel: columns per scale (group), columns per scale group inside a tile
    (chunk), rows per scale, and whether the tile is dequantized before the dot (scaled) or the
    group scale multiplies the product (small M: fewer multiplies; needs chunk >= 16 for tl.dot)."""
    if fmt not in FMT_CODES:
        raise ValueError(f"no quantized GEMM kernel for format {fmt!r}")
    group = GROUPS.get(fmt, cfg.block_k)
    if cfg.block_k % group and group % cfg.block_k:
        raise ValueError(f"block_k {cfg.block_k} neither divides nor is a multiple of {fmt}'s group size {group}")
    chunk = min(group, cfg.block_k)
    scaled = fmt == "nvfp4" or (fmt != "fp8" and cfg.block_m > SKINNY_MAX_M)
    return {"group": group, "chunk": chunk, "row_block": 128 if fmt == "fp8-b128" else 1, "scaled": scaled}


def _block_k(fmt: str, bytes_per_row: int) -> int:
    """K elements per step so that a weight row contributes ``bytes_per_row`` bytes, valid for the format."""
    bk = bytes_per_row * (2 if fmt.startswith("int4") or fmt == "nvfp4" else 1)
    group = GROUPS.get(fmt, 1)
    if fmt == "fp8-b128":
        return min(bk, 128)
    return max(bk, group)


def _split(tiles: int, k_steps: int, sms: int) -> int:
    """Split-K factor that brings the program count near two per SM, keeping >= 2 K steps per split."""
    if tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, tiles), k_steps // 2, 32))


def candidates(fmt: str, m: int, n_out: int, k: int, sms: int, *, swiglu: bool = False,
               mma: bool = False, layout: str = ROWS) -> list[GemmConfig]:
    """Configs worth trying for this shape, the heuristic favourite first (``swiglu``: the weight has
    ``2 * n_out`` rows; ``mma``: the activations are bf16 / fp16, which the tensor-core decode needs;
    ``layout``: the weight's, see :func:`fragment_candidates` for re-laid weights).

    Skinny tiles give each warp 16 weight rows (BLOCK_N = 16 * warps), so no warp dequantizes rows
    another warp also holds; a K step reads 128 bytes of each weight row.
    """
    if layout == FRAGMENTS:
        return fragment_layout_candidates(fmt, m, n_out, k, sms, swiglu=swiglu)
    if m <= SKINNY_MAX_M:
        bk = _block_k(fmt, 128)
        base = [GemmConfig(16, 64, bk, 1, 4, 4), GemmConfig(16, 32, bk, 1, 2, 4), GemmConfig(16, 128, bk, 1, 8, 3)]
    else:
        bm = 32 if m <= 32 else 64 if m <= 64 else 128
        base = [GemmConfig(bm, 128, 64, 1, 8, 3), GemmConfig(bm, 256, 64, 1, 8, 3), GemmConfig(bm, 128, 64, 1, 4, 4),
                GemmConfig(bm, 64, 64, 1, 4, 4)]
    out: list[GemmConfig] = []
    for cfg in base:
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n_out, cfg.block_n)
        split = _split(tiles, triton.cdiv(k, cfg.block_k), sms)
        # When the tiles cannot fill the GPU, the split-K variant is the favourite.
        out.extend([replace(cfg, split_k=split), cfg] if split > 1 else [cfg])
    if m <= GEMV_MAX_M:  # after the dot favourite: untuned keys keep it, the tuner picks by measurement
        out.extend(gemv_candidates(fmt, m, n_out, k, sms))
    if mma:  # likewise
        out.extend(mma_candidates(fmt, m, n_out, k, sms, swiglu=swiglu))
    if m > SKINNY_MAX_M and n_out * (2 if swiglu else 1) * k <= DEQUANT_MAX_ELEMENTS:  # likewise last
        out.extend(dequant_candidates(fmt, out[0].block_m))
    return out


def fragment_layout_candidates(fmt: str, m: int, n_out: int, k: int, sms: int, *,
                               swiglu: bool = False) -> list[GemmConfig]:
    """Configs for weights in the fragment layout. Decode sizes (M <= 32): every register-decode config, from 17 tokens
    (a C = 8 verification, where 32 rows took 2.2x the 8-row time in run 2026-12-04.5: MMA- and decode-bound) also
    the tiled GEMM's first two (int4 / int8: each code decoded once per 64 tokens). Prefill sizes: the
    dequantization path first, where its workspace takes the weight (the decode re-reads the weight per 32 tokens:
    262 ms of a 1024-token 27B prefill in run 2026-12-03.4; one config: the layout's dequantization kernel has a
    fixed tile), then the decode's favourite up to ``FRAG_PREFILL_MAX_M`` tokens, where it can still win (a few
    token blocks, sharing the codes through L2), and beside it (no SwiGLU) the decode with 64 tokens per program
    (:func:`wide_fragment_candidate`). Larger keys take the dequantization alone: timing 18 decode configs on
    thousands of tokens (seconds each) was most of a cold start's tuning (run 2026-12-03.8: not ready after 750 s).
    The tiled GEMM (:func:`tiled_fragment_candidates`) is not offered beside the dequantization: it lost to it on
    every 27B shape at 128 and 512 tokens (run 2026-12-04.8, ``docs/performance.md``), and timing it would only
    lengthen a cold start. A weight too large for the workspace (the LM head) takes the decode's favourite and the
    tiled GEMM's first two. :func:`graph_fallback` is what CUDA-graph capture runs instead of the dequantization
    path."""
    decode = fragment_candidates(fmt, m, n_out, k, sms, swiglu=swiglu)
    if m <= MMA_MAX_M:
        return decode + (tiled_fragment_candidates(fmt, m, n_out, k, sms, swiglu=swiglu)[:2] if m > 16 else [])
    if n_out * (2 if swiglu else 1) * k > DEQUANT_MAX_ELEMENTS:
        return decode[:1] + tiled_fragment_candidates(fmt, m, n_out, k, sms, swiglu=swiglu)[:2]
    if m > FRAG_PREFILL_MAX_M:
        return dequant_candidates(fmt, 128)[:1]
    return dequant_candidates(fmt, 128)[:1] + decode[:1] + _wide(fmt, m, n_out, k, sms, swiglu)


def tiled_fragment_candidates(fmt: str, m: int, n_out: int, k: int, sms: int, *,
                              swiglu: bool = False) -> list[GemmConfig]:
    """Configs of the tiled GEMM over the fragment layout (:mod:`ninfer.kernels.quant_gemm.fragment_tiled`) for
    prefill sizes: 64 tokens per program up to 64, else 128, ``(rows, warps, stages)`` (SwiGLU keeps four
    accumulators: narrower tiles or more warps), then the exact-codes variant's tiles, each with split-K where its
    tiles cannot fill the GPU (about two programs per SM) and without. Shared memory per stage: the codes (``rows x 32`` bytes int4, twice for
    int8, twice again with SwiGLU) and the activations (``64 x tokens x 2`` bytes); the 64-row tiles stay within
    99 KB (RTX 5090) at any stage count offered."""
    if fmt not in GROUPS or not fmt.startswith(("int4", "int8")) or n_out % 16 or k % 64:
        return []
    tokens = 64 if m <= 64 else 128
    shapes = [(64, 4, 3), (128, 8, 3), (64, 8, 4)] if swiglu else [(128, 8, 3), (64, 4, 3), (128, 4, 4)]
    kinds = ["frag-tiled"] * len(shapes)
    # The exact-codes variant (fragment_tiled.CODES_KIND) holds a second accumulator tile per half: the tiles
    # that compile without spills on sm_90 (perf/ptx_check.py --kinds frag-tiled; with SwiGLU's four halves only
    # 64 rows on 8 warps: 128 rows spill 64-112 bytes, 4 warps 352).
    codes = [(64, 8, 3)] if swiglu else [(128, 8, 3), (64, 4, 3)]
    shapes, kinds = shapes + codes, kinds + ["frag-tiled-codes"] * len(codes)
    out: list[GemmConfig] = []
    for (rows, warps, stages), kind in zip(shapes, kinds):
        cfg = GemmConfig(tokens, rows, 64, 1, warps, stages, kind)
        split = _split(triton.cdiv(m, tokens) * triton.cdiv(n_out, rows), k // 64, sms)
        out.extend([replace(cfg, split_k=split), cfg] if split > 1 else [cfg])
    return out


def _wide(fmt: str, m: int, n_out: int, k: int, sms: int, swiglu: bool) -> list[GemmConfig]:
    """:func:`wide_fragment_candidate` as a list: empty with SwiGLU (it spills) or where it does not fit."""
    wide = None if swiglu else wide_fragment_candidate(fmt, m, n_out, k, sms)
    return [wide] if wide else []


def wide_fragment_candidate(fmt: str, m: int, n_out: int, k: int, sms: int) -> GemmConfig | None:
    """The register decode with 64 tokens per program, for prefill sizes: each program decodes its codes once per
    64 tokens instead of 32, and reads them from L2 half as often. Offline (Triton 3.6, sm_90, 27B down and
    qkvz, ``perf/ptx_check.py --kinds frag --m 128``): 4.64 SASS instructions per int4 weight in the K loop for
    64 tokens against 3.28 for 32 at the same 4 warps and 2 chunks per trip, 29% fewer per weight and token; that
    shape holds the 32 accumulators a lane keeps in 174 registers (int8: 178-184) without spilling, where 4
    chunks per trip spill; SwiGLU's two weight streams spill at any trip length, so gate/up does not get it.
    Split-K for about 8 programs per SM. On the H200 the tuner never chose it (runs 2026-12-04.2 / .3: the
    dequantization path won the eager keys of 128 tokens and up, 32-token configs the rest and every graph key);
    it stays a candidate for other GPUs' tuners. None where the trip does not divide K or the scale groups."""
    warps, unroll = 4, 2
    if k % (64 * unroll) or (64 * unroll) % GROUPS[fmt]:
        return None
    programs = triton.cdiv(n_out // 16, warps) * triton.cdiv(m, WIDE_FRAG_TOKENS)
    split = max(1, min(triton.cdiv(8 * sms, programs), k // (64 * unroll)))
    return GemmConfig(WIDE_FRAG_TOKENS, 16 * warps, 64 * unroll, split, warps, 1, "frag")


def graph_candidates(fmt: str, m: int, n_out: int, k: int, sms: int, *, swiglu: bool = False, mma: bool = False,
                     layout: str = ROWS, dequant: bool = False) -> list[GemmConfig]:
    """Configs a CUDA graph may capture at this shape, :func:`graph_fallback`'s first. The dequantization path
    only with ``dequant`` (its shared workspace already holds the weight, so the capture need not grow it:
    ``dequant.graph_workspace_fits``). For fragment-laid weights at prefill sizes up to ``FRAG_PREFILL_MAX_M``
    tokens, every register-decode config, the 64-token one (:func:`wide_fragment_candidate`) and every tiled GEMM
    (:func:`tiled_fragment_candidates`); above, the decode's favourite and the tiled GEMM's first two. Eager
    calls of these sizes mostly choose the dequantization path, so only the prompt-chunk graphs
    (``ninfer.runtime.chunk_graphs``) meet these keys, and their choice is what a step beside decodes costs."""
    if layout == FRAGMENTS and m > MMA_MAX_M:
        decode = fragment_candidates(fmt, m, n_out, k, sms, swiglu=swiglu)
        tiled = tiled_fragment_candidates(fmt, m, n_out, k, sms, swiglu=swiglu)
        fits = dequant and n_out * (2 if swiglu else 1) * k <= DEQUANT_MAX_ELEMENTS
        whole = dequant_candidates(fmt, 128)[:1] if fits else []
        if m > FRAG_PREFILL_MAX_M:
            return decode[:1] + whole + tiled[:2]
        return decode[:1] + whole + decode[1:] + _wide(fmt, m, n_out, k, sms, swiglu) + tiled
    cands = candidates(fmt, m, n_out, k, sms, swiglu=swiglu, mma=mma, layout=layout)
    return [c for c in cands if c.kind != "dequant"] + ([c for c in cands if c.kind == "dequant"] if dequant else [])


def graph_fallback(fmt: str, m: int, n_out: int, k: int, sms: int, layout: str) -> GemmConfig:
    """The config a CUDA graph captures where the tuner chose the dequantization path (its shared workspace
    may be reallocated after capture): the first other candidate, or for fragment-laid weights the register
    decode's favourite."""
    if layout == FRAGMENTS:
        return fragment_candidates(fmt, m, n_out, k, sms)[0]
    return next(c for c in candidates(fmt, m, n_out, k, sms, layout=layout) if c.kind != "dequant")


def dequant_candidates(fmt: str, block_m: int) -> list[GemmConfig]:
    """Tiles of the whole-weight dequantization (:mod:`ninfer.kernels.quant_gemm.dequant`), 8192 weights
    each: the bf16 writes (2-4x the packed reads) dominate, so rows x columns matters little; one
    stage (no shared-memory pipeline: nothing feeds a ``tl.dot``). ``block_m`` is informational
    (the GEMM is cuBLAS's); block_k 128 and 256 suit every format's group size."""
    if fmt not in FMT_CODES:
        raise ValueError(f"no quantized GEMM kernel for format {fmt!r}")
    return [GemmConfig(block_m, 32, 256, 1, 4, 1, "dequant"), GemmConfig(block_m, 64, 128, 1, 4, 1, "dequant")]


def gemv_split(tiles: int, k_steps: int, sms: int) -> int:
    """Split-K factor that brings the GEMV grid near four programs per SM (latency hiding needs many
    loads in flight per SM), at least one K step per split."""
    if tiles >= 4 * sms:
        return 1
    return max(1, min(triton.cdiv(4 * sms, tiles), k_steps, 64))


def gemv_candidates(fmt: str, m: int, n_out: int, k: int, sms: int) -> list[GemmConfig]:
    """GEMV configs (:mod:`ninfer.kernels.quant_gemm.gemv`) for M <= 8: ``(rows, packed bytes per row per
    K step, warps, stages)``; 1-2 tokens afford wide per-thread slabs (4 x 16-byte loads), 3-8 tokens
    keep the dequantized slab small because it stays live across the token rows. One stage leaves
    the loads in registers; three let Triton prefetch them through shared memory (<= 48 KB)."""
    if fmt not in FMT_CODES:
        raise ValueError(f"no quantized GEMM kernel for format {fmt!r}")
    bm = m_bucket(min(max(m, 1), GEMV_MAX_M))
    if bm <= 2:
        shapes = [(32, 256, 4, 1), (32, 256, 4, 3), (64, 128, 4, 3), (16, 512, 4, 1), (64, 256, 8, 3)]
    else:
        shapes = [(16, 128, 4, 1), (16, 128, 4, 3), (32, 128, 4, 3), (16, 256, 4, 1)]
    four_bit = fmt.startswith("int4") or fmt == "nvfp4"
    out = []
    # Two more with a register prefetch of the next K step (twice the bytes in flight per thread: the
    # pipeliner does not stage loads that feed no tl.dot, so one-stage GEMVs keep one step in flight).
    prefetch = [(32, 256, 4, 1), (64, 128, 4, 1)] if bm <= 2 else [(16, 128, 4, 1)]
    # int4 codes read as 32-bit words (fewer instructions per weight; gemv's module docstring).
    words = ([(32, 256, 4, 1), (64, 128, 4, 1)] if bm <= 2 else [(16, 128, 4, 1)]) if fmt.startswith("int4") else []
    for kind, group in (("gemv", shapes), ("gemv-prefetch", prefetch), ("gemv-w32", words)):
        for bn, row_bytes, warps, stages in group:
            bk = max(row_bytes * (2 if four_bit else 1), GROUPS.get(fmt, 1))
            split = gemv_split(triton.cdiv(n_out, bn) * triton.cdiv(m, bm), triton.cdiv(k, bk), sms)
            out.append(GemmConfig(bm, bn, bk, split, warps, stages, kind))
    return out


def mma_candidates(fmt: str, m: int, n_out: int, k: int, sms: int, *, swiglu: bool = False,
                   max_registers: int | None = None) -> list[GemmConfig]:
    """Tensor-core int4 decode configs (:mod:`ninfer.kernels.quant_gemm.gemv_mma`) for M <= 32: ``(rows, K
    per step, warps, stages)``, 8 tokens per program up to M = 8, 16 up to 16, else 32. One or two warps
    keep Triton on ``mma.sync`` (its cheap operand layout on Hopper too); SwiGLU holds two accumulators, so
    narrower tiles. Each shape comes with split-K for about 4, 8 and 16 programs per SM (small programs:
    several share an SM, and more of them hide more latency). Shared memory: at most 48 KB of staged
    weight bytes, 80.5 KB in all (32 tokens; ``perf/ptx_check.py --kinds gemv-mma --arch 120``).
    The tiles of up to 128 rows come again with a register cap of 128 and of 96 per thread (``maxnreg``: the
    kernel is latency-bound at ~10 resident warps per SM). ``max_registers`` keeps one cap only (0: uncapped)."""
    if not fmt.startswith("int4") or m > MMA_MAX_M:
        return []
    tokens = 8 if m <= 8 else 16 if m <= 16 else 32
    shapes = [(64, 128, 2, 4), (128, 128, 2, 4), (64, 256, 2, 3), (32, 128, 1, 4)] if swiglu else \
        [(128, 128, 2, 4), (64, 128, 2, 4), (128, 256, 2, 3), (256, 128, 2, 3)]
    if tokens == 32:  # 32-token accumulators: wider tiles run out of registers (sm_90 SASS: 255 + spills)
        shapes = [shape for shape in shapes if shape[0] <= 64]
    caps = (0, 128, 96) if max_registers is None else (max_registers,)
    out: list[GemmConfig] = []
    for cap in caps:
        for bn, bk, warps, stages in shapes:
            bk = max(bk, GROUPS[fmt])
            if k % bk or (cap and bn > 128):
                continue
            tiles = triton.cdiv(n_out, bn) * triton.cdiv(m, tokens)
            for per_sm in (4, 8, 16):
                split = 1 if tiles >= per_sm * sms else max(1, min(triton.cdiv(per_sm * sms, tiles), k // bk, 64))
                cfg = GemmConfig(tokens, bn, bk, split, warps, stages, "gemv-mma", cap)
                if cfg not in out:
                    out.append(cfg)
    return out


def m_bucket(m: int) -> int:
    return 1 << max(m - 1, 0).bit_length() if m <= 8192 else 8192


@cache
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def select_config(fmt: str, x: torch.Tensor, n_out: int, k: int, swiglu: bool, has_res: bool,
                  launch: Callable[[GemmConfig], None], layout: str = ROWS, graph: bool = False,
                  dequant_in_graph: bool = False) -> GemmConfig:
    """The config for this call's key, by the process's tuner state (:func:`ninfer.kernels.tuning.default_tuner`,
    table ``"quant_gemm"``): on first sight of the key in a tunable call (CUDA, not capturing, tuning
    enabled) the one stored on disk if still a candidate, else the fastest candidate by benchmark (then
    stored); untunable calls take the heuristic favourite. ``graph``: the call is (or will be) captured into a
    CUDA graph; above the decode sizes, where that rules the dequantization path out (:func:`graph_candidates`),
    the key is tuned apart (marked ``"graph"``) among the others, instead of the eager key's choice being swapped
    for a fallback; ``dequant_in_graph``: the dequantization path's workspace already holds this weight, so a graph
    can capture that path too."""
    m = x.shape[0]
    key = (fmt, x.dtype, m_bucket(m), n_out, k, swiglu, has_res, x.device, layout)
    mma = x.dtype in (torch.bfloat16, torch.float16)
    shape = (fmt, m, n_out, k, sm_count(x.device))
    pick = candidates
    if graph and m > MMA_MAX_M:  # the decode graphs (to 32 tokens) keep their eager keys
        key, pick = (*key, "graph"), graph_candidates
    if layout == FRAGMENTS and split_sum_mode() == "tile":  # other candidates, other timings: tuned apart
        key = (*key, "split-tile")
    dequant = dequant_in_graph if pick is graph_candidates else None

    def cands() -> list[GemmConfig]:
        return autotune_configs(list(_candidate_list(pick, shape, swiglu, mma, layout, dequant)))

    def time_fn(cfgs: list[GemmConfig]) -> dict[GemmConfig, float]:
        return time_candidates(cfgs, launch, graphs=m <= MMA_MAX_M)

    return default_tuner().choose(TABLE, key, cands, time_fn, x.device)


@lru_cache(maxsize=4096)
def _candidate_list(pick: Callable[..., list[GemmConfig]], shape: tuple, swiglu: bool, mma: bool, layout: str,
                    dequant: bool | None) -> tuple[GemmConfig, ...]:
    """``pick``'s candidates for a call, built once per distinct call: the tuner asks for them on every tunable
    call of a key it has not chosen for, which is every call of a key with one candidate (fragment-laid weights
    above ``FRAG_PREFILL_MAX_M`` tokens: the dequantization path), and building them took ~0.25 ms of Python a
    GEMM (a 27B prompt chunk makes ~260 such calls)."""
    extra = {} if dequant is None else {"dequant": dequant}
    return tuple(pick(*shape, swiglu=swiglu, mma=mma, layout=layout, **extra))
