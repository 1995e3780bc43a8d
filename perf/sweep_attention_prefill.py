"""Causal prefill attention at the 27B shapes: every tile config of the prefill kernel at 8k / 32k tokens,
next to the config the autotuner picks, to tell a slower kernel from a worse pick.

(The fifth call measured 391 TFLOP/s at 8k where the fourth had 490, with split-KV added to the kernel in
between; the unsplit path's loops are meant to be unchanged.)

Run: ``python perf/sweep_attention_prefill.py`` (records ``attention_prefill_sweep``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.kernels.attention import prefill as attention_prefill  # noqa: E402
from perf.bench_attention import HEAD_DIM, HEADS, SCALE, prefill_inputs  # noqa: E402
from perf.common import bench_ms, matmul_peak_tflops, record  # noqa: E402


def main() -> None:
    peak = matmul_peak_tflops()
    kernel = attention_prefill._prefill_kernel
    all_configs = list(kernel.configs)
    with torch.inference_mode():
        for seqlen in (8192, 32768):
            kv, table, q, cu, ctx = prefill_inputs(seqlen)
            flops = 4 * HEADS * HEAD_DIM * seqlen * (seqlen + 1) / 2

            def run() -> torch.Tensor:
                return attention_prefill.paged_attention_prefill_triton(q, kv, table, cu, ctx, SCALE, seqlen)

            rep = 50 if seqlen <= 8192 else 10
            kernel.cache.clear()
            auto_ms = bench_ms(run, warmup=5, rep=rep)
            picked = str(kernel.best_config)
            print(f"S={seqlen}: autotuner picked {picked}: {auto_ms:.3f} ms", flush=True)
            try:
                for cfg in all_configs:
                    kernel.configs = [cfg]
                    kernel.cache.clear()
                    try:
                        ms = bench_ms(run, warmup=3, rep=rep)
                    except Exception as err:  # over this GPU's shared memory
                        print(f"skip {cfg}: {type(err).__name__}", flush=True)
                        continue
                    record("attention_prefill_sweep", f"S={seqlen} h=24/4 d=256 causal", ms,
                           achieved=flops / ms / 1e9, limit=peak, unit="TFLOP/s", config=str(cfg),
                           autotuner_pick=picked, autotuner_ms=round(auto_ms, 5))
            finally:
                kernel.configs = all_configs
                kernel.cache.clear()
            del kv, q
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
