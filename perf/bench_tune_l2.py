"""Whether the decode tuner picks better configs when it times them L2-cold (``NINFER_TUNE_L2_COLD=all``).

The tuner times a decode candidate from 20 replayed launches on one weight, which then sits in the 50 MB L2 for
every weight up to that size: all of the 35B-A3B's projections and the 27B's o_proj. In a model's step each layer
finds its weights in DRAM. Per decode GEMM shape (fragment-laid, as the engine holds them) and token count this
prints and records (``tune_l2``):

* the pick of a fresh tuner timing warm (the dense tuner's default) and of one timing cold (each launch after an
  L2-evicting read), neither with a shipped table nor a disk cache;
* every candidate timed L2-cold over weight copies (>= 256 MB cycled in one graph, as ``bench_quant_gemm.py --l2
  cold``): each pick's time there, and the best candidate's.

``fraction_of_limit``: the cold pick's bytes / time against the copy bandwidth; ``warm_pick_ms`` / ``best_ms``
beside it. Run: ``python perf/bench_tune_l2.py [--shapes a3b_qkvz,o_proj] [--m 1,8]``.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ["NINFER_SHIPPED_TUNING"] = "0"  # every pick measured in this process
os.environ["NINFER_TUNE_CACHE"] = "off"

from bench_quant_gemm import _config_name, _copies, _cycle, _time  # noqa: E402
from common import copy_bandwidth_tbps, record  # noqa: E402

from ninfer.kernels.quant_gemm import quant_matmul_triton  # noqa: E402
from ninfer.kernels.quant_gemm import tune as quant_gemm_tune  # noqa: E402
from ninfer.kernels.quant_gemm.fragments import FRAGMENTS, fragments_fit, to_fragments  # noqa: E402
from ninfer.kernels.quant_gemm.timing import L2_COLD_ENV  # noqa: E402
from ninfer.kernels.tuning import TunerState, use_tuner  # noqa: E402
from ninfer.quant.formats import quantize  # noqa: E402

# name: (N, K, format, SwiGLU) of the decode GEMMs a step runs, the recipes' formats
SHAPES = {
    "a3b_qkvz": (12288, 2048, "int8-g64", False),  # 35B-A3B DeltaNet in_proj_qkvz (30 a step)
    "a3b_qkv": (9216, 2048, "int8-g64", False),  # 35B-A3B attention q (with its gate) / k / v (10)
    "a3b_out": (2048, 4096, "int8-g64", False),  # 35B-A3B out_proj / o_proj (40)
    "a3b_shared_gate_up": (1024, 2048, "int8-g64", True),  # 35B-A3B shared expert, SwiGLU epilogue (40)
    "a3b_shared_down": (2048, 512, "int8-g64", False),  # (40)
    "o_proj": (5120, 6144, "int4-g64", False),  # 27B o_proj (16) and DeltaNet out_proj (48): one shape
    "down": (5120, 17408, "int4-g64", False),  # 27B (64)
    "in_proj_qkvz": (16384, 5120, "int4-g64", False),  # 27B (48)
}
DEFAULT_SHAPES = "a3b_qkvz,a3b_qkv,a3b_out,a3b_shared_gate_up,a3b_shared_down,o_proj,down,in_proj_qkvz"


def _pick(x: torch.Tensor, qt, swiglu: bool, cold: bool) -> tuple[quant_gemm_tune.GemmConfig, dict]:
    """A fresh tuner's choice for this call and its timings of every candidate, timing warm or cold."""
    os.environ[L2_COLD_ENV] = "all" if cold else "none"
    try:
        with use_tuner(TunerState(enabled=True)) as tuner:
            quant_matmul_triton(x, qt, swiglu=swiglu)
            timings = tuner.timings(quant_gemm_tune.TABLE)
            chosen = [(key, cfg) for key, cfg in tuner.chosen(quant_gemm_tune.TABLE).items() if timings.get(key)]
            if len(chosen) != 1:
                raise RuntimeError(f"expected one timed key, the tuner chose {chosen}")
            key, cfg = chosen[0]
            return cfg, timings[key]
    finally:
        os.environ.pop(L2_COLD_ENV)


def point(name: str, m: int, bw: float) -> None:
    n, k, fmt, swiglu = SHAPES[name]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    qt = quantize(w, fmt)
    if fragments_fit(fmt, (n, k)):
        q, sc = to_fragments(qt.tensors["qweight"], qt.tensors["scales"])
        qt = replace(qt, tensors={**qt.tensors, "qweight": q, "scales": sc}, layout=FRAGMENTS)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    warm_cfg, warm_times = _pick(x, qt, swiglu, cold=False)
    cold_cfg, cold_times = _pick(x, qt, swiglu, cold=True)
    names = list(qt.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in qt.tensors.values())
    copies = [replace(qt, tensors=dict(zip(names, ts))) for ts in _copies(tuple(qt.tensors.values()), nbytes, True)]
    weights = _cycle(copies)
    cold_ms = {}
    for cfg in {**warm_times, **cold_times, warm_cfg: 0, cold_cfg: 0}:
        try:
            cold_ms[cfg] = _time(lambda cfg=cfg: quant_matmul_triton(x, weights(), swiglu=swiglu, config=cfg), True,
                                 len(copies))
        except Exception as err:  # noqa: BLE001  (out of resources on this GPU: not a candidate here)
            print(f"  {_config_name(cfg)}: {type(err).__name__}")
    best = min(cold_ms, key=cold_ms.__getitem__)
    for cfg in sorted(cold_ms, key=cold_ms.__getitem__):
        print(f"  {_config_name(cfg):48s} over copies {1e3 * cold_ms[cfg]:7.2f} us | tuner warm "
              f"{1e3 * warm_times.get(cfg, float('nan')):7.2f} cold {1e3 * cold_times.get(cfg, float('nan')):7.2f} us")
    moved = nbytes + 2 * m * (n * (1 if not swiglu else 0.5) + k)
    record("tune_l2", f"{name} N={n} K={k} M={m} {fmt}", cold_ms[cold_cfg], achieved=moved / cold_ms[cold_cfg] / 1e9,
           limit=bw, unit="TB/s", baseline="warm-tuned pick", baseline_ms=cold_ms[warm_cfg], format=fmt, m=m,
           warm_pick=_config_name(warm_cfg), cold_pick=_config_name(cold_cfg), best=_config_name(best),
           warm_pick_ms=round(cold_ms[warm_cfg], 5), best_ms=round(cold_ms[best], 5),
           warm_pick_warm_ms=round(warm_times.get(warm_cfg, 0.0), 5),
           cold_pick_tuner_ms=round(cold_times.get(cold_cfg, 0.0), 5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--m", default="1,8", help="token counts, comma list")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        parser.error(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    bw = copy_bandwidth_tbps()
    print(f"copy bandwidth {bw:.2f} TB/s")
    torch.manual_seed(0)
    for name in shapes:
        for m in (int(v) for v in args.m.split(",")):
            try:
                point(name, m, bw)
            except Exception as err:  # noqa: BLE001  (one failed point must not cost the others their call)
                print(f"{name} M={m}: failed ({type(err).__name__}: {err})", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
