"""Norm, RoPE, SwiGLU and causal-conv kernels at the Qwen3.5-27B shapes, against the torch references.

Run on a GPU: ``python perf/bench_elementwise.py``. All these ops are memory-bound, so each point
reports achieved bytes/s (the fewest bytes the op must move: every input read once, every output
written once) as a fraction of the device-to-device copy bandwidth measured at the start of the
run. Prefill sizes (8192 tokens) use ``bench_ms``; decode sizes (batch 1 and 8) are launch-bound
and are timed from CUDA-graph replays. The baseline is the eager PyTorch reference of each op,
timed in the same process (the conv reference syncs on ``cu_seqlens``, so it is never graphed).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import bench_graph_ms, bench_ms, copy_bandwidth_tbps, record  # noqa: E402

from ninfer.kernels.activations import swiglu_reference, swiglu_triton  # noqa: E402
from ninfer.kernels.conv import causal_conv1d_reference, causal_conv1d_triton  # noqa: E402
from ninfer.kernels.norms import (  # noqa: E402
    gated_rms_norm_reference,
    gated_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)
from ninfer.kernels.rope import (  # noqa: E402
    apply_rope_reference,
    apply_rope_triton,
    mrope_cos_sin,
    qk_norm_rope_reference,
    qk_norm_rope_triton,
    rope_inv_freq,
)

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, ROT = 5120, 17408, 24, 4, 256, 64
V_HEADS, DV, CONV_DIM, TAPS, EPS = 48, 128, 10240, 4, 1e-6
DT, DEV = torch.bfloat16, "cuda"
BYTES = 2  # bf16
BASELINE = "torch reference (eager)"


def max_rel_diff(a: Any, b: Any) -> float:
    if isinstance(a, tuple):
        return max(max_rel_diff(x, y) for x, y in zip(a, b))
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def point(bench: str, shape: str, fn: Callable[[], Any], ref: Callable[[], Any], nbytes: int, limit: float,
          graph: bool, ref_graphable: bool = True) -> None:
    """Check ``fn`` against ``ref`` once, then time both and record the kernel's fraction of copy bandwidth."""
    diff = max_rel_diff(fn(), ref())
    ok = diff < 2e-2
    if not ok:
        print(f"  MISMATCH in {bench} {shape}: max relative difference {diff:.3e}", flush=True)
    ms = bench_graph_ms(fn) if graph else bench_ms(fn)
    try:
        base_ms = bench_graph_ms(ref) if graph and ref_graphable else bench_ms(ref)
    except Exception as exc:  # a baseline must never stop the run
        print(f"  baseline failed for {bench}: {exc}", flush=True)
        base_ms = None
    record(bench, shape, ms, achieved=nbytes / ms / 1e9, limit=limit, unit="TB/s", baseline=BASELINE,
           baseline_ms=base_ms, bytes=nbytes, correct=ok, max_rel_diff=round(diff, 6),
           timing="cuda-graph" if graph else "eager")


def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=DEV, dtype=DT) * scale


def bench_norms(n: int, limit: float, graph: bool) -> None:
    x, r, w = rand(n, HIDDEN), rand(n, HIDDEN), rand(HIDDEN, scale=0.3)
    point("rms_norm+residual", f"{n}x{HIDDEN}", lambda: rms_norm_triton(x, w, EPS, r),
          lambda: rms_norm_reference(x, w, EPS, r), 4 * n * HIDDEN * BYTES + HIDDEN * BYTES, limit, graph)
    point("rms_norm", f"{n}x{HIDDEN}", lambda: rms_norm_triton(x, w, EPS), lambda: rms_norm_reference(x, w, EPS),
          2 * n * HIDDEN * BYTES + HIDDEN * BYTES, limit, graph)
    q = rand(n, HEADS, 2 * HEAD_DIM)[..., :HEAD_DIM]  # query half of the interleaved q_proj output
    hw = rand(HEAD_DIM, scale=0.3)
    point("rms_norm per-head (q view)", f"{n}x{HEADS}x{HEAD_DIM}", lambda: rms_norm_triton(q, hw, EPS),
          lambda: rms_norm_reference(q, hw, EPS), 2 * n * HEADS * HEAD_DIM * BYTES, limit, graph)
    o, z, gw = rand(n * V_HEADS, DV), rand(n * V_HEADS, DV), rand(DV, scale=0.3) + 1
    point("gated_rms_norm", f"{n * V_HEADS}x{DV}", lambda: gated_rms_norm_triton(o, z, gw, EPS),
          lambda: gated_rms_norm_reference(o, z, gw, EPS), 3 * n * V_HEADS * DV * BYTES, limit, graph)


