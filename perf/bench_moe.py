"""The Qwen3.5-35B-A3B routed-expert block (E = 256, top-8, H = 2048, I = 512), bf16 activations.

Expert stacks in bf16 and in quantized formats (``--formats``, default int4-g64 and nvfp4, read by
the grouped quantized GEMMs). Points, each against a limit measured in this run:

* decode (1, 2, 4, 8 tokens, and 64 for the aligned 16-row path): router + experts replayed from
  a CUDA graph that cycles through 8 routings, so that consecutive calls select different experts
  (the 48 MB of one token's bf16 experts would otherwise stay in the 50 MB L2). Bytes = the
  distinct selected experts' stored bytes (bf16: 3 * I * H * 2 each; quantized: packed codes and
  scales) + x + out + logits; limit: the copy bandwidth (issue bar: >= 70 %). Baseline: the torch
  reference loop for bf16, the bf16 grouped GEMM on the same routings for quantized stacks.
* prefill (8192 tokens): FLOPs ``2 * N*k * 3 * I * H``; limit: cuBLAS bf16 running dense GEMMs of
  the same shapes (``[N*k, H] x [H, 2I]`` and ``[N*k, I] x [I, H]``) in this run (bar: >= 0.6x).
  Baselines as at decode.
* router alone at decode and prefill: logits read + weights/ids written vs the copy bandwidth.

``--path`` (comma list) times the quantized decode points per expert-GEMM path side by side:
``auto`` (the default, what the runtime does: per GEMM and pair-count bucket the faster of the
``tl.dot`` kernels and the expert GEMV, measured on first use; records carry the choice and every
candidate's tuner time), ``dot`` (the ``tl.dot`` grouped GEMMs pinned) and ``gemv`` (the expert GEMV
of :mod:`ninfer.kernels.moe.quant_gemv`, each GEMM's first candidate; the 64-token point is past
the GEMV's pair limit and runs the dot) and ``mma`` (the register decode of :mod:`ninfer.kernels.moe.quant_mma`,
each GEMM's first candidate; int4 stacks only, the dot elsewhere). Labels of pinned paths end in ``[dot]`` /
``[gemv]`` / ``[mma]``; those of the auto path in ``tuned-l2-warm`` where the tuner timed L2-warm
(``NINFER_TUNE_L2_COLD=none``; the default in records before run 2026-12-06.4).

Run: ``python perf/bench_moe.py [--formats int4-g64,nvfp4] [--no-bf16] [--path auto,dot,gemv,mma]``
(``--formats ''``: bf16 only).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    bench_graph_ms,
    bench_ms,
    copy_bandwidth_tbps,
    matmul_peak_tflops,
    record,
)

from ninfer.kernels.moe import quant_gemv as moe_quant_gemv
from ninfer.kernels.moe import (
    moe_experts_reference,
    route_topk_reference,
    route_topk_triton,
)
from ninfer.kernels.moe.gemm import Weight, moe_experts_triton
from ninfer.kernels.quant_gemm.timing import l2_cold
from ninfer.kernels.quant_gemm.tune import GemmConfig
from ninfer.kernels.tuning import default_tuner
from ninfer.quant.formats import QuantizedTensor, quantize

E, TOP_K, H, I = 256, 8, 2048, 512
DECODE = (1, 2, 4, 8, 64)  # 1..8: the alignment-free path; 64 tokens: aligned 16-row blocks
PREFILL = 8192
ROUTINGS = 8
DEVICE, DTYPE = "cuda", torch.bfloat16  # activations and the float stacks
QUANT_FORMATS = "int4-g64,nvfp4"
PATHS = ("auto", "dot", "gemv", "mma")  # expert-GEMM paths of the quantized decode points (--path)


def expert_bytes(gate_up: Weight, down: Weight) -> int:
    """Stored bytes of one expert: bf16 weights, or packed codes plus every scale."""
    parts = [w.tensors.values() if isinstance(w, QuantizedTensor) else [w] for w in (gate_up, down)]
    return sum(t[0].numel() * t.element_size() for tensors in parts for t in tensors)


def label(w: Weight) -> str:
    return w.format.name if isinstance(w, QuantizedTensor) else "bf16"


def _logits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(n, E, generator=g, device=DEVICE).to(DTYPE)


def _config_name(cfg: GemmConfig) -> str:
    if cfg == moe_quant_gemv.GROUPED_DOT:
        return "dot (autotuned tiles)"
    return (f"{cfg.kind} bm{cfg.block_m} bn{cfg.block_n} bk{cfg.block_k} split{cfg.split_k} "
            f"w{cfg.num_warps} st{cfg.num_stages}")


def _tuner_record(fmt: str, n: int) -> dict[str, Any]:
    """The auto path's choice per GEMM at this point and every candidate's tuner time (graph replays)."""
    bucket = min(1 << max(n * TOP_K - 1, 0).bit_length(), 65536)  # ExpertRows.tune_m
    tuner = default_tuner()
    chosen, timings = tuner.chosen(moe_quant_gemv.TABLE), tuner.timings(moe_quant_gemv.TABLE)
    out: dict[str, Any] = {"expert_configs": {}, "tuner_ms": {}}
    for key, cfg in chosen.items():
        if key[0] == fmt and key[1] == DTYPE and key[2] == bucket:
            gemm = "gate_up" if key[5] else "down"
            out["expert_configs"][gemm] = _config_name(cfg)
            out["tuner_ms"][gemm] = {_config_name(c): round(ms, 5) for c, ms in timings.get(key, {}).items()}
    return out


def decode(n: int, gate_up: Weight, down: Weight, bw: float, bf16: tuple[torch.Tensor, torch.Tensor],
           paths: tuple[str, ...] = ("auto",)) -> None:
    """Router + experts at ``n`` tokens; ``bf16``: the bf16 stacks (the quantized points' baseline);
    ``paths``: the quantized stacks' expert-GEMM paths, one point each (float stacks: one point)."""
    logits = [_logits(n, 100 * n + r) for r in range(ROUTINGS)]
    xs = [torch.randn(n, H, device=DEVICE, dtype=DTYPE) for _ in range(ROUTINGS)]
    unique = sum(int(route_topk_reference(lg, TOP_K)[1].unique().numel()) for lg in logits) / ROUTINGS
    nbytes = unique * expert_bytes(gate_up, down) + 2 * n * H * 2 + n * E * 2
    calls = [0]

    def step(route: Callable, experts: Callable, stacks: tuple[Weight, Weight]) -> torch.Tensor:
        r = calls[0] % ROUTINGS
        calls[0] += 1
        weights, ids = route(logits[r], TOP_K)
        return experts(xs[r], *stacks, weights, ids)

    fmt = label(gate_up)
    if fmt == "bf16":
        paths = ("auto",)
        baseline = "torch reference loop"
        base_ms = bench_ms(lambda: step(route_topk_reference, moe_experts_reference, bf16), warmup=5, rep=50)
    else:
        baseline = "bf16 grouped GEMM (moe_experts_triton)"
        base_ms = bench_graph_ms(lambda: step(route_topk_triton, moe_experts_triton, bf16), inner=2 * ROUTINGS)
    for path in paths:
        experts = partial(moe_experts_triton, path=None if path == "auto" else path)
        ms = bench_graph_ms(lambda experts=experts: step(route_topk_triton, experts, (gate_up, down)),
                            inner=2 * ROUTINGS)
        extra: dict[str, Any] = {}
        if fmt != "bf16":
            extra = {"format": fmt, "path": path, **(_tuner_record(fmt, n) if path == "auto" else {})}
        shape = f"N={n} E={E} k={TOP_K} H={H} I={I} {fmt}" + ("" if path == "auto" else f" [{path}]") \
            + (" tuned-l2-warm" if path == "auto" and fmt != "bf16" and not l2_cold(experts=True) else "")
        record("moe_decode", shape, ms, achieved=nbytes / ms / 1e9, limit=bw, unit="TB/s", baseline=baseline,
               baseline_ms=base_ms, unique_experts=unique, bytes_moved=int(nbytes), **extra)
        if extra.get("expert_configs"):
            print(f"    auto chose {extra['expert_configs']}", flush=True)


def prefill(gate_up: Weight, down: Weight, bf16: tuple[torch.Tensor, torch.Tensor]) -> None:
    n = PREFILL
    nk = n * TOP_K
    x = torch.randn(n, H, device=DEVICE, dtype=DTYPE)
    weights, ids = route_topk_triton(_logits(n, 7), TOP_K)
    flops = 2 * nk * 3 * I * H
    ms = bench_ms(lambda: moe_experts_triton(x, gate_up, down, weights, ids), warmup=25, rep=100)
    a1 = torch.randn(nk, H, device=DEVICE, dtype=DTYPE)
    a2 = torch.randn(nk, I, device=DEVICE, dtype=DTYPE)
    w1, w2 = bf16[0][0], bf16[1][0]
    dense_ms = bench_ms(lambda: (a1 @ w1.t(), a2 @ w2.t()), warmup=10, rep=50)
    fmt = label(gate_up)
    if fmt == "bf16":
        baseline = "torch reference loop"
        base_ms = bench_ms(lambda: moe_experts_reference(x, *bf16, weights, ids), warmup=5, rep=50)
    else:
        baseline = "bf16 grouped GEMM (moe_experts_triton)"
        base_ms = bench_ms(lambda: moe_experts_triton(x, *bf16, weights, ids), warmup=25, rep=100)
    record("moe_prefill", f"N={n} E={E} k={TOP_K} H={H} I={I} {fmt}", ms, achieved=flops / ms / 1e9,
           limit=flops / dense_ms / 1e9, unit="TFLOP/s", baseline=baseline, baseline_ms=base_ms,
           dense_cublas_ms=dense_ms, matmul_peak_tflops=matmul_peak_tflops(),
           **({} if fmt == "bf16" else {"format": fmt}))


def router(n: int, bw: float) -> None:
    logits = _logits(n, 3)
    nbytes = n * E * 2 + n * TOP_K * (2 + 8)
    timer = bench_graph_ms if n <= 64 else bench_ms  # tiny launches: replayed from a graph
    ms = timer(lambda: route_topk_triton(logits, TOP_K))
    base_ms = timer(lambda: route_topk_reference(logits, TOP_K))
    record("moe_router", f"N={n} E={E} k={TOP_K} bf16", ms, achieved=nbytes / ms / 1e9, limit=bw,
           unit="TB/s", baseline="torch softmax+topk", baseline_ms=base_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=QUANT_FORMATS, help="quantized expert formats, comma-separated")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 stacks and the router points")
    parser.add_argument("--path", default="auto",
                        help=f"comma list of expert-GEMM paths for the quantized decode points: {', '.join(PATHS)}")
    args = parser.parse_args()
    paths = tuple(p for p in PATHS if p in args.path.split(","))  # auto first: what the runtime does
    if not paths or not set(args.path.split(",")) <= set(PATHS):
        parser.error(f"--path takes {', '.join(PATHS)}; got {args.path}")
    formats = [f for f in args.formats.split(",") if f]
    bw = copy_bandwidth_tbps()
    g = torch.Generator(device=DEVICE).manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, generator=g, device=DEVICE) * H ** -0.5).to(DTYPE)
    down = (torch.randn(E, H, I, generator=g, device=DEVICE) * I ** -0.5).to(DTYPE)
    bf16 = (gate_up, down)
    if not args.no_bf16:
        for n in (8, PREFILL):
            router(n, bw)
        for n in DECODE:
            decode(n, gate_up, down, bw, bf16)
        prefill(gate_up, down, bf16)
    for fmt in formats:
        stacks = (quantize(gate_up, fmt), quantize(down, fmt))
        for n in DECODE:
            decode(n, *stacks, bw, bf16, paths)
        prefill(*stacks, bf16)
        del stacks
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
