"""Where the deferred norm's time goes, GEMM by GEMM (27B int4-g64 shapes, L2-cold, replayed from CUDA graphs).

Run 2026-12-05.14 profiled the 27B decode step with the deferred norm (``NINFER_DEFERRED_NORM=1``): its register
decodes took 7.12 ms against 6.50 ms with the norms as launches of their own, about 2.4 us more per GEMM, where
the 128 norm launches it removed took 0.27 ms. This times each side apart, on the tuned configs the engine takes:

* a producer (``down``, ``o_proj``): the GEMM then :func:`rms_norm` (two launches), the GEMM alone, and the GEMM
  that writes the new residual, the scaled rows and the shares of their sums of squares (``deferred``);
* a reader (``gate_up`` with SwiGLU, ``in_proj_qkvz``): the GEMM of normed rows, and the GEMM of the deferred rows
  (``reader``: it sums the shares and scales its fp32 sums);
* the DeltaNet a/b gates (``in_proj_ab``, bf16): the tuned float projection of normed rows (cuBLAS or the one-launch
  GEMV) and the one-launch GEMV of the deferred rows (``reader``).

    python perf/bench_deferred_norm.py [--m 1,8]
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_quant_gemm import SHAPES, _copies, _cycle, _time  # noqa: E402
from common import copy_bandwidth_tbps, record  # noqa: E402

from ninfer.kernels.float_gemv import float_linear  # noqa: E402
from ninfer.kernels.norms import NormedRows, rms_norm  # noqa: E402
from ninfer.kernels.quant_gemm import quant_matmul, quant_matmul_triton  # noqa: E402
from ninfer.kernels.quant_gemm.dispatch import quant_matmul_then_norm  # noqa: E402
from ninfer.kernels.quant_gemm.fragments import FRAGMENTS, to_fragments  # noqa: E402
from ninfer.quant.formats import quantize  # noqa: E402

PRODUCERS = ("down", "o_proj")
READERS = ("gate_up", "in_proj_qkvz")
EPS = 1e-6


def fragment_weights(shape: str, fmt: str, cold: bool = True) -> tuple[list, int]:
    """A random ``shape`` weight in the fragment layout (``cold``: and copies for an L2-cold timing), its bytes."""
    n, k = SHAPES[shape]
    qt = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, fmt)
    q, sc = to_fragments(qt.tensors["qweight"], qt.tensors["scales"])
    qt = replace(qt, tensors={**qt.tensors, "qweight": q, "scales": sc}, layout=FRAGMENTS)
    names = list(qt.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in qt.tensors.values())
    return [replace(qt, tensors=dict(zip(names, ts))) for ts in _copies(tuple(qt.tensors.values()), nbytes, cold)], \
        nbytes


def producer_cases(shape: str, m: int, fmt: str) -> dict:
    copies, nbytes = fragment_weights(shape, fmt)
    weight = _cycle(copies)
    n, k = SHAPES[shape]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    nw = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1
    return {
        "gemm": lambda: quant_matmul_triton(x, weight()),
        "gemm+norm": lambda: rms_norm(quant_matmul_triton(x, weight()), nw, EPS, res),
        "deferred": lambda: quant_matmul_then_norm(x, weight(), nw, EPS, res, defer=True),
    }, len(copies), nbytes


def produced_rows(m: int, k: int, fmt: str) -> NormedRows:
    """Deferred rows of width ``k`` as the engine's readers get them: from an output projection (``o_proj``)."""
    n_o, k_o = SHAPES["o_proj"]
    assert n_o == k, "the readers' K is the hidden size, o_proj's N"
    (w_o,), _ = fragment_weights("o_proj", fmt, cold=False)
    x = torch.randn(m, k_o, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    nw = torch.randn(k, device="cuda", dtype=torch.bfloat16) * 0.1
    rows, _ = quant_matmul_then_norm(x, w_o, nw, EPS, res, defer=True)
    assert isinstance(rows, NormedRows), "o_proj did not defer its norm"
    return rows


def reader_cases(shape: str, m: int, fmt: str) -> dict:
    copies, nbytes = fragment_weights(shape, fmt)
    weight = _cycle(copies)
    k = SHAPES[shape][1]
    swiglu = shape == "gate_up"
    rows = produced_rows(m, k, fmt)
    normed = rows.materialize()
    return {
        "gemm": lambda: quant_matmul_triton(normed, weight(), swiglu=swiglu),
        "reader": lambda: quant_matmul(rows, weight(), swiglu=swiglu),
    }, len(copies), nbytes


def gate_cases(m: int, fmt: str) -> dict:
    n, k = SHAPES["in_proj_ab"]
    weights = _copies((torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02,), 2 * n * k, True)
    weight = _cycle(weights)
    rows = produced_rows(m, k, fmt)
    normed = rows.materialize()
    return {
        "gemm": lambda: float_linear(normed, weight()[0]),
        "reader": lambda: float_linear(rows, weight()[0]),
    }, len(weights), 2 * n * k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="1,8")
    parser.add_argument("--format", default="int4-g64")
    args = parser.parse_args()
    os.environ["NINFER_DEFERRED_NORM"] = "1"  # read per call: quant_matmul_then_norm(defer=True) defers
    bw = copy_bandwidth_tbps()
    print(f"copy bandwidth {bw:.2f} TB/s")
    torch.manual_seed(0)
    for m in (int(v) for v in args.m.split(",")):
        for shape in PRODUCERS + READERS + ("in_proj_ab",):
            if shape == "in_proj_ab":
                cases, n_copies, nbytes = gate_cases(m, args.format)
            else:
                build = producer_cases if shape in PRODUCERS else reader_cases
                cases, n_copies, nbytes = build(shape, m, args.format)
            times = {name: _time(fn, True, n_copies) for name, fn in cases.items()}
            base = times["gemm"]
            weights = "bf16" if shape == "in_proj_ab" else args.format
            for name, ms in times.items():
                record("deferred_norm", f"{shape} M={m} {weights} {name} l2-cold", ms, achieved=nbytes / ms / 1e9,
                       limit=bw, unit="TB/s", baseline="gemm", baseline_ms=base, m=m, case=name)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
