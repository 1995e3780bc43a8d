"""The Qwen3.5-35B-A3B routed-expert block (E = 256, top-8, H = 2048, I = 512, bf16).

Points, each against a limit measured in this run and the torch reference loop
(``moe_experts_reference``, which syncs on ``ids.unique()``) as the baseline:

* decode (1, 2, 4, 8 tokens, and 64 for the aligned 16-row path): router + experts replayed from
  a CUDA graph that cycles through 8 routings, so that consecutive calls select different experts
  (the 48 MB of one token's experts would otherwise stay in the 50 MB L2). Bytes = the distinct
  selected experts' weights (3 * I * H bf16 each) + x + out + logits; limit: the copy bandwidth
  (issue bar: >= 70 %).
* prefill (8192 tokens): FLOPs ``2 * N*k * 3 * I * H``; limit: cuBLAS bf16 running dense GEMMs of
  the same shapes (``[N*k, H] x [H, 2I]`` and ``[N*k, I] x [I, H]``) in this run (bar: >= 0.6x).
* router alone at decode and prefill: logits read + weights/ids written vs the copy bandwidth.

Run: ``python perf/bench_moe.py``.
"""
from __future__ import annotations

import sys
from pathlib import Path

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

from ninfer.kernels.moe import (
    moe_experts_reference,
    route_topk_reference,
    route_topk_triton,
)
from ninfer.kernels.moe_gemm import moe_experts_triton

E, TOP_K, H, I = 256, 8, 2048, 512
DECODE = (1, 2, 4, 8, 64)  # 1..8: the alignment-free path; 64 tokens: aligned 16-row blocks
PREFILL = 8192
ROUTINGS = 8
EXPERT_BYTES = 3 * I * H * 2


def _logits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, E, generator=g, device="cuda").to(torch.bfloat16)


def decode(n: int, gate_up: torch.Tensor, down: torch.Tensor, bw: float) -> None:
    logits = [_logits(n, 100 * n + r) for r in range(ROUTINGS)]
    xs = [torch.randn(n, H, device="cuda", dtype=torch.bfloat16) for _ in range(ROUTINGS)]
    unique = sum(int(route_topk_reference(lg, TOP_K)[1].unique().numel()) for lg in logits) / ROUTINGS
    nbytes = unique * EXPERT_BYTES + 2 * n * H * 2 + n * E * 2
    calls = [0]

    def step(route, experts) -> torch.Tensor:
        r = calls[0] % ROUTINGS
        calls[0] += 1
        weights, ids = route(logits[r], TOP_K)
        return experts(xs[r], gate_up, down, weights, ids)

    ms = bench_graph_ms(lambda: step(route_topk_triton, moe_experts_triton), inner=2 * ROUTINGS)
    base_ms = bench_ms(lambda: step(route_topk_reference, moe_experts_reference), warmup=5, rep=50)
    record("moe_decode", f"N={n} E={E} k={TOP_K} H={H} I={I} bf16", ms, achieved=nbytes / ms / 1e9,
           limit=bw, unit="TB/s", baseline="torch reference loop", baseline_ms=base_ms, unique_experts=unique)


def prefill(gate_up: torch.Tensor, down: torch.Tensor) -> None:
    n = PREFILL
    nk = n * TOP_K
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    weights, ids = route_topk_triton(_logits(n, 7), TOP_K)
    flops = 2 * nk * 3 * I * H
    ms = bench_ms(lambda: moe_experts_triton(x, gate_up, down, weights, ids), warmup=25, rep=100)
    a1 = torch.randn(nk, H, device="cuda", dtype=torch.bfloat16)
    a2 = torch.randn(nk, I, device="cuda", dtype=torch.bfloat16)
    w1, w2 = gate_up[0], down[0]
    dense_ms = bench_ms(lambda: (a1 @ w1.t(), a2 @ w2.t()), warmup=10, rep=50)
    base_ms = bench_ms(lambda: moe_experts_reference(x, gate_up, down, weights, ids), warmup=5, rep=50)
    record("moe_prefill", f"N={n} E={E} k={TOP_K} H={H} I={I} bf16", ms, achieved=flops / ms / 1e9,
           limit=flops / dense_ms / 1e9, unit="TFLOP/s", baseline="torch reference loop", baseline_ms=base_ms,
           dense_cublas_ms=dense_ms, matmul_peak_tflops=matmul_peak_tflops())


def router(n: int, bw: float) -> None:
    logits = _logits(n, 3)
    nbytes = n * E * 2 + n * TOP_K * (2 + 8)
    timer = bench_graph_ms if n <= 64 else bench_ms  # tiny launches: replayed from a graph
    ms = timer(lambda: route_topk_triton(logits, TOP_K))
    base_ms = timer(lambda: route_topk_reference(logits, TOP_K))
    record("moe_router", f"N={n} E={E} k={TOP_K} bf16", ms, achieved=nbytes / ms / 1e9, limit=bw,
           unit="TB/s", baseline="torch softmax+topk", baseline_ms=base_ms)


def main() -> None:
    bw = copy_bandwidth_tbps()
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, generator=g, device="cuda") * H ** -0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, I, generator=g, device="cuda") * I ** -0.5).to(torch.bfloat16)
    for n in (8, PREFILL):
        router(n, bw)
    for n in DECODE:
        decode(n, gate_up, down, bw)
    prefill(gate_up, down)


if __name__ == "__main__":
    main()
