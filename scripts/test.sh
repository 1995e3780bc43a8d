#!/usr/bin/env bash
# Install ninfer with its test extras and run the CPU test suite (what CI runs).
# torch is pinned so that pip never resolves a bare, multi-GB "torch" on its own.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.14.1" "torchvision==0.29.1" -e ".[dev,vision,structured]"
export TOKENIZERS_PARALLELISM=false
python -m pytest -q "$@"
