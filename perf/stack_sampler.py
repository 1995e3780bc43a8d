"""Run a Python script while a thread prints where its main thread is every few seconds.

    python perf/stack_sampler.py [--every 25] [--frames 9] perf/bench_engine.py --shape 27b --recipe int4 ...

Each sample is one line: seconds since start, then the innermost ``--frames`` frames of the main thread that lie
in the script, ninfer, perf, Triton or torch.cuda (innermost first). A long start that never reports progress (warm-up
compiling and tuning) shows this way which phase holds it, which is how the parallel-compile dry pass's graph
timing was found (docs/performance.md, start-up). Reading another thread's frames through
``sys._current_frames`` is safe, unlike ``faulthandler.dump_traceback_later``, which crashed such a run.
"""
from __future__ import annotations

import argparse
import runpy
import sys
import threading
import time
import traceback

_KEEP = ("ninfer", "/perf/", "triton", "torch/cuda")


def _sample(main_id: int, every: float, frames: int, t0: float, script: str, stop: threading.Event) -> None:
    while not stop.wait(every):
        frame = sys._current_frames().get(main_id)
        if frame is None:
            return
        stack = [f"{fs.filename.rsplit('/', 1)[-1]}:{fs.lineno} {fs.name}" for fs in traceback.extract_stack(frame)
                 if fs.filename == script or any(k in fs.filename for k in _KEEP)]
        print(f"[stack {time.perf_counter() - t0:.0f}s] " + " < ".join(reversed(stack[-frames:])), flush=True)


def start(every: float, script: str, frames: int = 9) -> threading.Event:
    """Sample the main thread from now on (a daemon thread); setting the returned event stops it."""
    stop = threading.Event()
    threading.Thread(target=_sample, args=(threading.main_thread().ident, every, frames, time.perf_counter(), script,
                                          stop), daemon=True).start()
    return stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=25.0, help="seconds between samples")
    parser.add_argument("--frames", type=int, default=9, help="innermost frames per sample")
    parser.add_argument("script", help="the Python script to run (as __main__)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args()
    sys.argv = [args.script, *args.args]
    start(args.every, args.script, args.frames)
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
