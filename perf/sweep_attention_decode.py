"""Paged decode attention: every (tile config, number of splits) at the 27B shapes, to choose the launcher's
defaults from measurements.

The engine replays decode from CUDA graphs captured per batch size, so the number of splits may depend on
the batch but not on the context (the keys per split follow each sequence's length on the device); the
tile config is picked by Triton's autotuner per kernel key (group, head dim, KV format, rows), i.e. once,
at whatever shape it sees first. This sweep times each of the kernel's configs with each split count at
batch 1 and 8 and contexts 8k / 32k / 128k (bf16 KV; CUDA-graph replay, rotating caches as in
``bench_attention.py``), prints the best per case and the best single choice per batch over all
contexts, and records every point (``attention_decode_sweep``).

Run: ``python perf/sweep_attention_decode.py [--kv bf16 fp8]``.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.kernels.attention import decode as attention_decode
from perf.bench_attention import (
    HEAD_DIM,
    HEADS,
    L2_BYTES,
    PAGE,
    SCALE,
    kv_bytes,
    random_cache,
)
from perf.common import bench_graph_ms, copy_bandwidth_tbps, record

SPLITS = (1, 2, 4, 8, 16, 32, 64)


def sweep(kv_dtype: str, bandwidth: float) -> dict:
    kernel = attention_decode._decode_kernel
    all_configs = list(kernel.configs)
    measured = attention_decode.measured_config
    attention_decode.measured_config = lambda *args: None  # time the configs themselves, not the launcher's pick
    times: dict = {}
    try:
        for ctx_len, batch in itertools.product((8192, 32768, 131072), (1, 8)):
            tokens = ctx_len * batch
            q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
            ctx = torch.full((batch,), ctx_len, device="cuda", dtype=torch.int32)
            nbytes = kv_bytes(random_cache(PAGE, kv_dtype), tokens)
            copies = max(1, min(8, int(4 * L2_BYTES // nbytes) + 1))
            caches = [random_cache(tokens, kv_dtype) for _ in range(copies)]
            tables = [torch.randperm(tokens // PAGE, device="cuda", dtype=torch.int32).view(batch, -1)
                      for _ in range(copies)]
            for cfg, splits in itertools.product(all_configs, SPLITS):
                if batch * 4 * splits < 16 or batch * 4 * splits > 2048:
                    continue
                kernel.configs = [cfg]
                kernel.cache.clear()
                turn = itertools.cycle(range(copies))

                def step() -> torch.Tensor:
                    i = next(turn)
                    return attention_decode.paged_attention_decode_triton(q, caches[i], tables[i], cu, ctx, SCALE, 1,
                                                                          num_splits=splits)

                try:
                    ms = bench_graph_ms(step, inner=max(copies, 20 // copies * copies), warmup=5, rep=30)
                except Exception as err:  # a config over this GPU's shared memory: skip it
                    print(f"skip {cfg} splits={splits}: {type(err).__name__}", flush=True)
                    continue
                name = f"N{cfg.kwargs['BLOCK_N']}w{cfg.num_warps}s{cfg.num_stages}"
                times[(batch, ctx_len, name, splits)] = ms
                record("attention_decode_sweep", f"B={batch} ctx={ctx_len} h=24/4 d=256", ms,
                       achieved=nbytes / ms / 1e9, limit=bandwidth, unit="TB/s", kv_dtype=kv_dtype,
                       config=name, num_splits=splits)
            best = min((v, k) for k, v in times.items() if k[:2] == (batch, ctx_len))
            default = attention_decode.default_num_splits(q.device, batch, 4)
            print(f"{kv_dtype} B={batch} ctx={ctx_len}: best {best[1][2]} splits={best[1][3]} {best[0]:.4f} ms "
                  f"({nbytes / best[0] / 1e9 / bandwidth:.1%} of copy BW); default splits {default}", flush=True)
            del caches, tables
            torch.cuda.empty_cache()
    finally:
        attention_decode.measured_config = measured
        kernel.configs = all_configs
        kernel.cache.clear()
    return times


def summarize(times: dict, kv_dtype: str) -> None:
    """Per batch: the single (config, splits) with the least total slowdown over the contexts."""
    for batch in sorted({k[0] for k in times}):
        ctxs = sorted({k[1] for k in times if k[0] == batch})
        best = {c: min(v for k, v in times.items() if k[:2] == (batch, c)) for c in ctxs}
        choices = {k[2:] for k in times if k[0] == batch}
        scored = []
        for choice in choices:
            if all((batch, c, *choice) in times for c in ctxs):
                worst = max(times[(batch, c, *choice)] / best[c] for c in ctxs)
                scored.append((worst, choice))
        scored.sort()
        for worst, choice in scored[:5]:
            print(f"{kv_dtype} B={batch}: {choice[0]} splits={choice[1]} worst {worst:.3f}x of each context's best")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv", nargs="+", default=["bf16"], choices=["bf16", "fp8", "int8"])
    args = parser.parse_args()
    bandwidth = copy_bandwidth_tbps()
    print(f"copy bandwidth {bandwidth:.2f} TB/s", flush=True)
    with torch.inference_mode():
        for kv_dtype in args.kv:
            summarize(sweep(kv_dtype, bandwidth), kv_dtype)


if __name__ == "__main__":
    main()
