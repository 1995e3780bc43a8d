"""The fixed cost of one dependent kernel in a captured decode step, whatever it computes.

A 35B-A3B batch-1 step replays ~440 kernels, each reading what the one before it wrote, in 2.45 ms (an H100, run
2026-12-06.12) against a 0.85 ms roofline. This measures the floor under that: a chain of ``--chain`` tiny kernels
replayed from one CUDA graph, each waiting for its predecessor's output, for

* ``touch``: each program reads one 4-byte word the kernel before wrote and writes one (the dependency alone);
* ``row``: each program reads a 16 KB activation row the kernel before wrote (an L2 round trip, as a GEMM reads its
  input) and writes a word;
* ``sum``: ``row`` whose programs then take an arrival counter and the last one reads every program's word (a split-K
  epilogue's round trip);

at 1 program, one per SM and 8 per SM, launched plainly and with programmatic dependent launch (each kernel lets the
next one launch at its start and waits before it reads: ``ninfer.kernels.pdl``). Records ``launch_floor`` (µs per
kernel; ``limit``: the same chain's time at ``--chain`` x 1 µs, for scale). Run: ``python perf/bench_launch_floor.py
[--chain 64]``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_graph_ms, record  # noqa: E402

from ninfer.kernels.pdl import pdl_enter  # noqa: E402

ROW = 4096  # fp32 words of the activation row each program reads (16 KB: a 27B hidden row is 10 KB of bf16)


@triton.jit
def _link_kernel(src_ptr, dst_ptr, cnt_ptr, ROW_WORDS: tl.constexpr, SUM: tl.constexpr, PDL: tl.constexpr):
    """One link of the chain: read what the kernel before wrote (one word, or a row), write one word; with ``SUM``
    the last program to arrive also reads every program's word and writes their sum."""
    pdl_enter(PDL, PDL)
    pid = tl.program_id(0)
    if ROW_WORDS > 1:
        v = tl.sum(tl.load(src_ptr + tl.arange(0, ROW_WORDS)), axis=0)
    else:
        v = tl.load(src_ptr + pid)
    tl.store(dst_ptr + pid, v + 1.0)
    if SUM:
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
        if arrived == tl.num_programs(0) - 1:
            n = tl.num_programs(0)
            total = tl.sum(tl.load(dst_ptr + tl.arange(0, 2048), mask=tl.arange(0, 2048) < n, other=0.0), axis=0)
            tl.store(dst_ptr + n, total)
            tl.atomic_xchg(cnt_ptr, 0)


def _chain_us(kind: str, programs: int, pdl: bool, chain: int) -> float:
    """Microseconds per kernel of a ``chain``-kernel graph of one kind, grid and launch mode."""
    a = torch.zeros(max(ROW, 2048 + 1), device="cuda")
    b = torch.zeros_like(a)
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    words = ROW if kind in ("row", "sum") else 1

    def step() -> None:
        for i in range(chain):
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            _link_kernel[(programs,)](src, dst, cnt, ROW_WORDS=words, SUM=kind == "sum", PDL=pdl,
                                      **({"launch_pdl": True} if pdl else {}))

    return bench_graph_ms(step, inner=1) * 1e3 / chain  # the whole chain in one graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", type=int, default=64, help="kernels in one graph")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_launch_floor.py needs a CUDA GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pdl_ok = torch.cuda.get_device_capability(0) >= (9, 0)
    for kind in ("touch", "row", "sum"):
        for programs in (1, sms, 8 * sms):
            for pdl in (False, True) if pdl_ok else (False,):
                us = _chain_us(kind, programs, pdl, args.chain)
                record("launch_floor", f"{kind} programs={programs} pdl={int(pdl)} chain={args.chain}", us / 1e3,
                       achieved=us, limit=1.0, unit="us/kernel", kind=kind, programs=programs, pdl=pdl)


if __name__ == "__main__":
    main()
