"""How the quantized GEMM's tuner times its candidates: decode sizes from CUDA-graph replays (as the engine runs
them), prefill sizes eagerly; nothing in a parallel-compile dry pass (:mod:`ninfer.kernels.precompile`).

L2-cold timing (``NINFER_TUNE_L2_COLD``): each replayed launch after a read of twice the L2's size, so that it finds
its weights in DRAM as in a model's step (each layer's weights were evicted since their last use), the sweep's own
time, measured alongside, subtracted. 20 launches of one candidate back to back otherwise read weights of up to
~50 MB from L2. ``experts`` (the default) times the MoE expert GEMMs so: one token's eight experts (8 MB of int4
gate/up) are L2-resident in a warm timing, and the L2-cold choice made a 35B-A3B block (router and experts) 13%
faster at one token on an H100 (23.8 -> 20.7 us, run 2026-12-06.4, the same at 2-8 tokens). ``all`` times every
decode tuner so; the dense projections did not gain (the subtracted sweep is noisier than a kernel of 5-10 us: it
chose 9-14% slower configs for the 35B-A3B out_proj, 7-16% faster ones for its qkv at 8 tokens). ``none``: warm.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import triton

from ninfer.kernels.precompile import dry_pass_active

L2_COLD_ENV = "NINFER_TUNE_L2_COLD"
L2_COLD_CHOICES = ("experts", "all", "none")


def l2_cold(experts: bool = False) -> bool:
    """Whether a tuner times its decode candidates with their weights evicted from L2 (``NINFER_TUNE_L2_COLD``, read
    now: ``experts``, the default, for the MoE expert GEMMs' tuner (``experts=True``) only; ``all``; ``none``)."""
    value = os.environ.get(L2_COLD_ENV, "").strip().lower() or "experts"
    if value not in L2_COLD_CHOICES:
        raise ValueError(f"{L2_COLD_ENV}={os.environ[L2_COLD_ENV]!r}: expected one of {', '.join(L2_COLD_CHOICES)}")
    return value == "all" or (experts and value == "experts")


def time_candidates(cands: list[Any], launch: Callable[[Any], None], graphs: bool,
                    cold: bool | None = None) -> dict[Any, float]:
    """Milliseconds per launch of each candidate that fits the GPU (``cold``: decode sizes L2-cold, default
    :func:`l2_cold`).

    Decode-sized calls (``graphs``) are timed from CUDA-graph replays, as the engine runs them: their
    kernels take 5-50 µs, less than Python needs to launch them, so eager timing measured the launch
    overhead instead (it made the tuner prefer one-launch ``tl.dot`` configs over two-launch split-K
    GEMVs that are up to 2x faster on the GPU). Falls back to eager timing if a capture fails."""
    timings: dict[Any, float] = {}
    for cfg in cands:
        try:
            fn = lambda cfg=cfg: launch(cfg)  # noqa: E731
            timings[cfg] = graph_ms(fn, cold=cold) if graphs else triton.testing.do_bench(fn, warmup=5, rep=20)
        except triton.runtime.errors.OutOfResources:
            continue  # too much shared memory or too many registers on this GPU
        except RuntimeError:  # a capture that failed: time every candidate the same (eager) way
            if not graphs:
                raise
            torch.cuda.synchronize()
            return time_candidates(cands, launch, graphs=False)  # eager: L2-warm, as before
    return timings


def graph_ms(fn: Callable[[], None], launches: int = 20, replays: int = 5, cold: bool | None = None) -> float:
    """Median time per call of ``fn`` over replays of a graph of ``launches`` back-to-back calls (0.0 in a
    parallel-compile dry pass, whose launches run nothing: one call requests the kernel, as its ``do_bench``).
    ``cold`` (default :func:`l2_cold`): each call after an L2-evicting read, whose own time is subtracted."""
    fn()  # compile and allocate outside the capture
    if dry_pass_active():
        return 0.0
    if cold if cold is not None else l2_cold():
        # Twice the L2's size of other bytes, read (not written: no dirty lines to write back while the timed
        # launch runs), so nothing read before is still in L2. Allocated per call, not kept: a start tunes after
        # the KV pool took all but a headroom of the GPU's memory.
        sweep = torch.empty(2 * _l2_bytes(torch.cuda.current_device()) // 4, dtype=torch.float32, device="cuda")
        evict = lambda: torch.amax(sweep)  # noqa: E731
        return max(_replayed_ms(lambda: (evict(), fn()), launches, replays) - _replayed_ms(evict, launches, replays),
                   0.0)
    return _replayed_ms(fn, launches, replays)


@cache
def _l2_bytes(device: int) -> int:
    return max(torch.cuda.get_device_properties(device).L2_cache_size, 32 << 20)


def _replayed_ms(fn: Callable[[], Any], launches: int, replays: int) -> float:
    """Median time per call of ``fn`` over ``replays`` replays of a graph of ``launches`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        # capture_begin / capture_end, not torch.cuda.graph: its entry synchronizes and empties the device and
        # pinned-host allocator caches on each of the hundreds of captures a cold start's tuning makes.
        # "thread_local": the compile pool's threads may call CUDA while this thread captures.
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for _ in range(launches):
                fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()  # warm
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / launches)
    return sorted(times)[len(times) // 2]
