"""Where the int4 decode GEMM loses its bandwidth: streaming ceilings and a tile-contiguous weight layout.

Three kinds of kernel read the same packed int4 weights (random bytes) and are timed from CUDA-graph replays
that cycle through enough weight copies (>= 256 MB) that nothing is served from L2:

* ``stream``: the packed bytes only (xor-folded into one word per row): what a Triton kernel with this
  program shape can pull from HBM at all, with the checkpoint's row-major layout (``rows``) or with every
  ``[BLOCK_N, BLOCK_K]`` tile stored contiguously (``tiles``);
* ``mma``: the shipped tensor-core decode (``gemv_mma``) at given configs (row-major);
* ``mma-tiles``: the same kernel body reading the tile-contiguous layout.

``DISABLE_MMA_V3=1`` in the environment makes Triton emit ``mma.sync`` instead of wgmma for 4-warp programs;
run once with and once without (and a separate ``TRITON_CACHE_DIR``) to compare. Prints one line per point
and writes records (``bench: probe_gemv``).

    python perf/probe_gemv_layout.py [--quick]
"""
from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl

from common import bench_graph_ms, copy_bandwidth_tbps, record
from ninfer.kernels.quant_gemm.gemv_mma import launch_gemv_mma
from ninfer.kernels.quant_gemm.tune import GemmConfig
from probe_gemv_kernels import GROUP, _stream_kernel, launch_3d, launch_ablate, launch_tiles, to_tiles
from probe_gemv_registers import frag_weights, frag_x, launch_frag, launch_w4a8, quantize_x, w4a8_reference

SHAPES = {  # name: (rows of the stored weight, K, SwiGLU)
    "gate_up": (34816, 5120, True),
    "down": (5120, 17408, False),
    "qkvz": (16384, 5120, False),
}


