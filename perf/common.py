"""Shared benchmark plumbing: ceilings measured in the same run, timing, and JSON records.

Every benchmark measures the copy bandwidth (and the bf16 matmul peak when it reports FLOP
rates) at its start, times with ``triton.testing.do_bench`` (median), and appends one JSON line
per measured point to ``$OUT/perf.jsonl`` (or ``perf/results/latest.jsonl`` when ``OUT`` is unset).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import signal
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch


def results_path() -> Path:
    out = os.environ.get("OUT")
    path = Path(out) / "perf.jsonl" if out else Path(__file__).parent / "results" / "latest.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def bench_ms(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` (compilation and autotuning happen in the warm-up)."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph_ms(fn: Callable[[], Any], inner: int = 20, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of one ``fn`` call, replayed from a CUDA graph of ``inner`` calls (for tiny launches)."""
    fn()  # compile / autotune outside the graph
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return bench_ms(graph.replay, warmup=warmup, rep=rep) / inner


@lru_cache(maxsize=None)
def copy_bandwidth_tbps() -> float:
    """Device-to-device copy of 4 GiB: (bytes read + bytes written) / time, in TB/s."""
    src = torch.empty(2 ** 31, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), warmup=5, rep=30)
    nbytes = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / ms / 1e9


@lru_cache(maxsize=None)
def matmul_peak_tflops() -> float:
    """bf16 8192^3 matmul through torch (cuBLAS), in TFLOP/s."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = bench_ms(lambda: a @ b, warmup=10, rep=50)
    return 2 * 8192 ** 3 / ms / 1e9


COMMIT_FILE = Path(__file__).parents[1] / ".commit"


def source_commit() -> str:
    """The commit the measured code is: ``.commit`` at the checkout's root where a copy without its git history
    carries one (``perf/snapshot.sh`` writes it; a device call's copy may hold another repository's history),
    else ``git rev-parse``, else "unknown"."""
    if COMMIT_FILE.is_file():
        return COMMIT_FILE.read_text().strip() or "unknown"
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


@lru_cache(maxsize=None)
def environment() -> dict[str, str]:
    import triton

    commit = source_commit()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA device)"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit, "date": _dt.date.today().isoformat()}


def record(bench: str, shape: str, median_ms: float, *, achieved: float, limit: float, unit: str,
           baseline: str | None = None, baseline_ms: float | None = None, **extra: Any) -> dict[str, Any]:
    """Append one measured point and print it as a readable line."""
    row = {"bench": bench, "shape": shape, "median_ms": round(median_ms, 5), "achieved": round(achieved, 4),
           "unit": unit, "limit": round(limit, 4), "fraction_of_limit": round(achieved / limit, 4),
           "baseline": baseline, "baseline_ms": None if baseline_ms is None else round(baseline_ms, 5),
           "speedup_vs_baseline": None if not baseline_ms else round(baseline_ms / median_ms, 3),
           **extra, **environment()}
    with results_path().open("a") as f:
        f.write(json.dumps(row) + "\n")
    base = f" | {baseline} {baseline_ms:.4f} ms ({row['speedup_vs_baseline']}x)" if baseline_ms else ""
    print(f"{bench:28s} {shape:40s} {median_ms:9.4f} ms  {achieved:8.3f} {unit} "
          f"({100 * row['fraction_of_limit']:5.1f}% of limit){base}", flush=True)
    return row


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued device work (a no-op on CPU), so host timers measure it."""
    if torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth_for(device: torch.device | str) -> float:
    """:func:`copy_bandwidth_tbps` on CUDA; on CPU (smoke tests only) a 64 MiB host copy timed the same way."""
    if torch.device(device).type == "cuda":
        return copy_bandwidth_tbps()
    import time

    src = torch.empty(2 ** 25, dtype=torch.int16).random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / sorted(times)[2] / 1e12


def export_tuning(device: torch.device | str) -> None:
    """With ``NINFER_EXPORT_TUNING=<path>``: merge this process's tuning choices on ``device`` into that file
    (``ninfer.kernels.shipped_export``; the raw material of the shipped per-GPU tables, ``perf/ship_tuning.py``).
    Benchmarks call it at their end, when every key of the run has been met."""
    path = os.environ.get("NINFER_EXPORT_TUNING", "").strip()
    if not path:
        return
    device = torch.device(device)
    if device.type != "cuda":
        print(f"tuning export to {path} skipped: {device} is not a CUDA device", flush=True)
        return
    untimed = [f"{name}={os.environ[name]}" for name, off in (("NINFER_AUTOTUNE", "off"), ("NINFER_QUANT_TUNE", "0"))
               if os.environ.get(name) == off]
    if untimed:  # the first candidates were taken, not measured: nothing to ship
        print(f"tuning export to {path} skipped: {', '.join(untimed)} (untimed choices)", flush=True)
        return
    from ninfer.kernels import shipped, shipped_export

    doc = shipped_export.export(path, device, meta={"commit": environment()["commit"]})
    counts = ", ".join(f"{name} {n}" for name, n in shipped.counts(doc).items()) or "no entries"
    print(f"tuning choices exported to {path} ({doc['meta']['gpu']}): {counts}", flush=True)


def export_tuning_on_timeout(device: torch.device | str) -> None:
    """With ``NINFER_EXPORT_TUNING``: export the choices made so far when the runbook's ``timeout`` stops this
    process (SIGTERM), so that a run cut by its limit still leaves the keys it tuned for the shipped table."""
    if not os.environ.get("NINFER_EXPORT_TUNING", "").strip():
        return

    def on_term(signum: int, frame: Any) -> None:
        print("stopped by SIGTERM: exporting the tuning choices made so far", flush=True)
        export_tuning(device)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)


def check_target(name: str, measured: float, target: float, unit: str) -> dict[str, Any]:
    """Print an issue target next to the measured value; returns fields to add to the record."""
    status = "met" if measured >= target else "MISSED"
    print(f"    target {name}: >= {target:g} {unit}, measured {measured:.4g} {unit} -> {status}", flush=True)
    return {f"target_{name}": target, f"target_{name}_met": measured >= target}