def bench_rope(n: int, limit: float, graph: bool) -> None:
    positions = torch.randint(0, 262_144, (n,), device=DEV).expand(3, n)
    cos, sin = mrope_cos_sin(positions, rope_inv_freq(ROT, 1e7), [11, 11, 10], DT)
    tables = 2 * n * ROT * BYTES
    q = rand(n, HEADS, 2 * HEAD_DIM)[..., :HEAD_DIM]
    k = rand(n, KV_HEADS, HEAD_DIM)
    qw, kw = rand(HEAD_DIM, scale=0.3), rand(HEAD_DIM, scale=0.3)
    point("apply_rope (q view)", f"{n}x{HEADS}x{HEAD_DIM} rot {ROT}", lambda: apply_rope_triton(q, cos, sin),
          lambda: apply_rope_reference(q, cos, sin), 2 * n * HEADS * HEAD_DIM * BYTES + tables, limit, graph)
    point("qk_norm_rope (fused)", f"{n}x({HEADS}+{KV_HEADS})x{HEAD_DIM}",
          lambda: qk_norm_rope_triton(q, k, qw, kw, cos, sin, EPS),
          lambda: qk_norm_rope_reference(q, k, qw, kw, cos, sin, EPS),
          2 * n * (HEADS + KV_HEADS) * HEAD_DIM * BYTES + tables, limit, graph)


def bench_swiglu(n: int, limit: float, graph: bool) -> None:
    gate_up = rand(n, 2 * INTER)
    point("swiglu", f"{n}x2x{INTER}", lambda: swiglu_triton(gate_up), lambda: swiglu_reference(gate_up),
          3 * n * INTER * BYTES, limit, graph)


def bench_conv(lens: list[int], limit: float, graph: bool) -> None:
    n, batch = sum(lens), len(lens)
    x, w = rand(n, CONV_DIM), rand(CONV_DIM, TAPS, scale=0.5)
    state = rand(batch, CONV_DIM, TAPS - 1)
    ref_state = state.clone()  # each side updates its own slots on every call
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    slots = torch.arange(batch, device=DEV)
    nbytes = 2 * n * CONV_DIM * BYTES + CONV_DIM * TAPS * BYTES + 2 * batch * CONV_DIM * (TAPS - 1) * BYTES
    kind = "decode" if max(lens) == 1 else "prefill"
    point(f"causal_conv1d {kind}", f"{n}x{CONV_DIM} B={batch}",
          lambda: causal_conv1d_triton(x, w, state, cu, slots, max(lens)),
          lambda: causal_conv1d_reference(x, w, ref_state, cu, slots, max(lens)), nbytes, limit, graph,
          ref_graphable=False)


def main() -> None:
    torch.manual_seed(0)
    limit = copy_bandwidth_tbps()
    print(f"copy bandwidth {limit:.3f} TB/s ({torch.cuda.get_device_name()})", flush=True)
    prefill = 8192
    bench_norms(prefill, limit, graph=False)
    bench_rope(prefill, limit, graph=False)
    bench_swiglu(prefill, limit, graph=False)
    bench_conv([prefill], limit, graph=False)
    bench_conv([512] * 16, limit, graph=False)  # ragged batch of 16 prompts
    for batch in (1, 8):
        bench_norms(batch, limit, graph=True)
        bench_rope(batch, limit, graph=True)
        bench_swiglu(batch, limit, graph=True)
        bench_conv([1] * batch, limit, graph=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