def time_stream(qs: list[torch.Tensor], n: int, k: int, tiled: bool, bn: int, bkw: int, unroll: int,
                warps: int, split: int) -> float:
    kw = k // 8
    per = kw // split
    out = torch.empty(split, n, dtype=torch.int32, device="cuda")
    state = {"i": 0}

    def run() -> None:
        q = qs[state["i"] % len(qs)]
        state["i"] += 1
        _stream_kernel[(n // bn, split)](q, out, n, kw, per, TILED=tiled, BLOCK_N=bn, BLOCK_KW=bkw,
                                         UNROLL=unroll, num_warps=warps)
    return bench_graph_ms(run, inner=len(qs) * 4)


def ablations(which: list[int]) -> None:
    """The shipped config of each shape with one part of the work taken out at a time."""
    bw = copy_bandwidth_tbps()
    picks = {"gate_up": [GemmConfig(8, 128, 256, 4, 2, 3, "gemv-mma"), GemmConfig(8, 64, 128, 8, 2, 4, "gemv-mma")],
             "down": [GemmConfig(8, 128, 256, 14, 2, 3, "gemv-mma"), GemmConfig(8, 64, 128, 14, 2, 4, "gemv-mma")],
             "qkvz": [GemmConfig(8, 64, 128, 4, 2, 4, "gemv-mma")]}
    for name, (n, k, swiglu) in SHAPES.items():
        nbytes = n * k // 2
        reps = copies(nbytes)
        qs = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda") for _ in range(reps)]
        scales = [torch.rand(n, k // GROUP, device="cuda", dtype=torch.bfloat16) * 0.01 for _ in range(reps)]
        scales_t = [sc.t().contiguous() for sc in scales]  # [groups, N]
        n_out = n // 2 if swiglu else n
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n_out, device="cuda", dtype=torch.bfloat16)
            if 6 in which:  # the transposed scales give the shipped kernel's answer
                launch_gemv_mma(x, qs[0], scales[0], None, out, swiglu, GROUP, picks[name][0])
                ref = out.clone()
                launch_ablate(x, qs[0], scales_t[0], out, swiglu, picks[name][0], 6)
                torch.cuda.synchronize()
                print(f"  {name} M={m} transposed scales: max diff {(out.float() - ref.float()).abs().max().item():.3e}")
            for cfg in picks[name]:
                for ablate in which:
                    if ablate == 5 and cfg.block_k != 2 * GROUP:
                        continue
                    state = {"i": 0}

                    def run(cfg=cfg, ablate=ablate) -> None:
                        i = state["i"] % len(qs)
                        state["i"] += 1
                        if ablate < 0:
                            launch_gemv_mma(x, qs[i], scales[i], None, out, swiglu, GROUP, cfg)
                        elif ablate == 6:
                            launch_ablate(x, qs[i], scales_t[i], out, swiglu, cfg, ablate)
                        else:
                            launch_ablate(x, qs[i], scales[i], out, swiglu, cfg, ablate)
                    what = {-1: "shipped", 0: "copy", 1: "no-decode", 2: "no-scale", 4: "x-once", 5: "wide", 6: "scales-T"}[ablate]
                    label = (f"{name} M={m} ablate {what} bn{cfg.block_n} bk{cfg.block_k} s{cfg.split_k} "
                             f"w{cfg.num_warps} st{cfg.num_stages}")
                    try:
                        ms = bench_graph_ms(run, inner=len(qs) * 4)
                    except Exception as err:  # noqa: BLE001
                        print(f"{label}: {type(err).__name__}: {str(err)[:160]}")
                        continue
                    wbytes = nbytes + n * (k // GROUP) * 2
                    record("probe_gemv", label, ms, achieved=wbytes / ms / 1e9, limit=bw, unit="TB/s")
        del qs, scales
        torch.cuda.empty_cache()


def w4a8(configs: str, shapes: list[str]) -> None:
    """The int4 x int8 dp4a GEMV against the shipped tensor-core decode (bf16 activations), M = 1 / 2 / 4."""
    bw = copy_bandwidth_tbps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (n, k, swiglu) in SHAPES.items():
        if name not in shapes:
            continue
        nbytes = n * k // 2
        reps = copies(nbytes)
        qs = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda") for _ in range(reps)]
        scales = [torch.rand(n, k // GROUP, device="cuda", dtype=torch.bfloat16) * 0.01 for _ in range(reps)]
        for m in (1, 2, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq = quantize_x(x)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = w4a8_reference(qs[0], scales[0], x)
            exact = (torch.stack([qs[0] & 0xF, qs[0] >> 4], -1).view(n, k).float() - 8).view(n, -1, GROUP) \
                * scales[0].float()[..., None]
            exact = x.float() @ exact.view(n, k).t()
            for item in configs.split(","):
                bn, bk, warps, per_sm = (int(v) for v in item.split("x"))
                tiles = triton.cdiv(n, bn)
                steps = k // bk
                split = 1 if tiles >= per_sm * sms else max(1, min(triton.cdiv(per_sm * sms, tiles), steps, 64))
                while steps % split and split > 1:
                    split -= 1
                cfg = GemmConfig(m, bn, bk, split, warps, 1, "w4a8")
                label = f"{name} M={m} w4a8 bn{bn} bk{bk} s{split} w{warps}"
                state = {"i": 0}

                def run(cfg=cfg) -> None:
                    i = state["i"] % len(qs)
                    state["i"] += 1
                    launch_w4a8(xq, qs[i], scales[i], out, cfg)
                try:
                    out.fill_(float("nan"))
                    launch_w4a8(xq, qs[0], scales[0], out, cfg)
                    torch.cuda.synchronize()
                    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                    a8 = ((ref - exact.double()).norm() / exact.double().norm()).item()
                    ms = bench_graph_ms(run, inner=len(qs) * 4)
                except Exception as exc:  # noqa: BLE001
                    print(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                print(f"  {label}: kernel vs its reference max rel {err:.2e}; int8-x vs bf16-x rel {a8:.2e}")
                wbytes = nbytes + n * (k // GROUP) * 2
                record("probe_gemv", label, ms, achieved=wbytes / ms / 1e9, limit=bw, unit="TB/s")
        del qs, scales
        torch.cuda.empty_cache()


def frag(configs: str, shapes: list[str]) -> None:
    """The register-fragment decode (no shared memory on the weight path) at M = 1 / 8 against an fp32 reference."""
    bw = copy_bandwidth_tbps()
    for name, (n, k, _swiglu) in SHAPES.items():
        if name not in shapes:
            continue
        nbytes = n * k // 2
        reps = copies(nbytes)
        packed = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda") for _ in range(reps)]
        qs = [frag_weights(q) for q in packed]
        scales = [torch.rand(n, k // GROUP, device="cuda", dtype=torch.bfloat16) * 0.01 for _ in range(reps)]
        codes = torch.stack([packed[0] & 0xF, packed[0] >> 4], dim=-1).view(n, k).float() - 8
        w0 = (codes.view(n, -1, GROUP) * scales[0].float()[..., None]).view(n, k)
        del codes
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xf = frag_x(x)
            want = x.float() @ w0.t()
            out = torch.empty(m, n, device="cuda", dtype=torch.float32)
            for item in configs.split(","):
                warps, split = (int(v) for v in item.split("x"))
                kc = k // 64
                if kc % split or (kc // split) % 2 or n % (16 * warps):
                    continue
                label = f"{name} M={m} frag w{warps} s{split}"
                state = {"i": 0}

                def run(warps=warps, split=split) -> None:
                    i = state["i"] % len(qs)
                    state["i"] += 1
                    launch_frag(xf, m, qs[i], scales[i], out, warps, split)
                try:
                    launch_frag(xf, m, qs[0], scales[0], out, warps, split)
                    torch.cuda.synchronize()
                    err = ((out - want).abs().max() / want.abs().max()).item()
                    ms = bench_graph_ms(run, inner=len(qs) * 4)
                except Exception as exc:  # noqa: BLE001
                    print(f"{label}: {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                print(f"  {label}: max error / max |y| = {err:.2e}")
                wbytes = nbytes + n * (k // GROUP) * 2
                record("probe_gemv", label, ms, achieved=wbytes / ms / 1e9, limit=bw, unit="TB/s")
        del qs, scales, packed, w0
        torch.cuda.empty_cache()


def copies(nbytes: int) -> int:
    return max(2, -(-256 * 2 ** 20 // nbytes))


def mma_configs(n_out: int, k: int, swiglu: bool, quick: bool, spec: str = "") -> list[GemmConfig]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if spec:  # "BNxBKxWxST[xPER_SM],..."
        out = []
        for item in spec.split(","):
            bn, bk, warps, stages, *per = (int(v) for v in item.split("x"))
            tiles = triton.cdiv(n_out, bn)
            per_sm = per[0] if per else 8
            split = 1 if tiles >= per_sm * sms else max(1, min(triton.cdiv(per_sm * sms, tiles), k // bk, 64))
            while (k // bk) % split and split > 1:
                split -= 1
            out.append(GemmConfig(8, bn, bk, split, warps, stages, "gemv-mma"))
        return out
    shapes = [(64, 128, 2, 4), (128, 128, 2, 4), (128, 128, 4, 4), (128, 256, 4, 3), (128, 128, 8, 3),
              (256, 128, 8, 3), (64, 256, 2, 3), (256, 256, 8, 2), (128, 256, 8, 3), (64, 128, 4, 4)]
    if quick:
        shapes = shapes[:6]
    out = []
    for bn, bk, warps, stages in shapes:
        if swiglu and bn > 128:
            continue
        tiles = triton.cdiv(n_out, bn)
        for per_sm in ((8,) if quick else (4, 8)):
            split = 1 if tiles >= per_sm * sms else max(1, min(triton.cdiv(per_sm * sms, tiles), k // bk, 64))
            cfg = GemmConfig(8, bn, bk, split, warps, stages, "gemv-mma")
            if cfg not in out:
                out.append(cfg)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer configs")
    parser.add_argument("--configs", default="", help="mma configs BNxBKxWxST[xPER_SM],... (rows / 3d-rows only)")
    parser.add_argument("--stream-configs", default="", help="stream configs BNxBKWxUNROLLxWARPS,...")
    parser.add_argument("--ablate", default="-1,0,1,2,4", help="ablations to run (5: one load per K step)")
    parser.add_argument("--w4a8-configs", default="32x256x4x8,64x256x4x8,16x512x4x8,32x512x8x8,64x128x4x16",
                        help="dp4a GEMV configs BNxBKxWARPSxPER_SM,...")
    parser.add_argument("--frag-configs", default="4x1,4x2,4x4,8x1,8x2,8x4,4x8,8x8,4x16,4x17,8x17,4x34",
                        help="register-fragment decode configs WARPSxSPLIT,...")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    parser.add_argument("--parts", default="stream,mma", help="comma list of stream, mma, ablate")
    args = parser.parse_args()
    tag = "nov3" if os.environ.get("DISABLE_MMA_V3") == "1" else "v3"
    bw = copy_bandwidth_tbps()
    print(f"copy bandwidth {bw:.3f} TB/s; DISABLE_MMA_V3={os.environ.get('DISABLE_MMA_V3', '')}")
    parts = set(args.parts.split(","))
    if "frag" in parts:
        frag(args.frag_configs, args.shapes.split(","))
    if "w4a8" in parts:
        w4a8(args.w4a8_configs, args.shapes.split(","))
    if "ablate" in parts:
        ablations([int(a) for a in args.ablate.split(",")])
    for name, (n, k, swiglu) in SHAPES.items():
        if name not in args.shapes.split(","):
            continue
        nbytes = n * k // 2
        reps = copies(nbytes)
        qs8 = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda") for _ in range(reps)]
        if "stream" in parts and tag == "v3":
            stream_cfgs = [(16, 64, 1, 4), (32, 64, 1, 4), (32, 64, 2, 4), (64, 32, 2, 4),
                           (64, 64, 1, 8), (32, 128, 1, 8), (128, 32, 2, 8), (16, 128, 2, 4)]
            if args.stream_configs:
                stream_cfgs = [tuple(int(v) for v in c.split("x")) for c in args.stream_configs.split(",")]
            for bn, bkw, unroll, warps in stream_cfgs:
                for tiled in (False, True):
                    sms = torch.cuda.get_device_properties(0).multi_processor_count
                    tiles = n // bn
                    split = max(1, min(triton.cdiv(8 * sms, tiles), (k // 8) // (bkw * unroll)))
                    while split > 1 and (k // 8) % (split * bkw * unroll):
                        split -= 1
                    if (k // 8) % (split * bkw * unroll):
                        continue
                    qs = [q.view(torch.int32) for q in qs8]
                    if tiled:
                        qs = [to_tiles(q, bn, bkw * 8).view(torch.int32) for q in qs8]
                    ms = time_stream(qs, n, k, tiled, bn, bkw, unroll, warps, split)
                    label = f"{name} stream {'tiles' if tiled else 'rows'} bn{bn} bkw{bkw} u{unroll} w{warps} s{split}"
                    record("probe_gemv", label, ms, achieved=nbytes / ms / 1e9, limit=bw, unit="TB/s")
        if "mma" not in parts:
            continue
        n_out = n // 2 if swiglu else n
        scales = [torch.rand(n, k // GROUP, device="cuda", dtype=torch.bfloat16) * 0.01 for _ in range(reps)]
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n_out, device="cuda", dtype=torch.bfloat16)
            for cfg in mma_configs(n_out, k, swiglu, args.quick, args.configs):
                layouts = ("rows", "tiles") if cfg.num_warps < 4 else ("rows", "3d-rows", "3d-tiles")
                if args.configs:
                    layouts = ("rows", "tiles") if cfg.num_warps < 4 else ("3d-rows", "3d-tiles")
                if tag == "nov3":
                    layouts = ("rows",) if cfg.num_warps >= 4 else ()
                for layout in layouts:
                    if layout.endswith("tiles"):
                        qs = [to_tiles(q, cfg.block_n, cfg.block_k) for q in qs8]
                    else:
                        qs = qs8
                    state = {"i": 0}

                    def run(qs=qs, layout=layout, cfg=cfg) -> None:
                        i = state["i"] % len(qs)
                        state["i"] += 1
                        if layout == "rows":
                            launch_gemv_mma(x, qs[i], scales[i], None, out, swiglu, GROUP, cfg)
                        elif layout == "tiles":
                            launch_tiles(x, qs[i], scales[i], out, swiglu, cfg)
                        else:
                            launch_3d(x, qs[i], scales[i], out, swiglu, cfg, layout == "3d-tiles")
                    label = (f"{name} M={m} mma-{layout} {tag} bn{cfg.block_n} bk{cfg.block_k} s{cfg.split_k} "
                             f"w{cfg.num_warps} st{cfg.num_stages}")
                    try:
                        if layout != "rows":  # the same answer as the row-major kernel
                            launch_gemv_mma(x, qs8[0], scales[0], None, out, swiglu, GROUP, cfg)
                            ref = out.clone()
                            out.fill_(float("nan"))
                            state["i"] = 0
                            run()
                            state["i"] = 0
                            torch.cuda.synchronize()
                            if not torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2):
                                print(f"{label}: MISMATCH max {(out.float() - ref.float()).abs().max().item()}")
                                continue
                        ms = bench_graph_ms(run, inner=len(qs) * 4)
                    except Exception as err:  # noqa: BLE001  (a config this GPU cannot run)
                        print(f"{label}: {type(err).__name__}: {str(err)[:120]}")
                        continue
                    wbytes = nbytes + n * (k // GROUP) * 2
                    record("probe_gemv", label, ms, achieved=wbytes / ms / 1e9, limit=bw, unit="TB/s")
            # cuBLAS bf16 on the same shape, for the fraction it reaches
            if m == 1 and not args.configs:
                ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, copies(2 * n * k)))]
                st = {"i": 0}
                y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

                def cublas() -> None:
                    torch.mm(x, ws[st["i"] % len(ws)].t(), out=y)
                    st["i"] += 1
                ms = bench_graph_ms(cublas, inner=len(ws) * 4)
                print(f"{name} M={m} cublas-bf16: {ms * 1e3:.1f} us {2 * n * k / ms / 1e9 / bw:.1%}")
                record("probe_gemv", f"{name} M={m} cublas-bf16", ms, achieved=2 * n * k / ms / 1e9, limit=bw,
                       unit="TB/s")
                del ws
        del scales
        del qs8
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
