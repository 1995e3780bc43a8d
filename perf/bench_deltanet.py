"""Gated DeltaNet at the 27B shapes (16 key heads, 48 value heads, dk = dv = 128, fp32 state).

* decode: batch 1 and 8, one token per sequence, through the public op (recurrent kernel);
  bytes = fp32 state read + written, q/k/v/a/b read, o written, vs the copy bandwidth; CUDA-graph
  replay rotating over per-layer state pools so L2 cannot hold them. Baseline: fla's
  ``fused_recurrent_gated_delta_rule`` (gates, beta sigmoid and q/k L2 norm in its kernel).
* prefill: one sequence of 1k / 8k / 32k tokens, through the public op (chunked kernels), with a
  nonzero initial state; FLOPs of the chunked algorithm vs the bf16 matmul peak. Baseline: fla's
  ``chunk_gated_delta_rule`` with the same fused options.

flash-linear-attention (``fla-core``, pure Python; needs ``einops``) is imported lazily: when it is
missing the baseline is recorded as None. Each point also records the max relative difference of
the outputs against fla's.

Run: ``python perf/bench_deltanet.py`` (records to ``$OUT/perf.jsonl``).
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import bench_graph_ms, bench_ms, copy_bandwidth_tbps, matmul_peak_tflops, record  # noqa: E402
from ninfer.kernels.deltanet import CHUNK, gated_delta_rule  # noqa: E402
from ninfer.kernels.deltanet import chunk as deltanet_chunk  # noqa: E402

HK, HV, DK, DV = 16, 48, 128, 128
L2_BYTES = 60e6
SHAPE = f"hk={HK} hv={HV} dk={DK} dv={DV}"


def load_fla() -> tuple[Callable | None, Callable | None]:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as err:  # noqa: BLE001 - any import failure means "no baseline"
        print(f"flash-linear-attention unavailable ({type(err).__name__}: {err}); baseline None", flush=True)
        return None, None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def inputs(n: int) -> dict[str, torch.Tensor]:
    """q, k, v as strided views of one conv output (as the model passes them), raw gates a, b."""
    mixed = torch.randn(n, 2 * HK * DK + HV * DV, device="cuda", dtype=torch.bfloat16)
    q, k, v = mixed.split([HK * DK, HK * DK, HV * DV], dim=-1)
    return dict(q=q.view(n, HK, DK), k=k.view(n, HK, DK), v=v.view(n, HV, DV),
                a=torch.randn(n, HV, device="cuda", dtype=torch.bfloat16),
                b=torch.randn(n, HV, device="cuda", dtype=torch.bfloat16),
                A_log=torch.empty(HV, device="cuda").uniform_(1, 16).log(),
                dt_bias=torch.randn(HV, device="cuda"))


def fla_call(fla_fn: Callable, x: dict[str, torch.Tensor], batch: int, h0: torch.Tensor) -> torch.Tensor:
    """fla on [batch, T, heads, dim] inputs with the same fused gate, beta and norm options."""
    seq = x["q"].shape[0] // batch

    def shaped(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch, seq, *t.shape[1:])

    o, _ = fla_fn(shaped(x["q"]), shaped(x["k"]), shaped(x["v"]), g=shaped(x["a"]), beta=shaped(x["b"]),
                  initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True)
    return o.reshape(-1, HV, DV)


def max_rel_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    return round(((x.float() - ref.float()).abs().max() / ref.float().abs().max()).item(), 5)


def bench_decode(bandwidth: float, fla_recurrent: Callable | None) -> None:
    state_bytes = HV * DK * DV * 4
    for batch in (1, 8):
        x = inputs(batch)
        cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        slots = torch.arange(batch, device="cuda", dtype=torch.int32)
        pools = max(20, int(3 * L2_BYTES // (batch * state_bytes)) + 1)  # one pool per "layer"
        states = [0.1 * torch.randn(batch, HV, DK, DV, device="cuda") for _ in range(pools)]
        turn = itertools.cycle(range(pools))
        args = [x[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")]
        ms = bench_graph_ms(lambda: gated_delta_rule(*args, states[next(turn)], cu, slots, 1), inner=pools)
        io_bytes = sum(x[n].numel() * 2 for n in ("q", "k", "v", "a", "b")) + batch * HV * DV * 2
        nbytes = 2 * batch * state_bytes + io_bytes
        base_ms, diff = None, None
        if fla_recurrent is not None:
            try:
                h0 = states[0].clone()
                diff = max_rel_diff(gated_delta_rule(*args, h0.clone(), cu, slots, 1),
                                    fla_call(fla_recurrent, x, batch, h0))
                base_ms = bench_graph_ms(lambda: fla_call(fla_recurrent, x, batch, states[next(turn)]), inner=pools)
            except Exception as err:  # noqa: BLE001 - a failing baseline must not stop the run
                print(f"fla fused_recurrent baseline failed: {type(err).__name__}: {err}", flush=True)
        record("deltanet_decode", f"B={batch} {SHAPE}", ms, achieved=nbytes / ms / 1e9, limit=bandwidth,
               unit="TB/s", baseline="fla fused_recurrent_gated_delta_rule" if base_ms else None,
               baseline_ms=base_ms, bytes=nbytes, max_rel_diff_vs_fla=diff)
        del states
        torch.cuda.empty_cache()


def chunked_flops(tokens: int) -> float:
    """Matmul FLOPs of the chunked rule: K K^T, Q K^T, T (beta V'), P V_new (C x C) and K S, Q S, K^T V_new."""
    per_token_head = 2 * CHUNK * (2 * DK + 2 * DV) + 2 * 3 * DK * DV
    return per_token_head * HV * tokens


def bench_prefill(peak: float, fla_chunk: Callable | None) -> None:
    for tokens in (1024, 8192, 32768):
        x = inputs(tokens)
        cu = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
        slots = torch.zeros(1, device="cuda", dtype=torch.int32)
        state = 0.1 * torch.randn(1, HV, DK, DV, device="cuda")
        args = [x[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")]
        ms = bench_ms(lambda: gated_delta_rule(*args, state, cu, slots, tokens), warmup=10, rep=100)
        base_ms, diff = None, None
        if fla_chunk is not None:
            try:
                h0 = 0.1 * torch.randn(1, HV, DK, DV, device="cuda")
                diff = max_rel_diff(gated_delta_rule(*args, h0.clone(), cu, slots, tokens), fla_call(fla_chunk, x, 1, h0))
                base_ms = bench_ms(lambda: fla_call(fla_chunk, x, 1, h0), warmup=10, rep=100)
            except Exception as err:  # noqa: BLE001 - a failing baseline must not stop the run
                print(f"fla chunk baseline failed: {type(err).__name__}: {err}", flush=True)
        flops = chunked_flops(tokens)
        record("deltanet_prefill", f"T={tokens} {SHAPE}", ms, achieved=flops / ms / 1e9, limit=peak,
               unit="TFLOP/s", baseline="fla chunk_gated_delta_rule" if base_ms else None, baseline_ms=base_ms,
               tokens_per_s=round(tokens / ms * 1e3), max_rel_diff_vs_fla=diff)
        inverse_precisions(args, tokens, ms, flops, peak)
        del x, args
        torch.cuda.empty_cache()


def inverse_precisions(args: list[torch.Tensor], tokens: int, default_ms: float, flops: float, peak: float) -> None:
    """The same prefill with the other precisions for the products of T's fp32 blocks (A/B in one run;
    ``deltanet_chunk.INVERSE_PRECISION``), with the output's difference from the default's."""
    cu = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
    slots = torch.zeros(1, device="cuda", dtype=torch.int32)
    h0 = 0.1 * torch.randn(1, HV, DK, DV, device="cuda")
    default = deltanet_chunk.INVERSE_PRECISION
    ref = gated_delta_rule(*args, h0.clone(), cu, slots, tokens)
    try:
        for prec in [p for p in ("ieee", "tf32x3", "tf32") if p != default]:
            deltanet_chunk.INVERSE_PRECISION = prec
            out = gated_delta_rule(*args, h0.clone(), cu, slots, tokens)
            state = h0.clone()
            ms = bench_ms(lambda: gated_delta_rule(*args, state, cu, slots, tokens), warmup=10, rep=100)
            record("deltanet_prefill", f"T={tokens} {SHAPE}", ms, achieved=flops / ms / 1e9, limit=peak,
                   unit="TFLOP/s", config=f"inverse {prec}", baseline=f"inverse {default} (default)",
                   baseline_ms=default_ms, max_rel_diff_vs_default=max_rel_diff(out, ref))
    finally:
        deltanet_chunk.INVERSE_PRECISION = default


@torch.inference_mode()
def main() -> None:
    bandwidth, peak = copy_bandwidth_tbps(), matmul_peak_tflops()
    print(f"copy bandwidth {bandwidth:.2f} TB/s, bf16 matmul peak {peak:.0f} TFLOP/s", flush=True)
    fla_chunk, fla_recurrent = load_fla()
    bench_decode(bandwidth, fla_recurrent)
    bench_prefill(peak, fla_chunk)


if __name__ == "__main__":
    main()
