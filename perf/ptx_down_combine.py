"""Compile the MoE down projection + combine kernel (:mod:`ninfer.kernels.moe.down_combine`) for a GPU target
without a GPU: registers, stack (spills), shared memory and global loads of every candidate, 35B-A3B shape (eight
experts of 2048 x 512 per token), with the shared expert, the residual and the norm (its heaviest variant).

    python perf/ptx_down_combine.py [--arch 90|120] [--formats int4-g64,int4-g128,int8-g64,nvfp4,fp8]

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
from ninfer.kernels.quant_gemm.tune import FMT_CODES, kernel_params  # noqa: E402
from ptx_check import TYPES  # noqa: E402
from sass_tools import describe, resources  # noqa: E402

H, I, TOPK = 2048, 512, 8


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


def main(args: argparse.Namespace) -> None:
    for fmt in args.formats.split(","):
        for cfg in dc.down_combine_candidates(fmt, I):
            head = f"{fmt:9s} {cfg.kind:17s} n={cfg.block_n:<3d} k={cfg.block_k:<4d} w={cfg.num_warps}"
            try:
                kernel = compile_down_combine(fmt, cfg, args.arch, pdl=args.arch >= 90)
                print(f"{head} | {resources(kernel, args.arch)} | {describe(kernel)}", flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"{head}: FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability: 90 (H100/H200), 120 (RTX 5090)")
    parser.add_argument("--formats", default="int4-g64,int4-g128,int8-g64,nvfp4,fp8")
    main(parser.parse_args())
