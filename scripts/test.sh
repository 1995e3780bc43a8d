#!/usr/bin/env bash
# Install ninfer with its test extras and run the CPU test suite (what CI runs).
# torch is pinned so that pip never resolves a bare, multi-GB "torch" on its own.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.14.1" "torchvision==0.29.1" -e ".[dev,vision,structured]"
export TOKENIZERS_PARALLELISM=false
# One worker per core (pytest-xdist), at most 8: the suite is CPU-bound (kernels in the Triton interpreter) and
# each worker holds its own torch; on CI's two cores this halves the wall time.
python -m pytest -q -n auto --maxprocesses 8 "$@"
