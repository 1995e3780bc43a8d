"""The kernel timeline of decode steps replayed from CUDA graphs: how much of a step the GPU is busy, how much of
it runs two or more kernels at once (the graph's branches from a second stream, ``ninfer/kernels/overlap.py``),
and how long it idles between kernels. Read from a torch.profiler trace (its Chrome-trace JSON: kernel events
with start, duration and stream); ``perf/profile_step.py --timeline`` prints it beside the eager step's kernels.
"""
from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

Interval = tuple[float, float, int]  # start and end (µs), stream
# An idle gap this long is the host's: inside a replayed graph kernels follow each other within a few µs, so longer
# gaps are the time between steps the GPU waits for the engine (sampling, scheduling, the next step's inputs).
LONG_GAP_US = 20.0


def kernel_intervals(trace: dict[str, Any]) -> list[Interval]:
    """Every kernel of a Chrome trace as (start, end, stream)."""
    return [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), int(e.get("args", {}).get("stream", -1)))
            for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]


def summarize(intervals: list[Interval], steps: int = 1) -> dict[str, Any]:
    """Per step: kernels, their summed time, the time at least one runs (busy), two or more at once (concurrent),
    the span from the first start to the last end and what of it is idle (and idle in gaps over LONG_GAP_US);
    kernels and time per stream."""
    if not intervals:
        return dict(kernels=0, kernel_ms=0.0, busy_ms=0.0, concurrent_ms=0.0, span_ms=0.0, idle_ms=0.0,
                    long_gap_ms=0.0, streams={})
    edges = sorted([(s, 1) for s, _, _ in intervals] + [(e, -1) for _, e, _ in intervals])
    busy = concurrent = long_gaps = 0.0
    depth, last = 0, edges[0][0]
    for t, step in edges:
        if depth >= 1:
            busy += t - last
        if depth >= 2:
            concurrent += t - last
        if depth == 0 and t - last > LONG_GAP_US:
            long_gaps += t - last
        depth, last = depth + step, t
    span = max(e for _, e, _ in intervals) - min(s for s, _, _ in intervals)
    streams: dict[int, list[float]] = defaultdict(lambda: [0, 0.0])
    for s, e, stream in intervals:
        streams[stream][0] += 1
        streams[stream][1] += e - s
    per = 1e3 * steps  # µs over the profiled steps -> ms per step
    return dict(kernels=len(intervals) / steps, kernel_ms=sum(e - s for s, e, _ in intervals) / per, busy_ms=busy / per,
                concurrent_ms=concurrent / per, span_ms=span / per, idle_ms=(span - busy) / per,
                long_gap_ms=long_gaps / per,
                streams={str(k): dict(kernels=v[0] / steps, ms=v[1] / per) for k, v in sorted(streams.items())})


def profile_timeline(run: Callable[[], Any], steps: int) -> dict[str, Any]:
    """:func:`summarize` of the CUDA kernels ``run()`` launches (``steps`` steps of them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return summarize(kernel_intervals(trace), steps)
