"""The small bf16 projections at decode sizes: the one-launch float GEMV against cuBLAS (``F.linear``).

Run on a GPU: ``python perf/bench_float_gemv.py``. Shapes: the 27B's DeltaNet a/b gates (96 x 5120), the
35B-A3B's router with the shared expert's gate row (257 x 2048) and its a/b gates (64 x 2048); 1, 4, 8 and 16
tokens. Each point: the fastest float-GEMV candidate (:func:`ninfer.kernels.float_gemv.float_gemv_candidates`)
and cuBLAS, both timed from CUDA-graph replays of back-to-back calls in one process, as the tuner times them,
with the weight bytes as a fraction of the device-to-device copy bandwidth measured at the start. cuBLAS runs
split-K and a reduce kernel on most of these: two launches where the float GEMV makes one.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import bench_graph_ms, copy_bandwidth_tbps, record  # noqa: E402

from ninfer.kernels.float_gemv import CUBLAS, float_gemv_candidates, launch_float_gemv  # noqa: E402
from ninfer.kernels.quant_gemm.tune import sm_count  # noqa: E402

SHAPES = {"27b in_proj_ab": (96, 5120), "35b-a3b router": (257, 2048), "35b-a3b in_proj_ab": (64, 2048)}


def main() -> None:
    limit = copy_bandwidth_tbps()
    sms = sm_count(torch.device("cuda"))
    print(f"copy bandwidth {limit:.2f} TB/s, {sms} SMs", flush=True)
    for name, (n_out, k) in SHAPES.items():
        w = (torch.randn(n_out, k, device="cuda") * k ** -0.5).bfloat16()
        for m in (1, 4, 8, 16):
            x = torch.randn(m, k, device="cuda").bfloat16()
            out = torch.empty(m, n_out, dtype=torch.bfloat16, device="cuda")
            times = {}
            for cfg in float_gemv_candidates(m, n_out, k, sms):
                times[cfg] = bench_graph_ms(lambda cfg=cfg: launch_float_gemv(x, w, out, cfg))
            best = min((c for c in times if c != CUBLAS), key=times.__getitem__)
            launch_float_gemv(x, w, out, best)
            ref = F.linear(x.float(), w.float())
            err = ((out.float() - ref).norm() / ref.norm()).item()
            nbytes = n_out * k * 2
            record("float_gemv", f"{name} M={m}", times[best], achieved=nbytes / times[best] / 1e9, limit=limit,
                   unit="TB/s", baseline="cuBLAS", baseline_ms=times[CUBLAS], bytes=nbytes, config=str(best),
                   max_rel_err=round(err, 6), timing="cuda-graph")


if __name__ == "__main__":
    main()
