"""Compile the one-launch DeltaNet decode kernel for a GPU target without a GPU, and show how its tail waits on memory.

    python perf/deltanet_sass.py [--arch 90|120]

For the 27B decode (a and b given, or projected in the kernel), the 27B 4-token verification (per-token state
slots) and the 35B-A3B decode, every autotune config: registers and stack (spills), shared memory, and the order
of the global loads, barriers and stores after the kernel's atomic, which the last program of each key head runs
(its conv windows and the gated norm of its value heads): each LDG run followed by a store is a memory round trip
that this program waits for alone. Needs a Triton with the NVIDIA backend (ptxas, not a driver).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sass_tools import memory_order, resources  # noqa: E402

# (hk, hv, dk, dv, tokens, per-token slots, hidden size of gates projected in the kernel, 0: a and b given):
# 27B decode and verification rows, 35B-A3B decode.
CASES = [(16, 48, 128, 128, 1, 0, 0), (16, 48, 128, 128, 1, 0, 5120), (16, 48, 128, 128, 4, 1, 5120),
         (16, 32, 128, 128, 1, 0, 2048)]


def compile_decode(case: tuple[int, ...], cfg: triton.Config, arch: int = 90):
    """The decode kernel of ``case`` under autotune config ``cfg`` (bf16 activations and weights, fp32 state;
    pointers 16-byte aligned), compiled for ``sm_<arch>``."""
    from ninfer.kernels.deltanet import decode

    hk, hv, dk, dv, tokens, per_token, hidden = case
    fn = decode._decode_kernel.fn
    fp32 = {"A_log", "dt_bias", "state", "sumsq"}
    ints = {"cu_seqlens": "i32", "slot_ids": "i64", "out_slots": "i64", "counters": "i32"}
    values = dict(HV=hv, GROUP=hv // hk, DK=dk, DV=dv, K=4, T_MAX=triton.next_power_of_2(tokens),
                  HAS_OUT_SLOTS=bool(per_token), WDT=tl.bfloat16, PROD_DTYPE=tl.bfloat16, GATES_FROM_X=hidden > 0,
                  H=max(hidden, 1), BH=min(decode.GATE_BLOCK, triton.next_power_of_2(max(hidden, 1))), GATE_NORM=False,
                  GATE_PARTS=1, **cfg.kwargs)
    pointers = set(fn.arg_names[:fn.arg_names.index("gate_stats") + 1])
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in pointers:
            signature[name] = "*" + ("fp32" if name in fp32 else ints.get(name, "bf16"))
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in values:
            signature[name], constexprs[(i,)] = "constexpr", values[name]
        else:
            signature[name] = "fp32" if name in ("scale", "eps", "gate_eps") else "i32"
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=dict(num_warps=cfg.num_warps))


def configs() -> list[triton.Config]:
    from ninfer.kernels.deltanet import decode

    return list(decode._decode_kernel.configs)


def main(args: argparse.Namespace) -> None:
    for case in CASES:
        hk, hv, dk, dv, tokens, per_token, hidden = case
        label = f"hv={hv} tokens={tokens}{' slots' if per_token else ''} gates={'x' if hidden else 'given'}"
        for cfg in configs():
            kernel = compile_decode(case, cfg, args.arch)  # (resources at arch 0: no wgmma note, there is no MMA)
            print(f"{label} BV={cfg.kwargs['BV']:<3d} warps={cfg.num_warps} | {resources(kernel, 0)} | "
                  f"shared {kernel.metadata.shared} B | tail: {memory_order(kernel)}", flush=True)


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # compiled for real (read when the kernel module is imported)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200), 120 (RTX 5090)")
    main(parser.parse_args())
