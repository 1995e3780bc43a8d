"""A few launches of one quantized GEMM path at a 27B shape, for Nsight Compute to profile.

The decode GEMMs are the step's cost (see ``perf/profile_step.py``) and 4-bit formats stay under half
the copy bandwidth; this answers *why* on the GPU (stall reasons, issue slots, memory throughput):

    i=$(python perf/ncu_gemm.py --shape gate_up --format int4-g64 --m 1 --path gemv --best)
    ncu -k regex:_quant_gemv_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis \\
        python perf/ncu_gemm.py --shape gate_up --format int4-g64 --m 1 --path gemv --pick $i

``--best`` times every candidate of the path (``gemv``: the GEMV configs, ``mma``: the tensor-core int4
decode (kernel ``_quant_gemv_mma_kernel``), ``frag``: the register decode of fragment-laid weights (kernel
``_fragment_mma_kernel``, what the engines run for int4 / int8-g64; ``frag-async``: its configs whose codes come
through the loop's ``cp.async`` pipeline; ``frag-ksplit``: K split over a program's warps), ``dot``: the ``tl.dot``
configs, ``dequant``: dequantization + cuBLAS, M > 16) from CUDA-graph replays and prints the index
of the fastest (its config and time on stderr); ``--pick I`` then only launches candidate I, once to
compile and ``--launches`` times more, so that the profiled launch is not a timing run.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.kernels.quant_gemm import quant_matmul_triton  # noqa: E402
from ninfer.kernels.quant_gemm.fragment_configs import (  # noqa: E402
    fragment_async_candidates,
    fragment_ksplit_candidates,
    is_variant,
)
from ninfer.kernels.quant_gemm.fragments import FRAGMENTS, to_fragments  # noqa: E402
from ninfer.kernels.quant_gemm.timing import graph_ms as _graph_ms  # noqa: E402
from ninfer.kernels.quant_gemm.tune import (  # noqa: E402
    candidates,
    fragment_candidates,
    gemv_candidates,
    mma_candidates,
    sm_count,
)
from ninfer.quant.formats import quantize  # noqa: E402

SHAPES = {"gate_up": (34816, 5120, True), "down": (5120, 17408, False), "q_proj": (12288, 5120, False),
          "in_proj_qkv": (10240, 5120, False), "o_proj": (5120, 6144, False),
          "35b_qkvz": (12288, 2048, False), "35b_out_proj": (2048, 4096, False)}  # the 35B-A3B's DeltaNet projections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gate_up")
    parser.add_argument("--format", default="int4-g64")
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--path", choices=["gemv", "mma", "frag", "frag-async", "frag-ksplit", "dot", "dequant"],
                        default="gemv")
    parser.add_argument("--launches", type=int, default=8)
    parser.add_argument("--best", action="store_true", help="time the candidates, print the fastest's index")
    parser.add_argument("--pick", type=int, default=0, help="launch this candidate only")
    args = parser.parse_args()
    n, k, swiglu = SHAPES[args.shape]
    n_out = n // 2 if swiglu else n
    w = quantize(torch.randn(n, k, device="cuda") * 0.02, args.format)
    x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    sms = sm_count(x.device)
    if args.path == "gemv":
        cands = gemv_candidates(args.format, args.m, n_out, k, sms)
    elif args.path == "mma":  # the tensor-core int4 decode (quant_gemv_mma)
        cands = mma_candidates(args.format, args.m, n_out, k, sms, swiglu=swiglu)
    elif args.path.startswith("frag"):  # the register decode reads the weights re-laid as engines hold them
        q, scales = to_fragments(w.tensors["qweight"], w.tensors["scales"])
        w = replace(w, tensors={"qweight": q, "scales": scales}, layout=FRAGMENTS)
        if args.path == "frag-async":
            cands = fragment_async_candidates(args.format, args.m, n_out, k, sms)
        elif args.path == "frag-ksplit":
            cands = fragment_ksplit_candidates(args.format, args.m, n_out, k)
        else:  # its own configs, whatever the variant switches say
            cands = [c for c in fragment_candidates(args.format, args.m, n_out, k, sms, swiglu=swiglu)
                     if not is_variant(c)]
    else:
        cands = [c for c in candidates(args.format, args.m, n_out, k, sms, swiglu=swiglu) if c.kind == args.path]
    if not cands:
        parser.error(f"no {args.path} config for M = {args.m}")
    if args.best:
        times = [_graph_ms(lambda c=c: quant_matmul_triton(x, w, swiglu=swiglu, config=c)) for c in cands]
        best = min(range(len(cands)), key=times.__getitem__)
        print(f"{args.shape} N={n} K={k} M={args.m} {args.format} [{args.path}]: {cands[best]} "
              f"{times[best] * 1e3:.1f} us", file=sys.stderr)
        print(best)
        return
    cfg = cands[args.pick]
    for _ in range(1 + args.launches):
        quant_matmul_triton(x, w, swiglu=swiglu, config=cfg)
    torch.cuda.synchronize()
    print(f"profiled {cfg}", file=sys.stderr)


if __name__ == "__main__":
    main()
