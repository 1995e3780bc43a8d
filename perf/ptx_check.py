"""Compile the quantized GEMM kernels for a GPU target without a GPU, and show how they load memory.

    python perf/ptx_check.py [--arch 90] [--formats int4-g64,nvfp4] [--kinds gemv,dot,dequant,moe-gemv]
    python perf/ptx_check.py --kinds attention-prefill [--kv bf16,fp8,int8]
    python perf/ptx_check.py --kinds gemv-mma --formats int4-g64,int4-g128 [--m 1|16|32] [--arch 120]
    python perf/ptx_check.py --kinds frag --formats int4-g128 [--m 1|16|32] [--arch 120]
    python perf/ptx_check.py --kinds frag-tiled --formats int4-g64,int8-g64 --m 128 [--arch 120]
    python perf/ptx_check.py --kinds expert-mma --formats int4-g64 [--arch 120]

For each kernel, format and candidate config: shared memory and the global loads of the PTX
(``ld.global.v4.b32`` = 16-byte vectors; ``ld.global.b8`` = one byte each), and the async copies of
pipelined tiles. A decode kernel whose weight loads are bytes cannot approach the copy bandwidth;
this catches that on a CPU (it found the GEMV kernel's byte loads: an unspecialised split length
hid the rows' alignment). The prefill dequant kernel (``--kinds dequant``, whatever ``--m``) also
shows its global stores (``st.global.v4.b32`` = 16-byte vectors of the bf16 workspace). The expert
GEMV (``--kinds moe-gemv``) compiles its candidates for the 35B-A3B experts (gate/up with SwiGLU:
N = 512, K = 2048; down: N = 2048, K = 512; 8 and 64 routed pairs), ignoring ``--m/--n/--k``. Pointers
and strides are declared 16-byte divisible, as Triton specialises them at run time for the model's
shapes. ``--kinds attention-prefill`` compiles the paged prefill attention kernel's configs at the
27B geometry (24 : 4 heads, head dim 256, page 64, bf16 queries), unsplit and split-KV, for each
``--kv`` format. ``--kinds frag`` compiles the register decode of fragment-laid int4 / int8-g64 / nvfp4 weights
(``fragment_mma``) for each of its candidates at the 27B gate/up (SwiGLU), down and qkvz shapes: registers,
stack (spills) and SASS instructions per weight in its K loop (with the fused split-K reduction that
``NINFER_SPLIT_SUM`` selects). Needs a Triton with the NVIDIA backend
(compiling needs ptxas, not a driver).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ninfer.kernels.attention import prefill as attention_prefill  # noqa: E402
from ninfer.kernels.moe import quant_gemv as moe_quant_gemv  # noqa: E402
from ninfer.kernels.moe import mma_configs as moe_mma_configs  # noqa: E402
from ninfer.kernels.moe import quant_mma as moe_quant_mma  # noqa: E402
from ninfer.kernels.dispatch import split_sum_across, split_sum_mode  # noqa: E402
from ninfer.kernels.quant_gemm.fragment_ptx import mma_asm, row_major_decode_asm  # noqa: E402
from ninfer.kernels.quant_gemm import dequant as quant_dequant  # noqa: E402
from ninfer.kernels.quant_gemm import deferred_norm  # noqa: E402
from ninfer.kernels.quant_gemm import configs as quant_configs  # noqa: E402
from ninfer.kernels.quant_gemm import fragment_configs  # noqa: E402
from ninfer.kernels.quant_gemm import fragment_mma  # noqa: E402
from ninfer.kernels.quant_gemm import fragment_tiled  # noqa: E402
from ninfer.kernels.quant_gemm import gemv as quant_gemv  # noqa: E402
from ninfer.kernels.quant_gemm import gemv_mma as quant_gemv_mma  # noqa: E402
from ninfer.kernels.quant_gemm.gemm import quant_gemm_kernel  # noqa: E402
from sass_tools import code_loads_at, describe, loop_instructions, loop_sass, resources  # noqa: E402

from ninfer.kernels.quant_gemm.tune import (  # noqa: E402
    FMT_CODES,
    MMA_MAX_M,
    candidates,
    dequant_candidates,
    fragment_candidates,
    kernel_params,
    mma_candidates,
    tiled_fragment_candidates,
    wide_fragment_candidate,
)

TYPES = {"int4-g64": ("*u8", "*fp16"), "int4-g128": ("*u8", "*fp16"), "int8-g32": ("*i8", "*fp16"),
         "int8-g64": ("*i8", "*fp16"), "nvfp4": ("*u8", "*u8"), "fp8": ("*u8", "*fp32"), "fp8-b128": ("*u8", "*fp32")}
ALIGNED = ("x_ptr", "q_ptr", "s_ptr", "rs_ptr", "res_ptr", "out_ptr", "ws_ptr", "N_OUT", "K",
           "stride_xm", "stride_qn", "stride_sn", "stride_rm", "stride_om")


def compile_kernel(fn, split_arg: str, fmt: str, consts: dict, warps: int, stages: int, arch: int):
    q_type, s_type = TYPES[fmt]
    if consts.get("WORDS"):  # int4 codes read as 32-bit words
        q_type = "*i32"
    row_scale = fmt in ("fp8", "nvfp4")
    sig = {"x_ptr": "*bf16", "q_ptr": q_type, "s_ptr": s_type, "rs_ptr": "*fp32" if row_scale else s_type,
           "res_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "M": "i32", "N_OUT": "i32", "K": "i32",
           split_arg: "i32", **{s: "i32" for s in ("stride_xm", "stride_qn", "stride_sn", "stride_rm", "stride_om")}}
    sig.update(dict.fromkeys(consts, "constexpr"))
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "num_stages": stages})


def compile_dequant(fmt: str, cfg, arch: int):
    """quant_dequant's kernel, bf16 workspace, K a multiple of BLOCK_K."""
    q_type, s_type = TYPES[fmt]
    row_scale = fmt in ("fp8", "nvfp4")
    kp = kernel_params(fmt, cfg)
    sig = {"q_ptr": q_type, "s_ptr": s_type, "rs_ptr": "*fp32" if row_scale else s_type, "w_ptr": "*bf16",
           "N": "i32", "K": "i32", "stride_qn": "i32", "stride_sn": "i32", "stride_wn": "i32"}
    consts = dict(FMT=FMT_CODES[fmt], GROUP=kp["group"], CHUNK=kp["chunk"], ROW_BLOCK=kp["row_block"],
                  ROW_SCALE=row_scale, EVEN_K=True, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    sig.update(dict.fromkeys(consts, "constexpr"))
    names = list(sig)
    aligned = ("q_ptr", "s_ptr", "rs_ptr", "w_ptr", "K", "stride_qn", "stride_sn", "stride_wn")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(quant_dequant._dequant_kernel, sig, consts, attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def compile_moe_gemv(fmt: str, cfg, swiglu: bool, arch: int, early: bool = False):
    """moe_quant_gemv's kernel, bf16 activations, K a multiple of BLOCK_K (the 35B shapes); ``early``: the down
    projection's early start (its ids read and its lines asked of the L2 before the PDL wait)."""
    q_type, s_type = TYPES[fmt]
    words = cfg.kind == "gemv-w32"
    if words:  # int4 codes read as 32-bit words
        q_type = "*i32"
    row_scale = fmt in ("fp8", "nvfp4")
    kp = kernel_params(fmt, cfg)
    strides = ("stride_xm", "stride_qe", "stride_qn", "stride_se", "stride_sn", "stride_re", "stride_om")
    types = {"x_ptr": "*bf16", "q_ptr": q_type, "s_ptr": s_type, "rs_ptr": "*fp32" if row_scale else s_type,
             "out_ptr": "*bf16", "rw_ptr": "*bf16", "ws_ptr": "*fp32", "ids_ptr": "*i64", "stats_ptr": "*fp32",
             "eps": "fp32"}
    consts = dict(ROW_NORM=False, PARTS_BLOCK=1, FMT=FMT_CODES[fmt], GROUP=kp["group"], ROW_BLOCK=kp["row_block"],
                  ROW_SCALE=row_scale, SWIGLU=swiglu, ROUTE_WEIGHT=not swiglu, SPLIT=cfg.split_k > 1, EVEN_K=True,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PAIRS_BLOCK=64,
                  PREFETCH=cfg.kind == "gemv-prefetch", WORDS=words, PDL_WAIT=early, PDL_TRIGGER=True, EARLY=early,
                  Q_LINES=4 if early else 0, S_LINES=2 if early else 0)
    fn = moe_quant_gemv._moe_gemv_kernel
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}  # the kernel's order
    names = list(sig)
    aligned = ("x_ptr", "q_ptr", "s_ptr", "rs_ptr", "out_ptr", "rw_ptr", "ws_ptr", "ids_ptr", "N_OUT", "K", *strides)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def moe_gemv(fmt: str, arch: int, sms: int) -> None:
    for name, n_out, k, swiglu in (("gate_up", 512, 2048, True), ("down", 2048, 512, False)):
        for pairs in (8, 64):
            for cfg in moe_quant_gemv.expert_gemv_candidates(fmt, pairs, n_out, k, sms):
                head = (f"{fmt:9s} moe-{name:7s} {cfg.kind:13s} pairs={pairs:<2d} m={cfg.block_m} n={cfg.block_n:<3d} "
                        f"k={cfg.block_k:<4d} split={cfg.split_k:<2d} w={cfg.num_warps} s={cfg.num_stages}")
                for early in (False, True) if not swiglu else (False,):  # the down projection's early start too
                    line = head + (" early" if early else "")
                    try:
                        print(f"{line} | {describe(compile_moe_gemv(fmt, cfg, swiglu, arch, early))}", flush=True)
                    except Exception as err:  # noqa: BLE001
                        print(f"{line}: FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)


def compile_expert_mma(fmt: str, cfg, swiglu: bool, arch: int, aligned: bool = False, row_norm_parts: int = 0):
    """moe_quant_mma's register decode of int4 expert stacks (bf16 activations), split-K fused where split;
    ``aligned``: over rows aligned in blocks of 16 (a verification of several lanes); ``row_norm_parts``: a reader
    of deferred rows (``quant_gemm.deferred_norm``) with that many shares, one token."""
    strides = ("stride_xm", "stride_qe", "stride_qn", "stride_se", "stride_sn", "stride_om")
    sig = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp16", "rw_ptr": "*bf16", "out_ptr": "*bf16",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", "ids_ptr": "*i64", "sorted_ptr": "*i32", "block_experts_ptr": "*i32",
           "stats_ptr": "*fp32", **dict.fromkeys(("NK", "N_OUT", "a_div", "chunks_per_split", "KC", *strides), "i32"),
           "M_TOK": "i32", "n_parts": "i32", "eps": "fp32"}
    split = cfg.split_k > 1
    tokens = 1
    consts = dict(ROW_NORM=row_norm_parts > 0, TOKENS=tokens,
                  PARTS_BLOCK=deferred_norm.parts_block(row_norm_parts, tokens) if row_norm_parts else 1,
                  CPG=int(fmt.split("-g")[1]) // 64, SWIGLU=swiglu, SPLIT=split, FUSED_REDUCE=split,
                  SUM_ACROSS=split and split_sum_across(),
                  WARPS=cfg.num_warps, UNROLL=cfg.block_k // 64, PREFETCH=cfg.num_stages > 1,
                  KSPLIT=cfg.kind == moe_mma_configs.EXPERT_KSPLIT_KIND, PAIRS_BLOCK=64,
                  ALIGNED=aligned, DECODE_ASM=row_major_decode_asm("bf16"), DECODE_OPERANDS="=r," * 16 + "r,r,r,r",
                  MMA_ASM=mma_asm("bf16"), ASM=True, PDL_WAIT=False, PDL_TRIGGER=arch >= 90)
    sig.update(dict.fromkeys(consts, "constexpr"))
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr") or n in ("N_OUT", "KC", *strides)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(moe_quant_mma._expert_mma_kernel, sig, consts, attrs),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": cfg.num_warps, "num_stages": 1})


