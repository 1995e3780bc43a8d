"""Exit 0 when this machine's CUDA GPU model has no shipped tuning table (``ninfer/kernels/tuned/``), else 1.

``perf/gpu_runbook.sh`` asks it before its stages: on such a GPU every engine start tunes every key, and the
runbook has the benchmarks export those choices so that the GPU model gets a table (``perf/ship_tuning.py``).
"""
from __future__ import annotations

import sys

import torch

from ninfer.kernels import shipped


def main() -> int:
    if not torch.cuda.is_available():
        return 1
    stem = shipped.table_stem(torch.device("cuda"))
    if stem is None or shipped.folder().joinpath(f"{stem}.json").is_file():
        return 1
    print(f"no shipped tuning table for {stem}: the benchmarks export what they tune", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
