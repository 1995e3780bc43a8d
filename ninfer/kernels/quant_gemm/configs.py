"""The vocabulary of the quantized GEMM's launch configurations: :class:`GemmConfig`, the kinds of the register
decode (:mod:`.fragment_mma`), the formats' scale groups and the token count up to which the decode kernels run.
:mod:`.tune` lists and chooses the candidates, :mod:`.fragment_configs` those of the register decode."""
from __future__ import annotations

from dataclasses import dataclass

GROUPS = {"fp8-b128": 128, "int8-g32": 32, "int8-g64": 64, "int4-g64": 64, "int4-g128": 128, "nvfp4": 16}
MMA_MAX_M = 32  # the tensor-core decode: up to 32 tokens (speculative verification of 8 lanes x 4 tokens)
PAIR_KIND = "frag-pair"  # the register decode with two 16-row tiles per warp (fragment_candidates)
KSPLIT_KIND = "frag-ksplit"  # the register decode with a program's warps on one tile, K split between them
REGISTER_KINDS = ("frag", PAIR_KIND, KSPLIT_KIND)  # the kinds fragment_mma's kernel runs


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # "dot": quant_gemm's tl.dot kernel; "gemv" / "gemv-prefetch" / "gemv-w32" (int4 codes as 32-bit
    # words): gemv's decode GEMV (M <= 8); "gemv-mma": gemv_mma's int4 decode on tensor cores
    # (M <= 32, block_m = tokens per program); "dequant": dequant's whole-weight dequantization
    # (block_n x block_k tiles) + cuBLAS (M > 16); "frag": fragment_mma's register decode of int4 / int8 weights
    # or int8 weights in the fragment layout (block_m tokens per program, block_n = 16 * num_warps rows, block_k / 64
    # chunks per loop trip); PAIR_KIND ("frag-pair"): the same with two tiles per warp, one in each half of the output
    # (32 * num_warps rows); KSPLIT_KIND ("frag-ksplit"): one tile a program, K split between its warps (16 rows);
    # "frag-tiled" / "frag-tiled-codes": fragment_tiled's tl.dot GEMM over the same layout at prefill sizes (block_m
    # tokens x block_n rows per program, block_k = one 64-column chunk per step; weights scaled before the MMA /
    # exact codes into it and the scale on its product)
    kind: str = "dot"
    # "gemv-mma" only: Triton's ``maxnreg`` (registers per thread; fewer let more programs share an SM,
    # at the risk of spills); 0 = the compiler's choice
    max_registers: int = 0
