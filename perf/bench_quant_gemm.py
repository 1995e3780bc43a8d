"""Quantized GEMMs at the Qwen3.5-27B projection shapes, every format, decode and prefill batch sizes.

For each shape the bf16 weight is random; each format quantizes it on the GPU and runs
``quant_matmul_triton`` (tuned on first call). Limits measured in this run:

* decode (M <= 16): bytes moved (packed weight + scales + x + y) / time vs the copy bandwidth; the
  issue's bar is >= 85 % and <= 0.3x the cuBLAS bf16 time of the same shape (``vs_cublas`` = ratio).
* prefill (M >= 64): 2*M*N*K / time vs the 8192^3 bf16 matmul peak; the bar is >= 0.8x cuBLAS bf16
  TFLOP/s on the same shape (``speedup_vs_baseline`` >= 0.8).

cuBLAS bf16 (``torch.nn.functional.linear``) is the baseline of every point (its own fraction of the copy
bandwidth over the bf16 weight's bytes is ``cublas_fraction``); for the int4 formats at decode sizes
PyTorch's built-in int4 kernel (``torch._weight_int4pack_mm``, what gpt-fast and torchao use; same group
size, its bf16 scale + zero pairs) is timed too (``int4pack_ms``, ``int4pack_fraction``); gemlite (a public
Triton low-bit GEMM library) is timed in the same run when importable, for the formats it has
(int4 groups, int8/fp8 per-channel, nvfp4), else recorded as None. Decode points are timed from
CUDA graphs. By default each point runs the heuristic favourite config (the whole sweep then fits in
about two minutes, compilation included); ``--tune`` benchmarks every candidate first, as the
runtime does. ``--path`` pins the kernel path per point, several side by side (comma list):
``default`` (the above), ``dot`` (the heuristic ``tl.dot`` favourite), ``gemv`` (M <= 8: every GEMV
candidate of ``quant_gemv`` timed, the fastest recorded), ``mma`` (int4, M <= 16: likewise for the
tensor-core decode of ``quant_gemv_mma``), ``dequant`` (M > 16, weights the tuner
offers it for: every ``quant_dequant`` candidate timed, whole-weight dequantization + cuBLAS, the
fastest recorded with the dequant kernel's own time and bandwidth as ``dequant_ms`` /
``dequant_tbps``), ``frag`` (int4 / int8-g64 / nvfp4, M <= 32: the weight re-laid into the fragment layout, every candidate of
the register decode ``fragment_mma`` timed, the fastest recorded), ``frag-async`` (likewise, its configs whose
codes come through the loop's ``cp.async`` pipeline, ``num_stages >= 3``), ``frag-ksplit`` (likewise, K split over a
program's warps), ``frag-tiled`` (likewise, M > 32: the tiled
``tl.dot`` GEMM of ``fragment_tiled``), ``tuned`` (the runtime tuner over all
candidates, whichever path wins). Records carry ``path`` and ``config``. ``--l2 cold`` (decode sizes)
times ours, cuBLAS and int4pack over enough copies of the weight (>= 256 MB in all, cycled inside the
captured graph) that no launch finds its weight in the 50 MB L2, as in a model's step, where each layer's
weights were evicted since their last use; labels then end in ``l2-cold``. Run:
``python perf/bench_quant_gemm.py [--tune] [--path dot,gemv,mma,frag,frag-tiled,dequant,tuned] [--formats int4-g64,nvfp4]
[--m 1,16] [--shapes down,lm_head] [--l2 cold]``.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    bench_graph_ms,
    bench_ms,
    copy_bandwidth_tbps,
    matmul_peak_tflops,
    record,
)

from ninfer.kernels.dispatch import DEFAULT_SPLIT_SUM, pdl_enabled, split_sum_mode
from ninfer.kernels.quant_gemm import fragment_configs, quant_matmul_triton
from ninfer.kernels.quant_gemm import tune as quant_gemm_tune
from ninfer.kernels.quant_gemm.dequant import dequantize_triton, workspace
from ninfer.kernels.quant_gemm.fragment_configs import is_variant
from ninfer.kernels.quant_gemm.fragments import FRAGMENTS, fragments_fit, to_fragments
from ninfer.kernels.tuning import default_tuner
from ninfer.quant.formats import FORMATS, quantize, unpack_nibbles

H, I_FF, V = 5120, 17408, 248320
SHAPES = {  # name: (N, K) of W [N, K]
    "gate_up": (2 * I_FF, H), "down": (H, I_FF), "q_proj": (12288, H), "kv_proj": (1024, H), "o_proj": (H, 6144),
    "in_proj_qkv": (10240, H), "in_proj_z": (6144, H), "in_proj_qkvz": (16384, H), "in_proj_ab": (96, H), "lm_head": (V, H),
    "35b_in_proj_qkvz": (12288, 2048), "35b_out_proj": (2048, 4096),  # the 35B-A3B's DeltaNet projections
}
MS = (1, 2, 4, 8, 16, 64, 512, 4096)
PATHS = ("default", "dot", "gemv", "mma", "regs", "frag", "frag-async", "frag-ksplit", "frag-tiled", "dequant",
         "tuned")
COLD_BYTES = 256 << 20  # weight copies cycled per graph for an L2-cold timing (the H200's L2 is 50 MB)
GEMLITE_BUDGET_S = 40.0


def _time(fn, graph: bool, copies: int = 1) -> float:
    """Median ms; small launches replay from a CUDA graph of 20 calls (launch overhead excluded), or of a
    multiple of ``copies`` calls when ``fn`` cycles through that many copies of its weight."""
    if graph:
        return bench_graph_ms(fn, inner=copies * -(-20 // copies), warmup=5, rep=25)
    fn()
    torch.cuda.synchronize()
    return bench_ms(fn, warmup=5, rep=25)


def _int4pack(n: int, k: int, group: int) -> tuple | None:
    """Random int4 codes and scale/zero pairs in ``torch._weight_int4pack_mm``'s layout (timing baseline:
    the values do not matter, the bytes and the kernel do): ``(packed, scales_and_zeros, bytes)``."""
    try:
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        packed = torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), 8)
        sz = torch.randn(k // group, n, 2, device="cuda", dtype=torch.bfloat16) * 0.01
        return packed, sz, n * k // 2 + sz.numel() * sz.element_size()
    except Exception as err:  # noqa: BLE001  (a baseline must never stop the benchmark)
        print(f"  torch int4pack: unavailable ({type(err).__name__}: {err})")
        return None


def _config_name(cfg: quant_gemm_tune.GemmConfig) -> str:
    return (f"{cfg.kind} bm{cfg.block_m} bn{cfg.block_n} bk{cfg.block_k} split{cfg.split_k} "
            f"w{cfg.num_warps} st{cfg.num_stages}" + (f" regs{cfg.max_registers}" if cfg.max_registers else ""))


def _best(kind: str, cfgs: list[quant_gemm_tune.GemmConfig],
          time_cfg) -> tuple[float, quant_gemm_tune.GemmConfig] | None:
    """The fastest of ``cfgs`` (configs this GPU cannot run are skipped), all timings printed."""
    timings = {}
    for cfg in cfgs:
        try:
            timings[cfg] = time_cfg(cfg)
        except Exception as err:  # noqa: BLE001  (out of resources on this GPU: skip the config)
            print(f"  {kind} {_config_name(cfg)}: {type(err).__name__}")
    if not timings:
        return None
    best = min(timings, key=timings.__getitem__)
    print(f"  {kind} candidates: " + ", ".join(f"{_config_name(c)} {t:.4f} ms" for c, t in timings.items()))
    return timings[best], best


def _dequant_extra(qt, x: torch.Tensor, cfg: quant_gemm_tune.GemmConfig, weight_bytes: int) -> dict:
    """The dequant kernel alone: ms and TB/s (packed weight read + workspace written)."""
    n, k = qt.shape
    buf = workspace(n, k, x.dtype, x.device)
    ms = _time(lambda: dequantize_triton(qt, buf, cfg), False)
    moved = weight_bytes + n * k * x.element_size()
    return {"dequant_ms": round(ms, 5), "dequant_tbps": round(moved / ms / 1e9, 3)}


def _cycle(items: list):
    """A function returning the items in turn (the weight copies of an L2-cold timing)."""
    state = {"i": 0}

    def next_item():
        state["i"] += 1
        return items[(state["i"] - 1) % len(items)]
    return next_item


def _copies(items: tuple, nbytes: int, cold: bool) -> list[tuple]:
    """``items`` (tensors) and, for an L2-cold timing, clones of them: >= COLD_BYTES in all."""
    extra = max(1, -(-COLD_BYTES // nbytes)) - 1 if cold else 0
    return [items] + [tuple(t.clone() for t in items) for _ in range(extra)]


def _run_path(path: str, fmt: str, x: torch.Tensor, qt, tune: bool, cold: bool = False) -> tuple | None:
    """(ms, config[, extra record fields]) of one point on one path; None where the path does not apply
    (gemv for M > 8, mma for M > 16 or formats other than int4, frag for formats other than int4 or
    M > 32, dequant for M <= 16 or a weight too large for its workspace)."""
    m, k = x.shape
    n = qt.shape[0]
    graph = m <= quant_gemm_tune.MMA_MAX_M
    scratch = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if path in ("frag", "frag-async", "frag-ksplit", "frag-tiled"):
        if not fragments_fit(fmt, tuple(qt.shape)) or (m > quant_gemm_tune.MMA_MAX_M) != (path == "frag-tiled"):
            return None
        q, sc = to_fragments(qt.tensors["qweight"], qt.tensors["scales"])
        qt = replace(qt, tensors={**qt.tensors, "qweight": q, "scales": sc}, layout=FRAGMENTS)
    names = list(qt.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in qt.tensors.values())
    copies = [replace(qt, tensors=dict(zip(names, ts)))
              for ts in _copies(tuple(qt.tensors.values()), nbytes, cold and graph)]
    weight = _cycle(copies)

    def time_cfg(cfg: quant_gemm_tune.GemmConfig) -> float:
        return _time(lambda: quant_matmul_triton(x, weight(), out=scratch, config=cfg), graph, len(copies))

    sms = quant_gemm_tune.sm_count(x.device)
    if path == "frag":  # the register decode's own configs, whatever the variant switches say
        return _best("frag", [c for c in quant_gemm_tune.fragment_candidates(fmt, m, n, k, sms) if not is_variant(c)],
                     time_cfg)
    if path == "frag-async":  # its codes through the loop's cp.async pipeline
        return _best("frag-async", fragment_configs.fragment_async_candidates(fmt, m, n, k, sms), time_cfg)
    if path == "frag-ksplit":  # K split over a program's warps, no partial sums through global memory
        return _best("frag-ksplit", fragment_configs.fragment_ksplit_candidates(fmt, m, n, k), time_cfg)
    if path == "frag-tiled":
        return _best("frag-tiled", quant_gemm_tune.tiled_fragment_candidates(fmt, m, n, k, sms), time_cfg)
    if path == "dot":
        cfg = quant_gemm_tune.candidates(fmt, m, n, k, sms)[0]
        return time_cfg(cfg), cfg
    if path == "gemv":
        if m > quant_gemm_tune.GEMV_MAX_M:
            return None
        return _best("gemv", quant_gemm_tune.gemv_candidates(fmt, m, n, k, sms), time_cfg)
    if path == "mma":
        cfgs = quant_gemm_tune.mma_candidates(fmt, m, n, k, sms, max_registers=0)
        return _best("gemv-mma", cfgs, time_cfg) if cfgs else None
    if path == "regs":  # the tensor-core decode's configs under a register cap (more programs per SM)
        cfgs = [c for cap in (128, 96) for c in quant_gemm_tune.mma_candidates(fmt, m, n, k, sms, max_registers=cap)]
        return _best("gemv-mma-regs", cfgs, time_cfg) if cfgs else None
    if path == "dequant":
        cfgs = [c for c in quant_gemm_tune.candidates(fmt, m, n, k, sms) if c.kind == "dequant"]
        point = _best("dequant", cfgs, time_cfg) if cfgs else None
        if point is None:
            return None
        weight_bytes = sum(t.numel() * t.element_size() for t in qt.tensors.values())
        return (*point, _dequant_extra(qt, x, point[1], weight_bytes))
    tuner = default_tuner()
    saved = tuner.enabled
    tuner.enabled = tune if path == "default" else True
    try:
        cfg = quant_gemm_tune.select_config(
            fmt, x, n, k, False, False, lambda c: quant_matmul_triton(x, qt, out=scratch, config=c))
    finally:
        tuner.enabled = saved
    return time_cfg(cfg), cfg


def _gemlite_layer(fmt: str, qt, w: torch.Tensor):
    """A gemlite layer holding the same weight in gemlite's closest format, or None."""
    try:
        from gemlite import helper
    except ImportError:
        return None
    try:
        if fmt.startswith("int4"):
            group = int(fmt.split("-g")[1])
            codes = unpack_nibbles(qt.tensors["qweight"])
            scales = qt.tensors["scales"].to(torch.bfloat16)
            return helper.A16Wn(device="cuda", dtype=torch.bfloat16).from_weights(
                codes, scales, torch.full_like(scales, 8), W_nbits=4, group_size=group)
        if fmt == "nvfp4":
            return helper.A16W4_NVFP(device="cuda", dtype=torch.bfloat16).from_packed_weights(
                qt.tensors["qweight"], scales=qt.tensors["scales"], meta_scale=1.0 / qt.tensors["global_scale"][0])
        if fmt.startswith("int8"):  # gemlite's int8 is per channel, not grouped
            return helper.A16W8_INT8(device="cuda", dtype=torch.bfloat16).from_weights(w.clone())
        if fmt == "fp8":
            return helper.A16W8_FP8(device="cuda", dtype=torch.bfloat16).from_weights(w.clone())
    except Exception as err:  # noqa: BLE001  (a baseline must never stop the benchmark)
        print(f"  gemlite {fmt}: unavailable ({type(err).__name__}: {err})")
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=",".join(f for f in FORMATS if f != "bf16"))
    parser.add_argument("--m", default=",".join(map(str, MS)))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--no-gemlite", action="store_true")
    parser.add_argument("--gemlite-budget", type=float, default=GEMLITE_BUDGET_S,
                        help="seconds of gemlite set-up and timing before its baseline is skipped")
    parser.add_argument("--tune", action="store_true", help="benchmark every candidate config per key first")
    parser.add_argument("--path", default="default",
                        help=f"comma list of kernel paths to time per point: {', '.join(PATHS)}")
    parser.add_argument("--l2", choices=("warm", "cold"), default="warm",
                        help="decode sizes: time one weight (warm: it may sit in L2) or cycle through copies (cold)")
    args = parser.parse_args()
    paths = [p for p in PATHS if p in args.path.split(",")]  # default before tuned: tuning is cached
    if not set(args.path.split(",")) <= set(PATHS):
        parser.error(f"--path takes {', '.join(PATHS)}; got {args.path}")
    formats, ms, shapes = args.formats.split(","), [int(m) for m in args.m.split(",")], args.shapes.split(",")
    try:
        import gemlite

        use_gemlite = not args.no_gemlite
        if "H200" in torch.cuda.get_device_name():  # same chip as H100: reuse gemlite's shipped tunings
            gemlite.load_config(str(Path(gemlite.__file__).parent / "configs" / "h100.json"))
    except ImportError:
        print("gemlite is not installed: its baseline is recorded as None")
        use_gemlite = False
    pdl = pdl_enabled(torch.device("cuda"))  # the fragment decode's programmatic dependent launch (NINFER_PDL)
    bw, peak = copy_bandwidth_tbps(), matmul_peak_tflops()
    print(f"copy bandwidth {bw:.2f} TB/s, bf16 matmul peak {peak:.0f} TFLOP/s")
    start, gemlite_s = time.time(), 0.0
    torch.manual_seed(0)
    for shape in shapes:
        n, k = SHAPES[shape]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in ms}
        cold = args.l2 == "cold"
        dense = _cycle(ws := _copies((w,), 2 * n * k, cold))
        cublas = {m: _time(lambda x=xs[m]: F.linear(x, dense()[0]), m <= 32, len(ws)) for m in ms}
        gemlite_ms: dict[tuple[str, int], float | None] = {}  # int8-g32 and -g64 share gemlite's int8
        for fmt in formats:
            qt = quantize(w, fmt)
            weight_bytes = sum(t.numel() * t.element_size() for t in qt.tensors.values())
            kind = fmt.split("-g")[0] if fmt.startswith("int8") else fmt
            group = int(fmt.split("-g")[1]) if fmt.startswith("int4-g") else 0
            tiny = _int4pack(n, k, group) if group and min(ms) <= 16 else None
            glayer = None
            if use_gemlite and gemlite_s < args.gemlite_budget and (kind, ms[0]) not in gemlite_ms:
                glayer = _gemlite_layer(fmt, qt, w)
            for m in ms:
                x = xs[m]
                points = {path: _run_path(path, fmt, x, qt, args.tune, cold) for path in paths}
                if glayer is not None and gemlite_s < args.gemlite_budget:
                    t0 = time.time()
                    try:
                        gemlite_ms[kind, m] = _time(lambda x=x, layer=glayer: layer(x), m <= 16)
                    except Exception as err:  # noqa: BLE001
                        print(f"  gemlite {fmt} M={m}: failed ({type(err).__name__}: {err})")
                    gemlite_s += time.time() - t0
                flops = 2 * m * n * k
                pack_ms = pack_frac = None
                if tiny is not None and m <= 16:
                    packs = _cycle(pack_copies := _copies(tiny[:2], tiny[2], cold))
                    pack_ms = _time(lambda x=x: torch._weight_int4pack_mm(x, (p := packs())[0], group, p[1]), True,
                                    len(pack_copies))
                    pack_frac = round((tiny[2] + 2 * m * (n + k)) / pack_ms / 1e9 / bw, 4)
                decode = m <= quant_gemm_tune.MMA_MAX_M
                cublas_frac = round((2 * n * k + 2 * m * (n + k)) / cublas[m] / 1e9 / bw, 4) if decode else None
                for path, point in points.items():
                    if point is None:
                        continue
                    ms_ours, cfg, *more = point
                    if decode:
                        moved = weight_bytes + 2 * m * (n + k)
                        achieved, limit, unit = moved / ms_ours / 1e9, bw, "TB/s"
                    else:
                        achieved, limit, unit = flops / ms_ours / 1e9, peak, "TFLOP/s"
                    label = f"{shape} N={n} K={k} M={m} {fmt}" + ("" if path == "default" else f" [{path}]") \
                        + (" l2-cold" if cold and decode else "") + (" pdl" if path.startswith("frag") and pdl else "") \
                        + (f" split-{split_sum_mode()}" if path == "frag" and split_sum_mode() != DEFAULT_SPLIT_SUM else "")
                    record("quant_gemm", label, ms_ours, achieved=achieved, limit=limit,
                           unit=unit, baseline="cublas_bf16", baseline_ms=cublas[m], format=fmt, m=m, n=n, k=k,
                           weight_bytes=weight_bytes, vs_cublas=round(ms_ours / cublas[m], 4),
                           cublas_tflops=round(flops / cublas[m] / 1e9, 2), gemlite_ms=gemlite_ms.get((kind, m)),
                           path=path, config=_config_name(cfg), cublas_fraction=cublas_frac,
                           int4pack_ms=None if pack_ms is None else round(pack_ms, 5), int4pack_fraction=pack_frac,
                           **(more[0] if more else {}))
                    if pack_ms is not None and path == paths[-1]:
                        print(f"    cuBLAS bf16 {100 * cublas_frac:.1f}% of copy BW; torch int4pack {pack_ms:.4f} ms "
                              f"({100 * pack_frac:.1f}%)")
        torch.cuda.empty_cache()
    tuned = len(default_tuner().chosen(quant_gemm_tune.TABLE))
    print(f"done in {time.time() - start:.0f} s ({tuned} tuned keys; gemlite {gemlite_s:.0f} s)")


if __name__ == "__main__":
    main()
