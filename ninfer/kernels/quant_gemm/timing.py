"""How the quantized GEMM's tuner times its candidates: decode sizes from CUDA-graph replays (as the engine runs
them), prefill sizes eagerly; nothing in a parallel-compile dry pass (:mod:`ninfer.kernels.precompile`)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton

from ninfer.kernels.precompile import dry_pass_active


def time_candidates(cands: list[Any], launch: Callable[[Any], None], graphs: bool) -> dict[Any, float]:
    """Milliseconds per launch of each candidate that fits the GPU.

    Decode-sized calls (``graphs``) are timed from CUDA-graph replays, as the engine runs them: their
    kernels take 5-50 µs, less than Python needs to launch them, so eager timing measured the launch
    overhead instead (it made the tuner prefer one-launch ``tl.dot`` configs over two-launch split-K
    GEMVs that are up to 2x faster on the GPU). Falls back to eager timing if a capture fails."""
    timings: dict[Any, float] = {}
    for cfg in cands:
        try:
            fn = lambda cfg=cfg: launch(cfg)  # noqa: E731
            timings[cfg] = graph_ms(fn) if graphs else triton.testing.do_bench(fn, warmup=5, rep=20)
        except triton.runtime.errors.OutOfResources:
            continue  # too much shared memory or too many registers on this GPU
        except RuntimeError:  # a capture that failed: time every candidate the same (eager) way
            if not graphs:
                raise
            torch.cuda.synchronize()
            return time_candidates(cands, launch, graphs=False)
    return timings


def graph_ms(fn: Callable[[], None], launches: int = 20, replays: int = 5) -> float:
    """Median time per call of ``fn`` over replays of a graph of ``launches`` back-to-back calls (0.0 in a
    parallel-compile dry pass, whose launches run nothing: one call requests the kernel, as its ``do_bench``)."""
    fn()  # compile and allocate outside the capture
    if dry_pass_active():
        return 0.0
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
