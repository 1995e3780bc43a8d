#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks named on the command line (default: all kernels).
#   perf/gpu_suite.sh tests elementwise deltanet attention sampling quant_gemm moe prefix_cache server engine
# Logs and JSON records land in $OUT (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-perf/results/tmp}; mkdir -p "$OUT"; export OUT PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:$PWD/perf:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
parts=${*:-tests elementwise deltanet attention sampling quant_gemm}
for part in $parts; do
  echo "=== $part ==="
  case $part in
    tests) timeout 420 python3 -m pytest -m gpu tests/gpu -q -x --timeout=300 -p no:cacheprovider 2>&1 | tail -60 | tee "$OUT/gpu_tests.log" ;;
    tests:*) timeout 420 python3 -m pytest -m gpu "tests/gpu/test_${part#tests:}.py" -q -p no:cacheprovider 2>&1 | tail -40 | tee -a "$OUT/gpu_tests.log" ;;
    engine) timeout 480 python3 perf/bench_engine.py ${ENGINE_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" ;;
    *) timeout 240 python3 "perf/bench_$part.py" 2>&1 | tee -a "$OUT/bench.log" ;;
  esac
done
