"""The configs of the expert register decode (:mod:`ninfer.kernels.moe.quant_mma`): which int4 expert GEMMs it serves
and the candidates its tuner times, a program's warps on 16-row tiles of their own or (``NINFER_FRAG_KSPLIT=1``) on
one tile, K split between them."""
from __future__ import annotations

import triton

from ninfer.kernels.dispatch import frag_ksplit
from ninfer.kernels.quant_gemm.configs import GemmConfig

EXPERT_MMA_KIND = "expert-mma"  # GemmConfig.kind of this kernel (block_n = 16 * num_warps, block_k = a trip)
EXPERT_KSPLIT_KIND = "expert-mma-ksplit"  # the same with a program's warps on one tile, K split between them
EXPERT_KINDS = (EXPERT_MMA_KIND, EXPERT_KSPLIT_KIND)
FORMATS = {"int4-g64": 64, "int4-g128": 128}  # the formats it reads, by scale group


def expert_mma_fits(fmt: str, n_out: int, k: int, unroll: int = 2) -> bool:
    """Whether this kernel serves an expert GEMM of ``n_out`` outputs (per SwiGLU half) over ``k`` columns."""
    group = FORMATS.get(fmt)
    return group is not None and n_out % 16 == 0 and k % (unroll * 64) == 0 and unroll * 64 >= group


def expert_mma_candidates(fmt: str, pairs: int, n_out: int, k: int, sms: int) -> list[GemmConfig]:
    """Configs for ``pairs`` routed pairs (each its own expert, as one token's are): 2 and 4 warps, 2 and 4
    chunks a trip, with and without prefetch, each split so the grid comes near eight programs per SM (two
    also near two and one: fewer, longer programs won at 4-8 tokens on the H200, run 2026-12-04.26). No shared
    memory: every config fits any GPU's."""
    out = []
    for warps, unroll, stages, fill in ((4, 2, 2, 8), (4, 4, 1, 8), (2, 2, 2, 8), (2, 4, 1, 8), (4, 2, 1, 8),
                                        (2, 2, 1, 8), (4, 2, 2, 2), (4, 4, 1, 2), (4, 2, 2, 1), (4, 4, 1, 1)):
        if not expert_mma_fits(fmt, n_out, k, unroll):
            continue
        # decode rows: about one program per token's pair (distinct experts); aligned rows: up to one per pair
        programs = triton.cdiv(n_out // 16, warps) * (max(1, min(pairs, 8)) if pairs <= 64 else pairs)
        split = max(1, min(triton.cdiv(fill * sms, programs), k // (64 * unroll), 32))
        cfg = GemmConfig(8, 16 * warps, 64 * unroll, split, warps, stages, EXPERT_MMA_KIND)
        if cfg not in out:
            out.append(cfg)
    return out + expert_ksplit_candidates(fmt, n_out, k) if frag_ksplit() else out


def expert_ksplit_candidates(fmt: str, n_out: int, k: int) -> list[GemmConfig]:
    """Configs with a program's 4 or 8 warps on one 16-row tile, each over an equal share of K, summed through
    shared memory (``NINFER_FRAG_KSPLIT=1``): unsplit, no partial sums through global memory and no arrival
    counter; 2 chunks a trip, with and without the next trip's codes requested during this one."""
    out = []
    kc = k // 64
    for warps in (4, 8):
        if not expert_mma_fits(fmt, n_out, k, 2) or kc % (2 * warps):
            continue
        for stages in (2, 1):
            out.append(GemmConfig(8, 16, 128, 1, warps, stages, EXPERT_KSPLIT_KIND))
    return out