def expert_mma(fmt: str, arch: int, sms: int) -> None:
    for name, n_out, k, swiglu in (("gate_up", 512, 2048, True), ("down", 2048, 512, False)):
        for pairs, aligned in ((8, False), (256, True)):  # batch 1; eight lanes verifying four tokens
            for cfg in moe_mma_configs.expert_mma_candidates(fmt, pairs, n_out, k, sms):
                head = (f"{fmt:9s} expert-mma-{name:7s}{' aligned' if aligned else ''} warps={cfg.num_warps} "
                        f"chunks/trip={cfg.block_k // 64} split={cfg.split_k:<3d} stages={cfg.num_stages}")
                register_decode_line(head, lambda: compile_expert_mma(fmt, cfg, swiglu, arch, aligned),
                                     16 * cfg.block_k * (2 if swiglu else 1) / 32, arch)


def compile_mma(fmt: str, cfg, swiglu: bool, arch: int):
    """quant_gemv_mma's tensor-core int4 decode kernel, bf16 activations, K a multiple of BLOCK_K."""
    strides = ("stride_xm", "stride_qn", "stride_sn", "stride_rm", "stride_om")
    sig = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp16", "res_ptr": "*bf16", "out_ptr": "*bf16",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N_OUT": "i32", "K": "i32", "k_per_split": "i32",
           **dict.fromkeys(strides, "i32")}
    split = cfg.split_k > 1
    consts = dict(GROUP=kernel_params(fmt, cfg)["group"], SWIGLU=swiglu, HAS_RES=not swiglu, SPLIT=split,
                  FUSED_REDUCE=split, TOKENS=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ASM=True)
    sig.update(dict.fromkeys(consts, "constexpr"))
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr") or n in ("N_OUT", "K", *strides)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(quant_gemv_mma._quant_gemv_mma_kernel, sig, consts, attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def mma(fmt: str, m: int, arch: int, sms: int) -> None:
    """Every tensor-core decode candidate at the 27B gate/up (SwiGLU) and down shapes: shared memory,
    registers, and SASS instructions per weight in the K loop (the decode's ALU cost)."""
    for name, n_out, k, swiglu in (("gate_up", 17408, 5120, True), ("down", 5120, 17408, False)):
        for cfg in mma_candidates(fmt, m, n_out, k, sms, swiglu=swiglu):
            head = (f"{fmt:9s} mma-{name:7s} tokens={cfg.block_m:<2d} n={cfg.block_n:<3d} k={cfg.block_k:<4d} "
                    f"split={cfg.split_k:<2d} w={cfg.num_warps} s={cfg.num_stages}")
            try:
                kernel = compile_mma(fmt, cfg, swiglu, arch)
                per_thread = cfg.block_n * cfg.block_k * (2 if swiglu else 1) / (32 * cfg.num_warps)
                per_weight = loop_instructions(kernel) / per_thread
                print(f"{head} | {resources(kernel, arch)} | shared {kernel.metadata.shared / 1024:5.1f} KB | "
                      f"{per_weight:.2f} SASS instructions per weight in the K loop", flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"{head}: FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)


def compile_frag(cfg, group: int, swiglu: bool, arch: int, bits: int = 4, fp4: bool = False, norm_chunks: int = 0,
                 defer: bool = False, row_norm_parts: int = 0):
    """fragment_mma's kernel (bf16 activations, PTX decode) for one config, split-K with the fused reduction; with
    ``norm_chunks`` the norm after it in its last program (rows of up to ``norm_chunks`` x 1024 columns); ``defer``:
    the norm left to the readers (``quant_gemm.deferred_norm``), ``row_norm_parts``: a reader of such rows."""
    stages = cfg.num_stages if cfg.num_stages >= fragment_configs.ASYNC_MIN_STAGES else 1  # cp.async: int32 codes
    code_type = "*i32" if stages > 1 else "*u8" if bits == 4 else "*i8"
    sig = {"x_ptr": "*bf16", "q_ptr": code_type, "s_ptr": "*i32", "rs_ptr": "*fp32",
           "res_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "nw_ptr": "*bf16",
           "normed_ptr": "*bf16", "stats_in_ptr": "*fp32", "stats_out_ptr": "*fp32",
           **dict.fromkeys(("M", "N_OUT", "KC", "NG", "chunks_per_split", "stride_xm", "stride_rm", "stride_om",
                            "stride_nm"), "i32"), "eps": "fp32", "parts_in": "i32", "eps_in": "fp32"}
    split = cfg.split_k > 1
    pair = cfg.kind == quant_configs.PAIR_KIND
    consts = dict(CPG=max(1, group // 64), NORM=norm_chunks > 0, NORM_CHUNKS=max(1, norm_chunks), DEFER=defer,
                  ROW_NORM=row_norm_parts > 0,
                  PARTS_BLOCK=deferred_norm.parts_block(row_norm_parts, cfg.block_m) if row_norm_parts else 1,
                  SWIGLU=swiglu, PAIR=pair, HAS_RES=defer, SPLIT=split, FUSED_REDUCE=split,
                  SUM_ACROSS=split and split_sum_mode() == "across", SUM_TILE=split and split_sum_mode() == "tile",
                  S_BLOCK=min(triton.next_power_of_2(cfg.split_k),
                              max(1, 16 // ((cfg.block_m // 8) * (2 if swiglu or pair else 1))))
                  if split and split_sum_mode() == "tile" else 1,
                  NB=cfg.block_m // 8, WARPS=cfg.num_warps, UNROLL=cfg.block_k // 64, PREFETCH=cfg.num_stages == 2,
                  STAGES=stages, KSPLIT=cfg.kind == quant_configs.KSPLIT_KIND,
                  TOKENS_FIRST=False, PDL=arch >= 90, ASM=True, BITS=bits, FP4=fp4,
                  **fragment_mma.asm_constants(torch.bfloat16, bits, fp4))
    sig.update(dict.fromkeys(consts, "constexpr"))
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr") or n in ("N_OUT", "KC", "stride_xm", "stride_rm", "stride_om")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    options = {"num_warps": cfg.num_warps, "num_stages": 1}
    if cfg.max_registers:
        options["maxnreg"] = cfg.max_registers
    return triton.compile(ASTSource(fragment_mma._fragment_mma_kernel, sig, consts, attrs),
                          target=GPUTarget("cuda", arch, 32), options=options)


def register_decode_line(head: str, compile_fn, weights_per_thread: float, arch: int) -> None:
    """One config of a register decode: registers and stack, SASS instructions per weight in its K loop (a trip's
    ``weights_per_thread``), where its code loads sit; or why it failed to compile."""
    try:
        kernel = compile_fn()
        sass = loop_sass(kernel)
        print(f"{head} | {resources(kernel, arch)} | {len(sass) / weights_per_thread:.2f} SASS instructions per "
              f"weight in the K loop, {code_loads_at(sass)}", flush=True)
    except Exception as err:  # noqa: BLE001
        print(f"{head}: FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)


def frag(fmt: str, m: int, arch: int, sms: int) -> None:
    group = 16 if fmt == "nvfp4" else int(fmt.split("-g")[1])
    bits = 8 if fmt.startswith("int8") else 4
    shapes = (("gate_up", 17408, 5120, True), ("down", 5120, 17408, False), ("qkvz", 16384, 5120, False))
    if bits == 8:  # the LM head and the int8 recipes' attention / DeltaNet projections
        shapes = (("lm_head", 248320, 5120, False), ("qkvz", 16384, 5120, False), ("o_proj", 5120, 6144, False))
    for name, n_out, k, swiglu in shapes:
        wide = wide_fragment_candidate(fmt, m, n_out, k, sms) if m > MMA_MAX_M and not swiglu else None
        for cfg in fragment_candidates(fmt, m, n_out, k, sms, swiglu=swiglu) + ([wide] if wide else []):
            head = (f"{fmt:9s} {cfg.kind}-{name:7s} tokens={cfg.block_m:<2d} warps={cfg.num_warps} "
                    f"chunks/trip={cfg.block_k // 64} split={cfg.split_k:<3d} stages={cfg.num_stages}")
            streams = 2 if swiglu or cfg.kind == quant_configs.PAIR_KIND else 1
            register_decode_line(head, lambda: compile_frag(cfg, group, swiglu, arch, bits, fmt == "nvfp4"),
                                 16 * cfg.block_k * streams / 32, arch)


def compile_frag_tiled(cfg, group: int, swiglu: bool, arch: int, bits: int = 4):
    """fragment_tiled's kernel (bf16 activations) for one config."""
    sig = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp16", "res_ptr": "*bf16", "out_ptr": "*bf16",
           "ws_ptr": "*fp32", **dict.fromkeys(("M", "N_OUT", "KC", "NG", "chunks_per_split", "stride_xm", "stride_rm",
                                                "stride_om"), "i32")}
    consts = dict(GROUP=group, BITS=bits, SWIGLU=swiglu, HAS_RES=False, SPLIT=cfg.split_k > 1, IEEE=False,
                  CODES=cfg.kind == fragment_tiled.CODES_KIND, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=8)
    sig.update(dict.fromkeys(consts, "constexpr"))
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr") or n in ("N_OUT", "KC", "stride_xm", "stride_rm", "stride_om")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(fragment_tiled._fragment_tiled_kernel, sig, consts, attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def frag_tiled(fmt: str, m: int, arch: int, sms: int) -> None:
    group = int(fmt.split("-g")[1])
    bits = 8 if fmt.startswith("int8") else 4
    shapes = (("gate_up", 17408, 5120, True), ("down", 5120, 17408, False), ("qkvz", 16384, 5120, False))
    for name, n_out, k, swiglu in shapes:
        for cfg in tiled_fragment_candidates(fmt, m, n_out, k, sms, swiglu=swiglu):
            head = (f"{fmt:9s} {cfg.kind}-{name:7s} tokens={cfg.block_m:<3d} rows={cfg.block_n:<3d} "
                    f"warps={cfg.num_warps} stages={cfg.num_stages} split={cfg.split_k:<3d}")
            try:
                kernel = compile_frag_tiled(cfg, group, swiglu, arch, bits)
                print(f"{head} | {resources(kernel, arch)} | shared {kernel.metadata.shared / 1024:5.1f} KB", flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"{head}: FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)


def compile_prefill_attention(kv: str, split: bool, cfg, arch: int):
    """attention_prefill's kernel at the 27B geometry; ``kv`` in bf16 / fp8 / int8 (scales: 1 / 4 groups)."""
    codes, ng = {"bf16": ("*bf16", 1), "fp8": ("*u8", 1), "int8": ("*i8", 4)}[kv]
    scales = codes if kv == "bf16" else "*fp32"  # placeholders (K/V themselves) when unquantised
    strides = ("stride_qn", "stride_qh", "stride_on", "stride_oh", "stride_gn", "stride_gh", "stride_kp",
               "stride_ks", "stride_kh", "stride_sp", "stride_ss", "stride_sh", "stride_bt")
    part = "*fp32" if split else "*bf16"  # without splits the workspaces are the output, never touched
    sig = {"q_ptr": "*bf16", "k_ptr": codes, "v_ptr": codes, "ks_ptr": scales, "vs_ptr": scales, "bt_ptr": "*i32",
           "o_ptr": "*bf16", "g_ptr": "*bf16", **dict.fromkeys(strides, "i32"), "cu_ptr": "*i32", "ctx_ptr": "*i32",
           "qk_scale": "fp32", "tune_len": "i32", "part_o_ptr": part, "part_lse_ptr": part,
           "num_splits": "i32" if split else "constexpr"}
    consts = dict(GROUP=6, PAGE_SIZE=64, HEAD_DIM=256, QUANT={"bf16": 0, "fp8": 1, "int8": 2}[kv], NG=ng,
                  HAS_GATE=not split, DOT_PREC="tf32", SPLIT=split, **cfg.kwargs)
    if not split:
        consts["num_splits"] = 1  # Triton specialises an integer argument equal to 1
    sig.update(dict.fromkeys(consts, "constexpr"))
    names = list(sig)
    # Strides of the scales (1 or 4 fp32 per row) are not 16-divisible; pointers and the other strides are.
    aligned = [n for n in names if n.endswith("_ptr") or n in strides[:9] + ("stride_bt",)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(attention_prefill._prefill_kernel.fn, sig, consts, attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def prefill_attention(kvs: str, arch: int) -> None:
    for kv in kvs.split(","):
        for split in (False, True):
            for cfg in attention_prefill._CONFIGS:
                head = (f"{kv:5s} attention-prefill split={split!s:5s} m={cfg.kwargs['BLOCK_M']:<3d} "
                        f"n={cfg.kwargs['BLOCK_N']:<3d} w={cfg.num_warps} s={cfg.num_stages}")
                try:
                    kernel = compile_prefill_attention(kv, split, cfg, arch)
                    print(f"{head} | {resources(kernel, arch)} | {describe(kernel, stores=True)}", flush=True)
                except Exception as err:  # noqa: BLE001
                    print(f"{head}: FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)


def main(args: argparse.Namespace) -> None:
    kinds = args.kinds.split(",")
    if "attention-prefill" in kinds:
        prefill_attention(args.kv, args.arch)
        if kinds == ["attention-prefill"]:
            return
    for fmt in args.formats.split(","):
        if "moe-gemv" in kinds:
            moe_gemv(fmt, args.arch, args.sms)
        if "expert-mma" in kinds and fmt in moe_mma_configs.FORMATS:
            expert_mma(fmt, args.arch, args.sms)
        if "gemv-mma" in kinds and fmt.startswith("int4"):
            mma(fmt, args.m, args.arch, args.sms)
        if "frag" in kinds and (fmt.startswith("int4") or fmt in ("int8-g64", "nvfp4")):
            frag(fmt, args.m, args.arch, args.sms)
        if "frag-tiled" in kinds and (fmt.startswith("int4") or fmt == "int8-g64"):
            frag_tiled(fmt, args.m, args.arch, args.sms)
        cfgs = candidates(fmt, args.m, args.n, args.k, args.sms)
        if "dequant" in kinds and not any(c.kind == "dequant" for c in cfgs):  # decode M: not offered there
            cfgs += dequant_candidates(fmt, 128)
        for cfg in cfgs:
            if cfg.kind not in kinds or cfg.kind in ("gemv-mma", "frag", "frag-tiled"):
                continue
            common = dict(FMT=FMT_CODES[fmt], ROW_SCALE=fmt in ("fp8", "nvfp4"), SWIGLU=False, HAS_RES=False,
                          SPLIT=cfg.split_k > 1, EVEN_K=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                          BLOCK_K=cfg.block_k)
            kp = kernel_params(fmt, cfg)
            if cfg.kind == "dequant":
                try:
                    kernel = compile_dequant(fmt, cfg, args.arch)
                    print(f"{fmt:9s} {cfg.kind:13s} n={cfg.block_n:<4d} k={cfg.block_k:<4d} w={cfg.num_warps} "
                          f"s={cfg.num_stages} | {describe(kernel, stores=True)}", flush=True)
                except Exception as err:  # noqa: BLE001
                    print(f"{fmt:9s} {cfg}: FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)
                continue
            if cfg.kind.startswith("gemv"):
                consts = dict(common, GROUP=kp["group"], ROW_BLOCK=kp["row_block"], PREFETCH=cfg.kind == "gemv-prefetch",
                              WORDS=cfg.kind == "gemv-w32")
                fn, split_arg = quant_gemv._quant_gemv_kernel, "k_per_split"
            else:
                consts = dict(common, GROUP=kp["group"], CHUNK=kp["chunk"], ROW_BLOCK=kp["row_block"],
                              SCALED=kp["scaled"], IEEE=False, GROUP_M=8)
                fn, split_arg = quant_gemm_kernel, "steps_per_split"
            try:
                kernel = compile_kernel(fn, split_arg, fmt, consts, cfg.num_warps, cfg.num_stages, args.arch)
                print(f"{fmt:9s} {cfg.kind:13s} m={cfg.block_m:<3d} n={cfg.block_n:<4d} k={cfg.block_k:<4d} "
                      f"split={cfg.split_k:<3d} w={cfg.num_warps} s={cfg.num_stages} | {describe(kernel)}", flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"{fmt:9s} {cfg}: FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200), 120 (RTX 5090)")
    parser.add_argument("--formats", default="int4-g64,nvfp4,int8-g64,fp8")
    parser.add_argument("--kinds", default="gemv,gemv-prefetch,dot",
                        help="comma list of gemv, gemv-prefetch, dot, dequant, moe-gemv, gemv-mma, frag, "
                             "attention-prefill")
    parser.add_argument("--kv", default="bf16", help="KV formats for attention-prefill: bf16, fp8, int8")
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--n", type=int, default=34816)
    parser.add_argument("--k", type=int, default=5120)
    parser.add_argument("--sms", type=int, default=132)
    main(parser.parse_args())
