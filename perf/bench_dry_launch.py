"""What one launch costs inside the parallel compile's dry pass (:mod:`ninfer.kernels.precompile`), on a CPU.

A start-up's dry passes launch every kernel of the warm-up's forwards (~35k launches for the 27B) without
running any; on a warm cache each launch only finds its kernel. This measures that per-launch host cost for a
kernel already in Triton's disk cache, through a stand-in driver (device 0 with an sm_90 target: Triton binds,
specialises and compiles as on the GPU, and nothing can launch), with the pending kernel put into the
function's cache at its first launch (as ``precompile`` does) and, with ``--without-early-cache``, as Triton 3.6
alone does it (the cache filled when the pass ends)::

    python perf/bench_dry_launch.py                         # Triton 3.6 (the GPU image's): ~14 us
    python perf/bench_dry_launch.py --without-early-cache   # ~150 us (libdevice hashed at every launch)

No GPU, no records: a diagnostic for the start-up numbers of docs/performance.md.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

from ninfer.kernels import precompile


class StandInDriver:
    """Device 0 with an sm_90 target: enough for Triton to bind and compile; it cannot launch (also the CPU
    tests' driver, ``tests/kernels/test_precompile.py``)."""

    target = GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _twice(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=2000)
    p.add_argument("--without-early-cache", action="store_true",
                   help="as Triton alone: the pending kernel reaches the function's cache when the pass ends")
    args = p.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # real compiles for the stand-in target
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="ninfer-dry-"))
    precompile.INTERPRET = False
    triton.runtime.driver.set_active(StandInDriver())
    if args.without_early_cache:
        precompile._dry_do_compile = lambda original: original
    x, y = torch.zeros(1024), torch.zeros(1024)
    first = JITFunction(_twice)
    precompile.precompile(lambda: first[(1,)](x, y, 1024, BLOCK=32), workers=1)  # into Triton's disk cache
    kernel = JITFunction(_twice)  # an empty in-memory cache, as in a new process
    t0 = time.perf_counter()
    result = precompile.precompile(lambda: [kernel[(1,)](x, y, 1024, BLOCK=32) for _ in range(args.launches)],
                                   workers=1)
    seconds = time.perf_counter() - t0
    print(f"triton {triton.__version__}, {'without' if args.without_early_cache else 'with'} the early cache: "
          f"{seconds / args.launches * 1e6:.0f} us per dry launch of a kernel in the disk cache "
          f"({args.launches} launches, {result.jobs} load)")


if __name__ == "__main__":
    main()
