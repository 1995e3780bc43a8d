"""Compile the MoE decode kernels for a GPU target without a GPU: registers, stack (spills), shared memory and global
loads of every candidate at the 35B-A3B shape (256 experts, top-8, H = 2048, I = 512, shared I = 512), with the
residual and the norm (their heaviest variants): the down projection + combine (``--kinds down-combine``,
:mod:`ninfer.kernels.moe.down_combine`, with the shared expert's output) and the whole block after the router
(``--kinds fused``, :mod:`ninfer.kernels.moe.fused_decode`, with an int8-g64 shared expert).

    python perf/ptx_moe_decode.py [--arch 90|120] [--kinds down-combine,fused] [--formats int4-g64,nvfp4]

Needs a Triton with the NVIDIA backend (compiling needs ptxas, not a driver).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ninfer.kernels.moe import down_combine as dc  # noqa: E402
from ninfer.kernels.moe import fused_decode as fd  # noqa: E402
from ninfer.kernels.quant_gemm.tune import FMT_CODES, GemmConfig, kernel_params  # noqa: E402
from ptx_check import TYPES  # noqa: E402
from sass_tools import describe, resources  # noqa: E402

H, I, TOPK, E, SHARED_FMT = 2048, 512, 8, 256, "int8-g64"


def compile_down_combine(fmt: str, cfg, arch: int, pdl: bool = False):
    q_type, s_type = TYPES[fmt]
    if cfg.kind == dc.WORDS_KIND:
        q_type = "*i32"
    row_scale = fmt in ("fp8", "nvfp4")
    kp = kernel_params(fmt, cfg)
    strides = ("stride_xm", "stride_qe", "stride_qn", "stride_se", "stride_sn", "stride_re", "stride_sm", "stride_lm")
    sig = {"x_ptr": "*bf16", "q_ptr": q_type, "s_ptr": s_type, "rs_ptr": "*fp32" if row_scale else s_type,
           "rw_ptr": "*bf16", "ids_ptr": "*i32", "shared_ptr": "*bf16", "logit_ptr": "*bf16", "res_ptr": "*bf16",
           "norm_w_ptr": "*bf16", "out_ptr": "*bf16", "new_res_ptr": "*bf16", "cnt_ptr": "*i32", "H": "i32",
           **dict.fromkeys(strides, "i32"), "eps": "fp32"}
    consts = dict(K=I, TOPK=TOPK, FMT=FMT_CODES[fmt], GROUP=kp["group"], ROW_BLOCK=kp["row_block"],
                  ROW_SCALE=row_scale, SHARED=True, NORM=True, RESIDUAL=True, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, BLOCK_H=H, WORDS=cfg.kind == dc.WORDS_KIND, PDL_WAIT=pdl, PDL_TRIGGER=pdl)
    sig.update(dict.fromkeys(consts, "constexpr"))
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr") and n not in ("ids_ptr", "cnt_ptr")] + list(strides[:6])
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(dc._down_combine_kernel, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": 1})


def compile_fused(fmt: str, cfg, arch: int, pdl: bool = False):
    q_type, s_type = TYPES[fmt]
    if cfg.words:
        q_type = "*i32"
    sq_type, ss_type = TYPES[SHARED_FMT]
    rs_type = "*fp32" if fmt == "nvfp4" else s_type
    ptrs = {"x_ptr": "*bf16", "logits_ptr": "*bf16", "slogit_ptr": "*bf16", "gq": q_type, "gs": s_type,
            "grs": rs_type, "dq": q_type, "ds": s_type, "drs": rs_type, "sgq": sq_type, "sgs": ss_type,
            "sgrs": ss_type, "sdq": sq_type, "sds": ss_type, "sdrs": ss_type, "inter_ptr": "*bf16",
            "sinter_ptr": "*bf16", "res_ptr": "*bf16", "norm_w_ptr": "*bf16", "out_ptr": "*bf16",
            "new_res_ptr": "*bf16", "cnt_ptr": "*i32"}
    ints = ("T", "E", "stride_xm", "stride_l", "stride_sl", "g_qe", "g_qn", "g_se", "g_sn", "g_re", "d_qe", "d_qn",
            "d_se", "d_sn", "d_re", "sg_qn", "sg_sn", "sd_qn", "sd_sn")
    sig = {**ptrs, **dict.fromkeys(ints, "i32"), "eps": "fp32"}
    kp = kernel_params(fmt, GemmConfig(1, 16, cfg.bk_a, 1, 4, 1, "gemv"))
    skp = kernel_params(SHARED_FMT, GemmConfig(1, 16, cfg.bk_a, 1, 4, 1, "gemv"))
    consts = dict(H=H, I=I, IS=I, TOPK=TOPK, K_BLOCK=TOPK, E_BLOCK=E, FMT=FMT_CODES[fmt], GROUP=kp["group"],
                  ROW_BLOCK=kp["row_block"], ROW_SCALE=fmt == "nvfp4", SFMT=FMT_CODES[SHARED_FMT],
                  SGROUP=skp["group"], SROW_BLOCK=skp["row_block"], SROW_SCALE=False, NORM=True, RESIDUAL=True,
                  BN_A=cfg.bn_a, BN_S=cfg.bn_s, BN_B=cfg.bn_b, BK_A=cfg.bk_a, BK_B=cfg.bk_b, BLOCK_H=H, WORDS=cfg.words,
                  PDL_WAIT=pdl, PDL_TRIGGER=pdl)
    sig.update(dict.fromkeys(consts, "constexpr"))
    names = list(sig)
    aligned = [n for n in ptrs if n != "cnt_ptr"] + ["stride_xm", "g_qe", "g_qn", "d_qe", "d_qn", "sg_qn", "sd_qn"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(fd._moe_fused_kernel, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": 1})


def main(args: argparse.Namespace) -> None:
    kinds = args.kinds.split(",")
    for fmt in args.formats.split(","):
        jobs = []
        if "down-combine" in kinds:
            jobs += [(f"{cfg.kind:17s} n={cfg.block_n:<3d} k={cfg.block_k:<4d} w={cfg.num_warps}",
                      lambda cfg=cfg: compile_down_combine(fmt, cfg, args.arch, pdl=args.arch >= 90))
                     for cfg in dc.down_combine_candidates(fmt, I)]
        if "fused" in kinds and fmt in fd.GROUPS:
            jobs += [(f"fused a={cfg.bn_a}x{cfg.bk_a} s={cfg.bn_s} b={cfg.bn_b}x{cfg.bk_b} w={cfg.num_warps}"
                      f"{' words' if cfg.words else ''}",
                      lambda cfg=cfg: compile_fused(fmt, cfg, args.arch, pdl=args.arch >= 90))
                     for cfg in fd.fused_candidates(fmt, SHARED_FMT, I, I)]
        for head, build in jobs:
            try:
                kernel = build()
                print(f"{fmt:9s} {head} | {resources(kernel, args.arch)} | {describe(kernel)}", flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"{fmt:9s} {head}: FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability: 90 (H100/H200), 120 (RTX 5090)")
    parser.add_argument("--kinds", default="down-combine,fused")
    parser.add_argument("--formats", default="int4-g64,int4-g128,int8-g64,nvfp4,fp8")
    main(parser.parse_args())
